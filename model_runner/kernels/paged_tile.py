"""One tile step of paged attention, shared by the decode and prefill kernels.

A tile is TILE_N consecutive context positions of one sequence. Each position finds its own
physical block through the sequence's block-table row (so tiles need not align with cache blocks,
and any block size works), its K row is scored against every query row, and the running softmax
state (row max m_i, row sum l_i, unnormalized output acc) absorbs the tile -- FlashAttention's
online softmax, kept in fp32 and in log2 units (scores are scaled by scale * log2(e) after the
dot, so queries and keys enter tl.dot unrounded).

Both dots take their operands in the query's dtype and accumulate in fp32. For fp16/bf16 models
that is the cache's own dtype (native tensor-core MMAs, half the operand registers of fp32): the
probabilities P are rounded to V's dtype before P @ V, and the row sum l_i adds up those same
rounded values, so the normalization divides by exactly what the dot multiplied. fp32 caches,
and bf16 under the interpreter (whose numpy tl.dot multiplies bf16's raw bits as integers),
run with fp32 operands and exact (IEEE) dots: `dot_dtype` picks.

Two variants some models need, both with transformers' semantics (masking_utils and Gemma2's
eager attention): a sliding window, where a query at position p sees only keys at positions in
(p - window, p], and logit soft-capping, scores = softcap * tanh(scale * q.k / softcap), applied
after scaling and before the mask.

NaN safety: slots past a sequence's length may hold stale or NaN data. Their K and V loads are
masked with `other=0`, and their scores are replaced by -inf, so neither the scores nor
P @ V (where 0 * NaN would otherwise be NaN) can see them.
"""

import math

import torch

from pagedkv.model_runner.kernels.triton_env import is_interpreted, tl, triton

# Multiply the softmax scale by this so exp2 replaces exp (one instruction cheaper on GPUs).
LOG2_E = 1.0 / math.log(2.0)


def head_dim_pad(head_dim: int) -> int:
    """The power-of-two tile width that holds `head_dim` (>= 16, tl.dot's minimum on GPUs)."""
    return max(16, int(triton.next_power_of_2(head_dim)))


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """attend_tile's (qk_scale, cap_log2) for a softmax scale and a softcap (0 = none).

    Scores in log2 units are q.k * qk_scale without a softcap, tanh(q.k * qk_scale) * cap_log2
    with one; folding the constants here leaves one multiply per score on each side of the tanh.
    """
    if softcap:
        return scale / softcap, softcap * LOG2_E
    return scale * LOG2_E, 0.0


# The Triton dtype of each cache dtype whose values can enter tl.dot natively.
_NATIVE_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype, kernel: object) -> tl.dtype:
    """The dtype tl.dot's operands take in `kernel` for a cache of `dtype` (the DOT_DTYPE
    constexpr): the cache's own fp16/bf16, or fp32 for fp32 caches and for bf16 under the
    interpreter, where a bf16 tl.dot is wrong (fp16's is right: numpy upcasts it exactly)."""
    native = _NATIVE_DOT_DTYPES.get(dtype)
    if native is None or (native == tl.bfloat16 and is_interpreted(kernel)):
        return tl.float32
    return native


@triton.jit
def tanh(x):  # type: ignore[no-untyped-def]
    """tanh of an fp32 tensor from exp2: tl.math has no tanh, and the interpreter runs no
    libdevice call. e = exp2(-2|x| log2(e)) lies in (0, 1], so a large |x| gives +-1, never
    inf / inf; the absolute error stays under 1e-7 (1 - e rounds like fp32 numbers near 1)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit  # type: ignore[untyped-decorator]
def attend_tile(  # type: ignore[no-untyped-def]
    q, m_i, l_i, acc, qk_scale, cap_log2, window,
    K_cache, V_cache, Block_row,
    pos, q_pos, seq_len, kv_head,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Absorb context positions `pos` [TILE_N] into the state of query rows at `q_pos` [M].

    q: [M, HEAD_DIM_PAD] in the dots' operand dtype (dot_dtype); m_i, l_i: [M] fp32;
    acc: [M, HEAD_DIM_PAD] fp32.
    Row r counts position p iff p <= q_pos[r] (causal; decode passes q_pos = seq_len - 1) and,
    when WINDOWED, p > q_pos[r] - window. Rows with q_pos >= seq_len (padding) see zeros past the
    sequence and must not be stored. A row may count nothing in a tile (a window that starts in
    a later tile): its state stays (m_i = -inf, l_i = 0, acc = 0), never NaN.
    qk_scale, cap_log2: from score_scales; SOFTCAP: whether a softcap applies.
    """
    # -- gather: the physical slot of every position (int64: pools exceed 2**31 elements) --
    in_seq = pos < seq_len  # [TILE_N]
    block = tl.load(Block_row + (pos // BLOCK_SIZE) * stride_btb, mask=in_seq, other=0)
    block = block.to(tl.int64)
    offset = pos % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    kv_mask = in_seq[:, None] & (offs_d[None, :] < HEAD_DIM)  # [TILE_N, HEAD_DIM_PAD]
    k = tl.load(K_cache + block[:, None] * stride_kb + offset[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    # -- scores [M, TILE_N]: operands in q's dtype, fp32 accumulator, then log2 units --
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
    s = tanh(s * qk_scale) * cap_log2 if SOFTCAP else s * qk_scale
    # A stored row has q_pos < seq_len, so the causal test also drops positions past the sequence.
    counted = pos[None, :] <= q_pos[:, None]
    if WINDOWED:
        counted = counted & (pos[None, :] > q_pos[:, None] - window)
    s = tl.where(counted, s, float("-inf"))
    # -- online softmax: rescale the old state to the new row max; a row that has counted
    #    nothing yet subtracts 0 instead of -inf, so exp2 gives 0 rather than NaN --
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # [M]
    alpha = tl.exp2(m_i - m_ref)  # [M]
    # [M, TILE_N], 0 where not counted; rounded to the operand dtype once, and l_i sums the
    # rounded values, so that the output is normalized by what P @ V multiplied
    p = tl.exp2(s - m_ref[:, None]).to(q.dtype)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    # -- accumulate P @ V into acc (fp32); masked V rows load as 0, never as stale NaN --
    v = tl.load(V_cache + block[:, None] * stride_vb + offset[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    acc = tl.dot(p, v.to(q.dtype), acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc
