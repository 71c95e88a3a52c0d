"""Paged prefill attention: a chunk of new query tokens per sequence against its paged context.

    query:            [T, H_q, D]   the new tokens of all sequences, back to back
    k/v_cache:        [num_blocks, block_size, H_kv, D]   one layer's view of the pool
    block_tables:     [S, max_blocks] int32
    seq_lens:         [S] int32     context length INCLUDING the new chunk
    query_start_loc:  [S + 1] int32 cumulative query lengths; q_len[s] = qsl[s + 1] - qsl[s]
    -> out:           [T, H_q, D]

Query token j of sequence s sits at position seq_lens[s] - q_len[s] + j and attends to every
position up to its own, or with `sliding_window` W only to the last W of them; `softcap` caps
the scaled scores (paged_tile). The chunk's K/V must already be in the cache (store_kv), so a
cached prefix (a prefix-cache hit, or earlier chunks of a chunked prefill) is read, never
recomputed.

The Triton kernel runs one program per (sequence, query head, BLOCK_M query rows) and walks the
context in TILE_N-position tiles (paged_tile.attend_tile). The "cpu" backend's prefill is C
(cpu_paged, the decode's kernel over chunks). The torch version is the "torch" backend's and the
tests' reference (of the Triton and the C kernels), with no loop over sequences or tokens: it
pads the queries to the longest chunk, gathers every context padded to the longest with one
index_select per cache (gather_context), and runs one masked SDPA call in fp32 (attend), which
holds no score matrix; with a softcap, which SDPA lacks, it holds [S, H_q, max_q_len,
max_seq_len] fp32 scores at once.
"""

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.model_runner.kernels.paged_checks import (
    CacheGeometry,
    check_attention_args,
    check_index,
    check_window_softcap,
    slot_rows,
)
from pagedkv.model_runner.kernels.paged_tile import (
    attend_tile,
    dot_dtype,
    head_dim_pad,
    score_scales,
)
from pagedkv.model_runner.kernels.per_forward import PerForward, shared
from pagedkv.model_runner.kernels.triton_env import launch, require_triton_device, tl, triton
from pagedkv.model_runner.kernels.tuned_configs import ConfigKey, LaunchOptions, launch_options

# Query rows per program (BLOCK_M) and context positions per tile (TILE_N): 64 each, smaller
# where such tiles would spill registers on sm_90 (test_kernels_compile asserts STACK:0 for every
# head_dim and dtype the families use), keyed on (head_dim_pad, dtype).
TILES = (64, 64)
SMALLER_TILES = {
    (128, torch.float32): (32, 64),
    (256, torch.float16): (32, 32),
    (256, torch.bfloat16): (32, 32),
    (256, torch.float32): (16, 64),
}


# Launch options when the tuned table (tuned_configs) lacks the launch's key.
DEFAULT_OPTIONS = LaunchOptions(num_warps=8, num_stages=2)


def prefill_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, TILE_N) of the prefill kernel for a model's head_dim and dtype."""
    return SMALLER_TILES.get((head_dim_pad(head_dim), dtype), TILES)


# The tables and lengths of a mixed batch's prefill rows are views past its decode rows
# (paged_attention), at any offset: no alignment hint (they are read one value at a time), so
# their variant is the one a prefill-only batch compiled.
@triton.jit(do_not_specialize=[  # type: ignore[untyped-decorator]
    "window", "stride_qt", "stride_qh", "stride_bts", "stride_ot", "stride_oh"],
    do_not_specialize_on_alignment=["Block_tables", "Seq_lens"])
def _prefill_kernel(  # type: ignore[no-untyped-def]
    Q, K_cache, V_cache, Block_tables, Seq_lens, Query_start_loc, Out,
    qk_scale, cap_log2, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16)  # tl.dot's minimum on GPUs
    tl.static_assert(TILE_N >= 16)
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    m_tile = tl.program_id(2)
    # -- this program's rows of the sequence's chunk (programs past a short chunk exit) --
    q_start = tl.load(Query_start_loc + seq).to(tl.int64)
    q_len = tl.load(Query_start_loc + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(Seq_lens + seq)
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row within the chunk
    q_pos = seq_len - q_len + offs_m  # [BLOCK_M] context position of each row
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    # -- load q [BLOCK_M, HEAD_DIM_PAD] in the dots' operand dtype: it stays in registers --
    q_rows = (q_start + offs_m)[:, None] * stride_qt
    q = tl.load(Q + q_rows + head * stride_qh + offs_d[None, :] * stride_qd, mask=row_mask,
                other=0.0)
    q = q.to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # -- walk the context from the first row's window start (later rows' windows start later)
    #    up to the last row's position --
    first_row_pos = seq_len - q_len + m_tile * BLOCK_M
    kv_start = tl.maximum(first_row_pos - window + 1, 0) if WINDOWED else 0
    kv_end = tl.minimum(seq_len, seq_len - q_len + (m_tile + 1) * BLOCK_M)
    offs_n = tl.arange(0, TILE_N)
    for tile in range(kv_start // TILE_N, tl.cdiv(kv_end, TILE_N)):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, qk_scale, cap_log2, window,
            K_cache, V_cache, Block_tables + seq * stride_bts,
            tile * TILE_N + offs_n, q_pos, seq_len, head // GROUP,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, WINDOWED, SOFTCAP,
        )
    # -- normalize and store the chunk's rows (each counted its own position, so l_i > 0;
    #    a padding row past the chunk may have counted nothing and is not stored) --
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + offs_m)[:, None] * stride_ot
    tl.store(Out + o_rows + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=row_mask)


