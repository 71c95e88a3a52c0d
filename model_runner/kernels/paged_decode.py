"""Paged decode attention: one new query token per sequence against its paged context.

    query:         [S, H_q, D]
    k/v_cache:     [num_blocks, block_size, H_kv, D]   one layer's view of the pool
    block_tables:  [S, max_blocks] int32   entries past a sequence's last block are never read
    seq_lens:      [S] int32               context length, the new token included
    -> out:        [S, H_q, D]

The Triton kernel runs one program per (sequence, KV head, split). GQA: the H_q / H_kv query
heads that share a KV head are rows of one query tile (padded to GROUP_PAD >= 16 rows, tl.dot's
minimum), so each K/V tile is loaded once for the whole group. Split-K (flash-decoding): a long
context is cut into `num_splits` ranges of tiles processed in parallel, planned over the batch's
longest context (`max_seq_len`, from the host; the table's width without it); each writes a
normalized partial output and its log-sum-exp, and a second kernel merges them. With one split
the first kernel writes the output directly. With a sliding window of W, the splits cover only
the tiles the window reaches (at most cdiv(W + TILE_N - 1, TILE_N) of them), starting at the
tile of the window's first position; `softcap` caps the scaled scores (paged_tile).

The torch version groups the sequences by context length (length_groups), gathers each group's
contexts (only the window's blocks) padded to its longest with one index_select per cache, and
attends with the query heads of a KV head as rows of one SDPA call (paged_prefill.attend): it is
the "torch" backend and the tests' reference. The CPU's default backend decodes in C instead
(cpu_paged), reading the pool in place.
"""

from dataclasses import dataclass

import torch

from pagedkv.model_runner.kernels.paged_checks import (
    CacheGeometry,
    check_attention_args,
    check_window_softcap,
)
from pagedkv.model_runner.kernels.paged_prefill import (
    ContextIndex,
    attend,
    context_index,
    gather_context,
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
from pagedkv.vocab.blocks import blocks_for

# Context positions per tile.
TILE_N = 64
# Warps per split program when the tuned table (tuned_configs) lacks the launch's key: 4, or 8
# where 4 would spill registers on sm_90 (test_kernels_compile), keyed on (head_dim_pad, dtype).
WARPS = 4
MORE_WARPS = {(256, torch.float32): 8}
STAGES = 2
# Default split policy: aim for this many programs per SM, but give each split at least
# MIN_TILES_PER_SPLIT tiles (a short split costs more in the merge than it saves) and never more
# than MAX_SPLITS splits.
PROGRAMS_PER_SM = 2
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
# Torch decode ("torch" backend) pads a batch's contexts to the longest; it splits the batch into
# groups of similar length when a split saves at least this many gathered K elements (padded
# positions x H_kv x D), about what the split's extra ops cost on a CPU.
GROUP_MIN_SAVED = 1 << 17


@triton.jit(do_not_specialize=[  # type: ignore[untyped-decorator]
    "window", "tiles_per_split", "stride_qs", "stride_qh", "stride_bts",
    "stride_ps", "stride_ph", "stride_pk", "stride_ls", "stride_lh"])
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    Q, K_cache, V_cache, Block_tables, Seq_lens, Partial, Lse,
    qk_scale, cap_log2, window, tiles_per_split,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ps, stride_ph, stride_pk, stride_pd,
    stride_ls, stride_lh, stride_lk,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr, STORE_LSE: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    tl.static_assert(GROUP_PAD >= 16)  # tl.dot's minimum rows on GPUs
    tl.static_assert(GROUP_PAD >= GROUP)
    tl.static_assert(TILE_N >= 16)
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + seq)
    # -- this split's tiles, counted from the tile of the first position the query sees; split 0
    #    starts there, so it is never empty, and a split past the sequence runs no tile --
    first_pos = tl.maximum(seq_len - window, 0) if WINDOWED else 0
    tile_start = first_pos // TILE_N + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, tl.cdiv(seq_len, TILE_N))
    # -- load q: the group's query heads as rows [GROUP_PAD, HEAD_DIM_PAD], in the dots'
    #    operand dtype; padding rows are zero, score 0 everywhere and are never stored --
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_heads = kv_head * GROUP + offs_g  # [GROUP_PAD]
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + seq * stride_qs + q_heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    q_pos = tl.full([GROUP_PAD], 0, tl.int32) + seq_len - 1  # the new token sees everything
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for tile in range(tile_start, tile_end):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, qk_scale, cap_log2, window,
            K_cache, V_cache, Block_tables + seq * stride_bts,
            tile * TILE_N + offs_n, q_pos, seq_len, kv_head,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd, stride_btb,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, WINDOWED, SOFTCAP,
        )
    # -- store the normalized partial (an empty split stores 0 with log-sum-exp -inf) --
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    tl.store(Partial + seq * stride_ps + q_heads[:, None] * stride_ph + split * stride_pk
             + offs_d[None, :] * stride_pd, out.to(Partial.dtype.element_ty), mask=row_mask)
    if STORE_LSE:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(Lse + seq * stride_ls + q_heads * stride_lh + split * stride_lk, lse,
                 mask=offs_g < GROUP)


