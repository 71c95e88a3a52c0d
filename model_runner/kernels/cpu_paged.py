"""The CPU backend's C kernels (_cpu_paged*.c): store_kv and paged attention, in place.

    store_kv:  key, value [T, H_kv, D] -> k/v_cache rows of slot_mapping [T] int64 (-1: none)
    decode:    query [S, H_q, D] against k/v_cache [num_blocks, block_size, H_kv, D] through
               block_tables [S, max_blocks] int32 and seq_lens [S] int32 -> [S, H_q, D]
    prefill:   query [T, H_q, D]: sequence s's causal chunk is rows query_start_loc[s] to
               query_start_loc[s + 1] ([S + 1] int32), its context's last positions -> [T, H_q, D]

Same signatures and semantics as the torch twins (store_kv_torch, paged_decode_attention_torch,
paged_prefill_attention_torch, the tests' reference): scale, sliding window, softcap, GQA, every
cache dtype the twins take (fp32, fp16, bf16, fp8 e4m3 with the scale 1.0). Decode and prefill
are one C kernel (a decode is a chunk of one query per sequence). The twins' checks run here first
(dtypes, devices, shapes, strides: no read-back); the C code then checks every value it reads
through (slot ids, block ids a sequence uses, lengths against the table, the chunks' offsets)
whatever `check_values` says, since that costs one pass over the tables in C, and raises
ValueError naming the first bad value before anything is read through them or written. Nothing
needs a per-forward plan (no gather index, no masks, no length groups): the kernel reads each
sequence's blocks where they lie.

PAGEDKV_CPU_KERNELS=portable, read at import, runs the loops' portable copy on a CPU with AVX2
(the tests run both copies); unset or "auto" picks AVX2+FMA where the CPU has it.

The query is attended in fp32 (`query.float()`, no copy for fp32) and the result converted to
the query's dtype, as the twin does.
"""

from typing import NamedTuple

import torch

from pagedkv.model_runner.kernels import _cpu_paged
from pagedkv.model_runner.kernels.paged_checks import (
    CacheGeometry,
    check_attention_args,
    check_window_softcap,
)
from pagedkv.model_runner.kernels.paged_decode import check_decode_shapes, context_bound
from pagedkv.model_runner.kernels.paged_prefill import check_prefill_args, longest_chunk
from pagedkv.model_runner.kernels.per_forward import PerForward
from pagedkv.model_runner.kernels.store_kv import check_store_args

# The C code's numbering of element dtypes (_cpu_paged.c's DT_*).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}


class CacheArgs(NamedTuple):
    """A K/V cache pair as the C code takes it; check_cache gave V the strides of K."""

    k: int  # address of k_cache's first element
    v: int  # address of v_cache's first element
    dtype: int  # DTYPE_CODES of both
    stride_b: int  # elements from one block to the next
    stride_s: int  # from one slot to the next
    stride_h: int  # from one KV head to the next (head_dim is contiguous)
    num_blocks: int  # blocks of the pool: the bound of a block id
    block_size: int  # slots per block
    num_kv_heads: int  # H_kv
    head_dim: int  # D

    @classmethod
    def of(cls, k_cache: torch.Tensor, v_cache: torch.Tensor,
           geometry: CacheGeometry) -> "CacheArgs":
        stride_b, stride_s, stride_h, _ = k_cache.stride()
        return cls(k_cache.data_ptr(), v_cache.data_ptr(), DTYPE_CODES[k_cache.dtype],
                   stride_b, stride_s, stride_h, geometry.num_blocks, geometry.block_size,
                   geometry.num_kv_heads, geometry.head_dim)


def vectorized() -> bool:
    """Whether the C loops run their AVX2+FMA copy on this CPU (else the portable one)."""
    return _cpu_paged.vectorized()


def store_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    per_forward: PerForward | None = None,
) -> None:
    """C: copy key/value rows into the cache at `slot_mapping` (in place); an fp8 cache
    saturates to +-FP8_MAX and rounds to e4m3 (to nearest even, as torch's cast). The slots are
    always checked (`check_values` is moot) and nothing is shared through `per_forward`."""
    geometry = check_store_args(key, value, k_cache, v_cache, slot_mapping, check_values=False)
    _require_cpu(k_cache)
    _cpu_paged.store_kv(
        CacheArgs.of(k_cache, v_cache, geometry),
        key.data_ptr(), value.data_ptr(), DTYPE_CODES[key.dtype], key.shape[0],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        slot_mapping.data_ptr(), slot_mapping.stride(0),
    )


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    check_values: bool = True,
    per_forward: PerForward | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """C: attention of each sequence's one new query over its paged context, in one pass with
    an online softmax. `num_splits` and `max_seq_len` are checked and otherwise ignored (one
    pass per sequence); block ids and lengths are always checked, `check_values` only adds
    max_seq_len's check against seq_lens (a read-back), as in the twin."""
    geometry = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens,
                                    check_values=False)
    check_decode_shapes(query, seq_lens, num_splits)
    context_bound(max_seq_len, block_tables, seq_lens, geometry, check_values)
    window, cap = check_window_softcap(sliding_window, softcap)
    _require_cpu(k_cache)
    q = query.float()  # [S, H_q, D], D contiguous (check_tokens)
    out = torch.empty(q.shape, dtype=torch.float32)  # contiguous, as the C code writes it
    _cpu_paged.decode(
        CacheArgs.of(k_cache, v_cache, geometry),
        q.data_ptr(), out.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        q.shape[0], q.shape[1], block_tables.shape[1], q.stride(0), q.stride(1),
        block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
        float(scale), cap, window,
    )
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def paged_prefill_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    check_values: bool = True,
    per_forward: PerForward | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """C: causal attention of each sequence's new chunk over its paged context, the decode's
    kernel over every row of the chunk. Block ids, lengths and query_start_loc are always
    checked; `max_q_len` is checked as in the twin (against the chunks with `check_values`) and
    otherwise unused, and nothing is shared through `per_forward`."""
    geometry = check_prefill_args(query, k_cache, v_cache, block_tables, seq_lens,
                                  query_start_loc, check_values=False)
    window, cap = check_window_softcap(sliding_window, softcap)
    _require_cpu(k_cache)
    if query.shape[0] == 0:  # nothing to attend, as in the twin
        return torch.empty_like(query)
    if max_q_len is not None:
        longest_chunk(max_q_len, query_start_loc, query.shape[0], check_values, None)
    q = query.float()  # [T, H_q, D], D contiguous (check_tokens)
    out = torch.empty(q.shape, dtype=torch.float32)  # contiguous, as the C code writes it
    _cpu_paged.prefill(
        CacheArgs.of(k_cache, v_cache, geometry),
        q.data_ptr(), out.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        query_start_loc.data_ptr(), seq_lens.shape[0], q.shape[0], q.shape[1],
        block_tables.shape[1], q.stride(0), q.stride(1), block_tables.stride(0),
        block_tables.stride(1), seq_lens.stride(0), query_start_loc.stride(0),
        float(scale), cap, window,
    )
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _require_cpu(cache: torch.Tensor) -> None:
    """ValueError for a cache off the CPU: the C code reads its address in host memory (the
    checks before put every other tensor on the cache's device)."""
    if cache.device.type != "cpu":
        raise ValueError(f"the cpu attention backend takes CPU tensors, the cache is on "
                         f"{cache.device}: use the triton or torch backend")
