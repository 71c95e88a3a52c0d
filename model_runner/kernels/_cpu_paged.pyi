"""Types of the C extension _cpu_paged (_cpu_paged*.c; cpu_paged.py wraps it: `cache` is its
CacheArgs, addresses come from data_ptr(), strides are in elements)."""

def decode(cache: tuple[int, ...], q: int, out: int, tables: int, lens: int, num_seqs: int,
           num_q_heads: int, table_width: int, stride_qs: int, stride_qh: int, stride_ts: int,
           stride_tb: int, stride_l: int, scale: float, cap: float, window: int, /) -> None: ...
def prefill(cache: tuple[int, ...], q: int, out: int, tables: int, lens: int, starts: int,
            num_seqs: int, num_tokens: int, num_q_heads: int, table_width: int, stride_qt: int,
            stride_qh: int, stride_ts: int, stride_tb: int, stride_l: int, stride_starts: int,
            scale: float, cap: float, window: int, /) -> None: ...
def store_kv(cache: tuple[int, ...], key: int, value: int, src_dtype: int, num_tokens: int,
             stride_kt: int, stride_kh: int, stride_vt: int, stride_vh: int, slots: int,
             stride_slot: int, /) -> None: ...
def vectorized() -> bool: ...