@triton.jit(do_not_specialize=[  # type: ignore[untyped-decorator]
    "num_splits", "stride_ps", "stride_ph", "stride_pk", "stride_ls", "stride_lh",
    "stride_os", "stride_oh"])
def _decode_merge_kernel(  # type: ignore[no-untyped-def]
    Partial, Lse, Out, num_splits,
    stride_ps, stride_ph, stride_pk, stride_pd,
    stride_ls, stride_lh, stride_lk,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    lse_row = Lse + seq * stride_ls + head * stride_lh
    partial_row = Partial + seq * stride_ps + head * stride_ph + offs_d * stride_pd
    # -- out = sum_k w_k * partial_k / sum_k w_k with w_k = exp2(lse_k - max lse), one split at
    #    a time against a running max (no tile sized by the split count: one compiled variant
    #    for every count). Split 0 is never empty, so the max is finite from the start; an empty
    #    split (past the sequence) has lse -inf and weight 0 --
    m = tl.load(lse_row)
    acc = tl.load(partial_row, mask=d_mask, other=0.0)  # [HEAD_DIM_PAD]
    total = tl.full([], 1.0, tl.float32)
    for k in range(1, num_splits):
        lse = tl.load(lse_row + k * stride_lk)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        partial = tl.load(partial_row + k * stride_pk, mask=d_mask, other=0.0)
        acc = acc * alpha + weight * partial
        total = total * alpha + weight
        m = m_new
    tl.store(Out + seq * stride_os + head * stride_oh + offs_d * stride_od,
             (acc / total).to(Out.dtype.element_ty), mask=d_mask)


def default_num_splits(num_programs: int, num_tiles: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) that fill `num_sms` SMs without making splits too short.

    `num_programs`: (sequence, KV head) pairs; `num_sms` 0 (no GPU: the interpreter runs
    programs one after another, so extra splits only cost time) gives 1.
    """
    wanted = int(triton.cdiv(PROGRAMS_PER_SM * num_sms, num_programs))
    return max(1, min(wanted, num_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def split_plan(num_splits: int | None, num_programs: int, max_context: int,
               device: torch.device, window: int = 0) -> tuple[int, int]:
    """(num_splits, tiles_per_split) covering the tiles one query reads: those of `max_context`
    positions, or at most those a `window` of positions (0 = none) reaches in any alignment.
    Every split starts inside them."""
    num_tiles = int(triton.cdiv(max_context, TILE_N))
    if window:
        num_tiles = min(num_tiles, int(triton.cdiv(window + TILE_N - 1, TILE_N)))
    if num_splits is None:
        cuda = device.type == "cuda"
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
        num_splits = default_num_splits(num_programs, num_tiles, num_sms)
    tiles_per_split = int(triton.cdiv(num_tiles, min(num_splits, num_tiles)))
    return int(triton.cdiv(num_tiles, tiles_per_split)), tiles_per_split


def paged_decode_attention_triton(
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
    """Triton: attention of each sequence's one new query over its paged context.

    The split count is sized from `max_seq_len`, the batch's longest context as the host knows
    it (the runner's step), so a table wider than every context creates no empty splits; None
    sizes it from the table's width (no device read-back either way). `num_splits` overrides
    the default policy.
    """
    geometry = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, check_values)
    check_decode_shapes(query, seq_lens, num_splits)
    longest = context_bound(max_seq_len, block_tables, seq_lens, geometry, check_values)
    window, cap = check_window_softcap(sliding_window, softcap)
    require_triton_device(query.device, _decode_split_kernel)
    out = torch.empty_like(query)
    num_seqs, num_q_heads, head_dim = query.shape
    if num_seqs == 0:
        return out
    requested = num_splits
    num_splits, tiles_per_split = shared(per_forward, ("splits", window, requested, longest),
                                         lambda: split_plan(requested,
                                                            num_seqs * geometry.num_kv_heads,
                                                            longest, query.device, window))
    group = num_q_heads // geometry.num_kv_heads
    # partial: [S, H_q, num_splits, D]; one split writes the output directly and no lse.
    if num_splits == 1:
        partial = out.unsqueeze(2)
    else:
        partial = query.new_empty((num_seqs, num_q_heads, num_splits, head_dim),
                                  dtype=torch.float32)
    lse = query.new_empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32)
    launch(
        _decode_split_kernel, (num_seqs, geometry.num_kv_heads, num_splits),
        query, k_cache, v_cache, block_tables, seq_lens, partial, lse,
        *score_scales(scale, cap), window, tiles_per_split,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *partial.stride(), *lse.stride(),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=geometry.block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
        TILE_N=TILE_N, STORE_LSE=num_splits > 1, WINDOWED=window > 0, SOFTCAP=cap > 0,
        DOT_DTYPE=dot_dtype(query.dtype, _decode_split_kernel),
        **launch_options(ConfigKey.of("decode", head_dim, group, query.dtype, k_cache.dtype),
                         default_options(head_dim, query.dtype)).kwargs(),
    )
    if num_splits > 1:
        launch(
            _decode_merge_kernel, (num_seqs, num_q_heads),
            partial, lse, out, num_splits, *partial.stride(), *lse.stride(), *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim),
        )
    return out


def default_options(head_dim: int, dtype: torch.dtype) -> LaunchOptions:
    """The split kernel's launch options for a key the tuned table lacks."""
    return LaunchOptions(MORE_WARPS.get((head_dim_pad(head_dim), dtype), WARPS), STAGES)


def context_bound(max_seq_len: int | None, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  geometry: CacheGeometry, check_values: bool) -> int:
    """The longest context the splits must cover: `max_seq_len`, or the table's capacity when
    None. ValueError unless it is an int in [1, capacity] and, when `check_values` (a read-back),
    no sequence is longer: a short bound would leave positions no split reads."""
    capacity = block_tables.shape[1] * geometry.block_size
    if max_seq_len is None:
        return capacity
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not (
            1 <= max_seq_len <= capacity):
        raise ValueError(f"max_seq_len must be None or an int in [1, {capacity}] "
                         f"(block_tables width x block_size), got {max_seq_len!r}")
    if check_values and seq_lens.numel() and int(seq_lens.max()) > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is shorter than the longest context "
                         f"({int(seq_lens.max())})")
    return max_seq_len


def check_decode_shapes(query: torch.Tensor, seq_lens: torch.Tensor,
                        num_splits: int | None) -> None:
    """ValueError unless there is one query per sequence and `num_splits` is None or >= 1."""
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"decode takes one query per sequence: {query.shape[0]} queries, "
                         f"{seq_lens.shape[0]} sequences")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def paged_decode_attention_torch(
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
    """Torch: attention of each sequence's one new query over its paged context.

    `num_splits` and `max_seq_len` are checked and otherwise ignored: this version attends in
    one pass. The length groups and their gather indices are computed once per forward
    (`per_forward`).
    """
    geometry = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, check_values)
    check_decode_shapes(query, seq_lens, num_splits)
    context_bound(max_seq_len, block_tables, seq_lens, geometry, check_values)
    window, cap = check_window_softcap(sliding_window, softcap)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    groups = shared(per_forward, ("decode", window), lambda: _decode_plan(
        block_tables, seq_lens, geometry, window))
    if groups[0].members is None:  # one group: the whole batch
        return _decode_group(query, k_cache, v_cache, groups[0], scale, cap)
    out = torch.empty_like(query)
    for group in groups:
        assert group.members is not None  # several groups name their members
        out.index_copy_(0, group.members, _decode_group(
            query.index_select(0, group.members), k_cache, v_cache, group, scale, cap))
    return out