def check_prefill_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    check_values: bool,
) -> CacheGeometry:
    """Validate a prefill's arguments (check_attention_args, and query_start_loc [S + 1] int32;
    with `check_values`, a read-back, that it runs from 0 to T in chunks of 1 to seq_len rows);
    return the cache geometry. Shared by every backend's prefill."""
    geometry = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, check_values)
    num_seqs = seq_lens.shape[0]
    check_index("query_start_loc", query_start_loc, torch.int32, (num_seqs + 1,), k_cache.device)
    if check_values:
        q_lens = query_start_loc.diff()
        first, last = int(query_start_loc[0]), int(query_start_loc[-1])
        if first != 0 or last != query.shape[0]:
            raise ValueError(f"query_start_loc must run from 0 to T={query.shape[0]}, "
                             f"got {first} to {last}")
        if bool((q_lens < 1).any()) or bool((q_lens > seq_lens).any()):
            raise ValueError("every query length must be in [1, seq_len]")
    return geometry


def paged_prefill_attention_triton(
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
    """Triton: causal attention of each sequence's new chunk over its paged context.

    The grid is sized by `max_q_len`, the longest chunk as the host knows it (the runner's
    step), so nothing is read back from the device (a CUDA graph may capture the launch); None
    reads it back, once per forward."""
    geometry = check_prefill_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           check_values)
    window, cap = check_window_softcap(sliding_window, softcap)
    require_triton_device(query.device, _prefill_kernel)
    out = torch.empty_like(query)
    num_seqs, (num_tokens, num_q_heads, head_dim) = seq_lens.shape[0], query.shape
    if num_tokens == 0:
        return out
    max_q_len = longest_chunk(max_q_len, query_start_loc, num_tokens, check_values, per_forward)
    block_m, tile_n = prefill_tiles(head_dim, query.dtype)
    group = num_q_heads // geometry.num_kv_heads
    grid = (num_seqs, num_q_heads, triton.cdiv(max_q_len, block_m))
    launch(
        _prefill_kernel, grid,
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        *score_scales(scale, cap), window,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *out.stride(),
        GROUP=group, BLOCK_SIZE=geometry.block_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
        BLOCK_M=block_m, TILE_N=tile_n, WINDOWED=window > 0, SOFTCAP=cap > 0,
        DOT_DTYPE=dot_dtype(query.dtype, _prefill_kernel),
        **launch_options(ConfigKey.of("prefill", head_dim, group, query.dtype, k_cache.dtype),
                         DEFAULT_OPTIONS).kwargs(),
    )
    return out


def longest_chunk(max_q_len: int | None, query_start_loc: torch.Tensor, num_tokens: int,
                  check_values: bool, per_forward: PerForward | None) -> int:
    """The longest chunk: `max_q_len` from the host, or read back once per forward when None.
    ValueError unless it is an int in [1, num_tokens] and, when `check_values` (a read-back),
    no chunk is longer: a short grid would leave query rows no program computes."""
    if max_q_len is None:
        return shared(per_forward, ("max_q_len",), lambda: int(query_start_loc.diff().max()))
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or not (
            1 <= max_q_len <= num_tokens):
        raise ValueError(f"max_q_len must be None or an int in [1, {num_tokens}] (the query's "
                         f"tokens), got {max_q_len!r}")
    if check_values and int(query_start_loc.diff().max()) > max_q_len:
        raise ValueError(f"max_q_len={max_q_len} is shorter than the longest chunk "
                         f"({int(query_start_loc.diff().max())})")
    return max_q_len


