"""The fp8 KV cache (kv_cache_dtype fp8): e4m3 with a per-tensor scale of 1.0.

Each kernel over an fp8 cache against an fp32 reference, within a stated bound:
- store_kv quantizes: an element x lands as clamp(x, +-448) rounded to e4m3, within
  STORE_REL = 2**-4 of it (e4m3's 3 mantissa bits, half an ulp) plus STORE_ABS = 2**-6 (the
  smallest normal: the interpreter flushes e4m3 subnormals to 0; torch and GPUs round them);
  448 and -448 saturate, never inf or NaN.
- decode and prefill dequantize in registers: their output over the fp8 cache equals the
  float64 oracle over the same (dequantized) cache within fp32's tolerance, so the only error
  is the cache's; against the oracle over the unquantized fp32 K/V (unit normal) it stays under
  ATTENTION_ABS (measured: 0.09 at most on these shapes; 0.15 stated).
Both the Triton kernels (the interpreter on CPU; compiled on CUDA, the gpu tier that make
gpu-check runs) and the torch twins, the CPU path.
"""

import pytest
import torch

from pagedkv.model_runner.kernels.paged_checks import FP8_CACHE_DTYPE, FP8_MAX
from pagedkv.model_runner.kernels.paged_decode import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from pagedkv.model_runner.kernels.paged_prefill import (
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)
from pagedkv.model_runner.kernels.store_kv import store_kv_torch, store_kv_triton

from kernel_utils import (
    DEVICES,
    PagedBatch,
    assert_close_to,
    make_paged_batch,
    oracle_attention,
    random_tokens,
    skip_unless_triton_runs_on,
)

STORE_REL = 2.0**-4
STORE_ABS = 2.0**-6
ATTENTION_ABS = 0.15
SEQ_LENS = [5, 19]
BLOCK_SIZE = 8
KV_HEADS, GROUP, HEAD_DIM = 2, 2, 32
IMPLS = {"torch": (store_kv_torch, paged_decode_attention_torch, paged_prefill_attention_torch),
         "triton": (store_kv_triton, paged_decode_attention_triton,
                    paged_prefill_attention_triton)}


def _skip(impl: str, device: str) -> None:
    if impl == "triton":
        skip_unless_triton_runs_on(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("impl", IMPLS)
def test_store_quantizes_within_half_an_ulp_and_saturates(impl: str, dtype: torch.dtype,
                                                           device: str) -> None:
    _skip(impl, device)
    store = IMPLS[impl][0]
    pool = torch.zeros(4, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=FP8_CACHE_DTYPE,
                       device=device)
    k_cache, v_cache = pool[:, 1].unbind(1)
    key = random_tokens(3, KV_HEADS, HEAD_DIM, torch.float32, "cpu", seed=2) * 4
    key[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 3e-3])  # saturated, exact, subnormal
    value = random_tokens(3, KV_HEADS, HEAD_DIM, torch.float32, "cpu", seed=3)
    slots = torch.tensor([0, 13, -1])  # block 0 slot 0, block 1 slot 5, padding
    store(key.to(device, dtype), value.to(device, dtype), k_cache, v_cache, slots.to(device))
    pool = pool.cpu()
    k_cache, v_cache = pool[:, 1].unbind(1)
    for cache, rows in ((k_cache, key.to(dtype).float()), (v_cache, value.to(dtype).float())):
        stored = cache.float().flatten(0, 1)[slots[:2]]  # [2, H, D]
        expected = rows[:2].clamp(-FP8_MAX, FP8_MAX)
        assert (stored - expected).abs().le(expected.abs() * STORE_REL + STORE_ABS).all()
    assert k_cache[0, 0, 0, :3].float().tolist() == [448.0, -448.0, 448.0]
    assert pool.float().isfinite().all()
    assert k_cache.float().flatten(0, 1)[[1, 2, 3]].eq(0).all(), "padding wrote a slot"


def _batches(seed: int, device: str) -> tuple[PagedBatch, PagedBatch]:
    """The same random K/V in an fp8 pool and in an fp32 one."""
    make = [make_paged_batch(SEQ_LENS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, device, seed=seed)
            for dtype in (FP8_CACHE_DTYPE, torch.float32)]
    return make[0], make[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_dequantizes_in_registers(impl: str, device: str) -> None:
    _skip(impl, device)
    fp8, exact = _batches(4, device)
    query = random_tokens(len(SEQ_LENS), KV_HEADS * GROUP, HEAD_DIM, torch.float32, device)
    scale = HEAD_DIM**-0.5
    out = IMPLS[impl][1](query, fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.seq_lens, scale)
    q_lens = [1] * len(SEQ_LENS)
    assert_close_to(out, oracle_attention(query, fp8, q_lens, scale), torch.float32)
    error = (out.double() - oracle_attention(query, exact, q_lens, scale)).abs().max()
    assert error < ATTENTION_ABS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_dequantizes_in_registers(impl: str, device: str) -> None:
    _skip(impl, device)
    fp8, exact = _batches(5, device)
    q_lens = [3, 7]
    query = random_tokens(sum(q_lens), KV_HEADS * GROUP, HEAD_DIM, torch.float32, device)
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    out = IMPLS[impl][2](query, fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.seq_lens,
                         starts, scale)
    assert_close_to(out, oracle_attention(query, fp8, q_lens, scale), torch.float32)
    error = (out.double() - oracle_attention(query, exact, q_lens, scale)).abs().max()
    assert error < ATTENTION_ABS


def test_tokens_of_another_dtype_need_an_fp8_cache() -> None:
    pool = torch.zeros(2, 1, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    k_cache, v_cache = pool[:, 0].unbind(1)
    rows = torch.zeros(1, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"float32 on cpu, the cache is torch\.float16"):
        store_kv_torch(rows, rows, k_cache, v_cache, torch.tensor([0]))
