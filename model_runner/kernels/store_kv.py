"""Write new tokens' keys and values into their paged cache slots.

    key, value:    [T, H_kv, D]   one row per new token, after rotary embedding
    k/v_cache:     [num_blocks, block_size, H_kv, D]   one layer's view of the pool
    slot_mapping:  [T] int64      slot = block * block_size + offset; -1 = padding, skipped

Two implementations with one interface here: a Triton kernel (one program per token, all heads in
one tile) and a vectorized torch version that is the "torch" backend and the tests' reference (the
CPU's default backend writes in C: cpu_paged). Slots must be distinct; a slot written twice in one
call holds one of the two rows, unspecified which.

An fp8 cache (paged_checks.FP8_CACHE_DTYPE) quantizes: each element is clamped to +-FP8_MAX
(e4m3 has no inf: a larger value saturates, as vLLM's scaled_fp8_quant does) and rounded to
e4m3, with the per-tensor scale 1.0 (no scale is stored).
"""

import torch

from pagedkv.model_runner.kernels.paged_checks import (
    FP8_CACHE_DTYPE,
    FP8_MAX,
    CacheGeometry,
    check_cache,
    check_index,
    check_slot_values,
    check_tokens,
    slot_row,
    slot_rows,
)
from pagedkv.model_runner.kernels.per_forward import PerForward, shared
from pagedkv.model_runner.kernels.triton_env import (
    is_interpreted,
    launch,
    require_triton_device,
    tl,
    triton,
)


@triton.jit  # type: ignore[untyped-decorator]
def saturated(x, LIMIT: tl.constexpr, ON_GRID: tl.constexpr):  # type: ignore[no-untyped-def]
    """x in fp32 clamped to +-LIMIT, the cache's cast then rounds it to e4m3 (GPUs: round to
    nearest even, saturating). ON_GRID (the interpreter) rounds it to e4m3's grid here instead
    (3 mantissa bits, subnormals below 2**-6, ties away from zero), since the interpreter's own
    cast drops the carry of a mantissa that rounds up (1.9999 -> 1.0)."""
    x = tl.minimum(tl.maximum(x.to(tl.float32), -LIMIT), LIMIT)
    if ON_GRID:
        step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.abs(x))), -6.0) - 3.0)  # an ulp of x
        x = tl.floor(x / step + 0.5) * step
    return x


@triton.jit(do_not_specialize=[  # type: ignore[untyped-decorator]
    "stride_kt", "stride_kh", "stride_vt", "stride_vh"])
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    Key, Value, K_cache, V_cache, Slot_mapping,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ckb, stride_cks, stride_ckh, stride_ckd,
    stride_cvb, stride_cvs, stride_cvh, stride_cvd,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SATURATE: tl.constexpr, ON_GRID: tl.constexpr,
):
    tl.static_assert(HEADS_PAD >= NUM_KV_HEADS)
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    token = tl.program_id(0).to(tl.int64)
    # -- padding tokens leave the cache untouched --
    slot = tl.load(Slot_mapping + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # -- one [HEADS_PAD, HEAD_DIM_PAD] tile holds every head of the token --
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(Key + token * stride_kt + offs_h[:, None] * stride_kh
                + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(Value + token * stride_vt + offs_h[:, None] * stride_vh
                + offs_d[None, :] * stride_vd, mask=mask)
    # -- quantize for an fp8 cache: saturate to its finite range, round in the store's cast --
    if SATURATE > 0:
        k = saturated(k, SATURATE, ON_GRID)
        v = saturated(v, SATURATE, ON_GRID)
    # -- scatter into the slot's block row (int64 offsets: pools exceed 2**31 elements) --
    k_dst = (K_cache + block * stride_ckb + offset * stride_cks
             + offs_h[:, None] * stride_ckh + offs_d[None, :] * stride_ckd)
    v_dst = (V_cache + block * stride_cvb + offset * stride_cvs
             + offs_h[:, None] * stride_cvh + offs_d[None, :] * stride_cvd)
    tl.store(k_dst, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_cache.dtype.element_ty), mask=mask)


def check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_values: bool,
) -> CacheGeometry:
    """Validate store_kv's arguments (the slots' values only when `check_values`, a read-back);
    return the cache geometry."""
    geometry = check_cache(k_cache, v_cache)
    check_tokens("key", key, geometry.num_kv_heads, k_cache)
    check_tokens("value", value, geometry.num_kv_heads, k_cache)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check_index("slot_mapping", slot_mapping, torch.int64, (key.shape[0],), k_cache.device)
    if check_values:
        check_slot_values(slot_mapping, geometry)
    return geometry


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    per_forward: PerForward | None = None,
) -> None:
    """Triton: copy key/value rows into the cache at `slot_mapping` (in place); the kernel
    reads the slots itself, so it shares nothing through `per_forward`."""
    geometry = check_store_args(key, value, k_cache, v_cache, slot_mapping, check_values)
    require_triton_device(k_cache.device, _store_kv_kernel)
    if key.shape[0] == 0:
        return
    launch(
        _store_kv_kernel, (key.shape[0],), key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=geometry.num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(geometry.num_kv_heads),
        HEAD_DIM=geometry.head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(geometry.head_dim),
        BLOCK_SIZE=geometry.block_size,
        SATURATE=FP8_MAX if k_cache.dtype == FP8_CACHE_DTYPE else 0.0,
        ON_GRID=is_interpreted(_store_kv_kernel),
    )


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    per_forward: PerForward | None = None,
) -> None:
    """Torch: copy key/value rows into the cache at `slot_mapping` (in place). The rows the
    slots are, and which tokens write at all, are computed once per forward (`per_forward`)."""
    geometry = check_store_args(key, value, k_cache, v_cache, slot_mapping, check_values)
    index, keep = shared(per_forward, ("store_kv", geometry.block_size, geometry.rows_per_block),
                         lambda: _store_rows(slot_mapping, geometry))
    if keep is not None:  # padding tokens write nothing
        key, value = key[keep], value[keep]
    for cache, rows in ((k_cache, key), (v_cache, value)):
        target = slot_rows(cache, geometry.rows_per_block)
        if cache.dtype == FP8_CACHE_DTYPE:  # quantize; torch's CPU index_copy_ has no fp8
            rows = rows.clamp(-FP8_MAX, FP8_MAX).to(FP8_CACHE_DTYPE).view(torch.uint8)
            target = target.view(torch.uint8)
        target.index_copy_(0, index, rows)


def _store_rows(slot_mapping: torch.Tensor,
                geometry: CacheGeometry) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the slot_rows row of each token that writes, [T] bool of the tokens that write or None
    when all do): one read-back per forward, not per layer."""
    keep = slot_mapping >= 0  # [T]
    if bool(keep.all()):
        return slot_row(slot_mapping, geometry), None
    return slot_row(slot_mapping[keep], geometry), keep