@dataclass(frozen=True)
class _DecodeGroup:
    """Sequences of similar context length, padded to the longest; computed once per forward
    (per_forward) for every layer."""

    # [S_g] int64: the group's rows of the batch; None when the group is the whole batch.
    members: torch.Tensor | None
    # Their contexts (the last `window` positions only).
    index: ContextIndex
    # [S_g, 1, 1, L] fp32: 0 on the columns each query counts, -inf elsewhere (attend's mask,
    # ready for SDPA in every layer).
    counted: torch.Tensor


def _decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, geometry: CacheGeometry,
                 window: int) -> list[_DecodeGroup]:
    """The batch in groups of similar length (length_groups), each with its gather index."""
    groups = length_groups(_gathered_blocks(seq_lens, geometry.block_size, window),
                           geometry.block_size * geometry.num_kv_heads * geometry.head_dim,
                           GROUP_MIN_SAVED)
    plan = []
    for group in groups:
        members = None
        tables, lens = block_tables, seq_lens
        if len(groups) > 1:
            members = torch.tensor(group, device=seq_lens.device)
            tables, lens = block_tables.index_select(0, members), seq_lens.index_select(0, members)
        # -- the query sees its whole context (the last `window` positions): gather just those
        first = (lens.long() - window).clamp_min(0) if window else None
        index = context_index(tables, lens, geometry, first)
        counted = torch.where(index.valid[:, None, None], 0.0, float("-inf"))
        plan.append(_DecodeGroup(members, index, counted))
    return plan


def _decode_group(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  group: _DecodeGroup, scale: float, cap: float) -> torch.Tensor:
    """The torch decode of a group's queries (query: [S_g, H_q, D])."""
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = gather_context(k_cache, v_cache, group.index)
    # -- q [S, H_kv, G, D]: a KV head's G query heads are G rows with the same mask --
    q = query.float().view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = attend(q, keys.transpose(1, 2), values.transpose(1, 2), group.counted, scale, cap)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(query.dtype)


def _gathered_blocks(seq_lens: torch.Tensor, block_size: int, window: int) -> list[int]:
    """Blocks context_index covers for each sequence's decode query (a host copy of seq_lens)."""
    lens = seq_lens.tolist()
    firsts = [max(n - window, 0) // block_size * block_size if window else 0 for n in lens]
    return [blocks_for(n - first, block_size) for n, first in zip(lens, firsts, strict=True)]


def length_groups(lengths: list[int], unit_cost: int, min_saved: int) -> list[list[int]]:
    """Indices of `lengths` in groups of similar length (longest first), so that padding every
    member of a group to the group's longest wastes little.

    Starting from one group, a group is split in two where that removes the most padding, as
    long as the padding removed (in lengths x `unit_cost`) is at least `min_saved`.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    pending = [order]
    while pending:
        group = pending.pop()
        longest = lengths[group[0]]
        # splitting before member k pads group[k:] to lengths[group[k]] instead of `longest`
        saved, k = max([((len(group) - k) * (longest - lengths[group[k]]), k)
                        for k in range(1, len(group))], default=(0, 0))
        if saved * unit_cost >= min_saved:
            pending += [group[:k], group[k:]]
        else:
            groups.append(group)
    return groups