class _Workspace(threading.local):
    """One byte buffer per thread that gather_context reuses for the gathered K/V on the CPU.

    A fresh tensor per call is multi-MB; glibc hands such a block back to the OS when it is freed
    (mmap above its threshold, or a trim of the heap top), so each call would page-fault every
    4 KiB page of it again, which on a VM costs more than the gather itself. Grows, never
    shrinks: it holds the biggest step's context (per thread) for the process's life.
    """

    buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor of `shape`, valid until the next take on this thread."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # free the old buffer before allocating the new one
            with torch.inference_mode(False):  # writable inside and outside inference mode
                self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes].view(dtype).view(shape)


_WORKSPACE = _Workspace()


@dataclass(frozen=True)
class ContextIndex:
    """Where each sequence's context lies in a cache, padded to the longest (gather_context):
    the same for every layer of a forward, so it is computed once per forward (per_forward)."""

    # [S * L] int64: the row in the caches' slot_rows of each column of each row (column 0's
    # past the row's context, so every value read is a written token's).
    rows: torch.Tensor
    # [S, L] int64: the position of each column.
    positions: torch.Tensor
    # [S, L] bool: first[s] <= position < seq_lens[s].
    valid: torch.Tensor


def context_index(block_tables: torch.Tensor, seq_lens: torch.Tensor, geometry: CacheGeometry,
                  first: torch.Tensor | None = None) -> ContextIndex:
    """Each sequence's context from position first[s] (default 0) to seq_lens[s], whole blocks,
    padded to the longest. Column 0 of row s is the start of the block holding position
    first[s]. No loop, no division per position, each index in one fused op (add's alpha)."""
    num_seqs, device = seq_lens.shape[0], seq_lens.device
    block_size = geometry.block_size
    first_block = None if first is None else first // block_size  # [S]
    span = seq_lens if first_block is None else seq_lens - first_block * block_size  # [S]
    cols = torch.arange(int(triton.cdiv(int(span.max()), block_size)), device=device)  # [C]
    cols = cols.expand(num_seqs, -1) if first_block is None else first_block[:, None] + cols
    # -- [S, C] block ids; columns past the table (short sequences) are clamped, and
    #    entries past a sequence's used blocks (-1) are read but their slots replaced --
    blocks = block_tables.gather(1, cols.clamp_max(block_tables.shape[1] - 1))
    offsets = torch.arange(block_size, device=device)
    # [S, L] int64: offset + rows_per_block * block (the row), offset + block_size * column
    rows = torch.add(offsets, blocks[:, :, None], alpha=geometry.rows_per_block).view(num_seqs, -1)
    positions = torch.add(offsets, cols[:, :, None], alpha=block_size).view(num_seqs, -1)
    valid = positions < seq_lens[:, None]  # int32 against int64, no cast
    if first is not None:
        valid &= positions >= first[:, None]
    return ContextIndex(torch.where(valid, rows, rows[:, :1]).flatten(), positions, valid)


def gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor,
                   index: ContextIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of `index`'s columns: [S, L, H_kv, D] fp32 each, one index_select per
    cache over its slot_rows. Columns past a sequence hold a
    written token's values (stale slots may hold NaN, and a masked NaN still poisons SDPA's
    products); callers mask their scores. On the CPU they are views of this thread's workspace:
    valid until the next gather_context call on the same thread.
    """
    _, _, num_kv_heads, head_dim = k_cache.shape
    rows_per_block = k_cache.stride(0) // k_cache.stride(1)  # check_cache made it whole
    shape = (2, index.rows.shape[0], num_kv_heads, head_dim)
    # [2, S * L, H_kv, D]: K and V rows; a device's caching allocator already keeps its memory
    cpu = index.rows.device.type == "cpu"
    kv = _WORKSPACE.take(shape, k_cache.dtype) if cpu else k_cache.new_empty(shape)
    k_rows, v_rows = kv.unbind(0)
    torch.index_select(slot_rows(k_cache, rows_per_block), 0, index.rows, out=k_rows)
    torch.index_select(slot_rows(v_cache, rows_per_block), 0, index.rows, out=v_rows)
    num_seqs = index.valid.shape[0]
    keys, values = (rows.view(num_seqs, -1, num_kv_heads, head_dim) for rows in (k_rows, v_rows))
    if k_cache.dtype != torch.float32:  # attend computes in fp32 (no op per layer when it is)
        keys, values = keys.float(), values.float()
    return keys, values


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, counted: torch.Tensor,
           scale: float, cap: float) -> torch.Tensor:
    """softmax(scores) @ values in fp32, scores = q @ keys^T * scale (capped to cap * tanh(s /
    cap) when cap > 0) over the `counted` keys only.

    q [S, H_kv, R, D] (R query rows per KV head), keys/values [S, H_kv, L, D] (any strides),
    counted [S, 1, R, L]: bool (True: counted), or fp32 added to the scores (0: counted, -inf:
    not), as SDPA takes it; a ready fp32 mask spares SDPA converting a bool one per call.
    -> [S, H_kv, R, D]. A row that counts no key is undefined (NaN or 0) and must be dropped by
    the caller. Without a cap this is SDPA's fused kernel (no [R, L] score matrix in memory);
    SDPA has no softcap, so a cap computes the scores explicitly.
    """
    if not cap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=counted, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [S, H_kv, R, L]
    scores = torch.tanh(scores / cap) * cap
    if counted.dtype == torch.bool:
        scores = scores.masked_fill(~counted, float("-inf"))
    else:
        scores = scores + counted
    return torch.matmul(scores.softmax(-1), values)


def paged_prefill_attention_torch(
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
    """Torch: causal attention of each sequence's new chunk over its paged context
    (`max_q_len` is checked and otherwise unused: its plan reads the lengths on the host)."""
    geometry = check_prefill_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           check_values)
    window, cap = check_window_softcap(sliding_window, softcap)
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0:
        return torch.empty_like(query)
    if max_q_len is not None:
        longest_chunk(max_q_len, query_start_loc, num_tokens, check_values, None)
    num_seqs, num_kv_heads = seq_lens.shape[0], geometry.num_kv_heads
    group = num_q_heads // num_kv_heads
    plan = shared(per_forward, ("prefill", window, group), lambda: _prefill_plan(
        block_tables, seq_lens, query_start_loc, num_tokens, group, geometry, window))
    max_q_len = plan.max_q_len
    # -- scatter the tokens into a padded [S, max_q, H_q, D] query (a copy-free view when the
    #    chunks are equally long) --
    if plan.seq_of is None or plan.row_of is None:
        q = query.float().view(num_seqs, max_q_len, num_q_heads, head_dim)
    else:
        q = query.new_zeros((num_seqs, max_q_len, num_q_heads, head_dim), dtype=torch.float32)
        q[plan.seq_of, plan.row_of] = query.float()
    # -- [S, H_kv, G * max_q, D]: a KV head's G query heads are rows of one attention --
    q = q.view(num_seqs, max_q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * max_q_len, head_dim)
    keys, values = gather_context(k_cache, v_cache, plan.index)
    out = attend(q, keys.transpose(1, 2), values.transpose(1, 2), plan.counted, scale, cap)
    # [S, H_kv, G * max_q, D] -> [S, max_q, H_q, D] -> the tokens' rows [T, H_q, D]
    out = out.view(num_seqs, num_q_heads, max_q_len, head_dim).transpose(1, 2)
    if plan.seq_of is None or plan.row_of is None:
        return out.reshape(num_tokens, num_q_heads, head_dim).to(query.dtype)
    return out[plan.seq_of, plan.row_of].to(query.dtype)


@dataclass(frozen=True)
class _PrefillPlan:
    """What a torch prefill computes once per forward (per_forward), for every layer."""

    # The longest chunk: queries are padded to [S, max_q_len].
    max_q_len: int
    # [T] int64: the sequence and padded row of each query token; None when every chunk is
    # max_q_len long (the padded query is then a view).
    seq_of: torch.Tensor | None
    row_of: torch.Tensor | None
    # The contexts, from the first row's window start.
    index: ContextIndex
    # [S, 1, G * max_q, L] bool: the keys each padded query row counts.
    counted: torch.Tensor


def _prefill_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, num_tokens: int, group: int,
                  geometry: CacheGeometry, window: int) -> _PrefillPlan:
    num_seqs, device = seq_lens.shape[0], seq_lens.device
    lens = seq_lens.long()
    q_lens = query_start_loc.diff().long()  # [S]
    max_q_len = int(q_lens.max())
    seq_of = row_of = None
    if num_tokens != num_seqs * max_q_len:
        seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens,
                                         output_size=num_tokens)  # [T]
        row_of = torch.arange(num_tokens, device=device) - query_start_loc[seq_of]  # [T]
    # -- the context from the first row's window start; row r of sequence s sees positions
    #    <= its own (the last `window` of them); a padding row may see none and is dropped --
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q_len, device=device)  # [S, max_q]
    first = (q_pos[:, 0] - window + 1).clamp_min(0) if window else None
    index = context_index(block_tables, seq_lens, geometry, first)
    positions = index.positions[:, None, :]  # [S, 1, L]
    counted = index.valid[:, None, :] & (positions <= q_pos[:, :, None])  # [S, max_q, L]
    if window:
        counted &= positions > q_pos[:, :, None] - window
    if group > 1:
        counted = counted[:, None].expand(-1, group, -1, -1).flatten(1, 2)  # [S, G * max_q, L]
    return _PrefillPlan(max_q_len, seq_of, row_of, index, counted[:, None])
