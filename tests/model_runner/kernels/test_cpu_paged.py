"""The CPU backend's C kernels (cpu_paged) against the torch twins, and their trust boundary.

Pools come from kernel_utils: scattered blocks, NaN in every slot no sequence owns and -1 past
each table row's used blocks, so a read outside a sequence's context leaks NaN. Bad values (block
ids, slots, lengths) must raise ValueError and leave the pool and the output untouched.
"""

import itertools
import os

import pytest
import torch

from pagedkv.model_runner.kernels.attention_backend import CPU_BACKEND, TORCH_BACKEND, get_backend
from pagedkv.model_runner.kernels.cpu_paged import (
    paged_decode_attention_cpu,
    store_kv_cpu,
    vectorized,
)
from pagedkv.model_runner.kernels.paged_decode import paged_decode_attention_torch
from pagedkv.model_runner.kernels.store_kv import store_kv_torch

from kernel_utils import PagedBatch, assert_close_to, make_paged_batch, random_tokens

SCALE = 0.125
FP8 = torch.float8_e4m3fn
# Contexts across block boundaries (block size 16), up to ~300 positions.
SEQ_LENS = [1, 15, 16, 17, 40, 131, 300]


def _decode_both(batch: PagedBatch, query: torch.Tensor, **kwargs: object) -> tuple[
        torch.Tensor, torch.Tensor]:
    args = (query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, SCALE)
    return paged_decode_attention_cpu(*args, **kwargs), paged_decode_attention_torch(*args,
                                                                                     **kwargs)


@pytest.mark.parametrize(("group", "head_dim", "dtype"), list(itertools.product(
    [1, 2, 4], [32, 64, 128], [torch.float32, torch.float16, torch.bfloat16])))
def test_decode_matches_the_twin(group, head_dim, dtype):
    batch = make_paged_batch(SEQ_LENS, 16, 2, head_dim, dtype, "cpu")
    query = random_tokens(len(SEQ_LENS), 2 * group, head_dim, dtype, "cpu")
    out, expected = _decode_both(batch, query)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close_to(out, expected, dtype)


@pytest.mark.parametrize(("window", "softcap"), [(20, None), (None, 1.5), (33, 2.0), (1, None),
                                                 (400, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_and_softcap_match_the_twin(window, softcap, dtype):
    batch = make_paged_batch(SEQ_LENS, 16, 2, 64, dtype, "cpu")
    query = random_tokens(len(SEQ_LENS), 4, 64, dtype, "cpu")
    out, expected = _decode_both(batch, query, sliding_window=window, softcap=softcap)
    assert_close_to(out, expected, dtype)


@pytest.mark.parametrize("head_dim", [20, 36, 48, 80])  # chains, one chain, a lane tail
def test_decode_head_dims_off_the_lanes(head_dim):
    batch = make_paged_batch([5, 37], 8, 1, head_dim, torch.float32, "cpu")
    query = random_tokens(2, 2, head_dim, torch.float32, "cpu")
    assert_close_to(*_decode_both(batch, query), torch.float32)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_over_an_fp8_cache_matches_the_twin(query_dtype):
    batch = make_paged_batch(SEQ_LENS, 16, 2, 64, torch.float32, "cpu")
    batch.pool = batch.pool.to(FP8)  # NaN stays NaN in e4m3
    query = random_tokens(len(SEQ_LENS), 4, 64, torch.float32, "cpu").to(query_dtype)
    out, expected = _decode_both(batch, query, sliding_window=50, softcap=3.0)
    assert out.dtype == query_dtype
    assert_close_to(out, expected, query_dtype)


def _pools(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two equal NaN pools [6 blocks, 2 layers, 2, 4 slots, 3 heads, 40]; layer 1 is written."""
    pool = torch.full((6, 2, 2, 4, 3, 40), float("nan")).to(dtype)
    return pool, pool.clone()


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit, NaN equal to NaN (whatever its sign)."""
    torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(("cache_dtype", "token_dtype"), [
    (torch.float32, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (FP8, torch.float32), (FP8, torch.float16),
    (FP8, torch.bfloat16)])
def test_store_kv_matches_the_twin(cache_dtype, token_dtype):
    ours, theirs = _pools(cache_dtype)
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(7, 9, 40, generator=gen) * 200).to(token_dtype)
    key, value = qkv[:, 3:6], qkv[:, 6:]  # strided views, as a fused projection's
    key[0, 0, :5] = torch.tensor([1e4, -1e4, 2**-10, 3 * 2**-10, 2**-12])  # saturate, subnormal
    slots = torch.tensor([3, -1, 17, 23, 0, -1, 9])
    store_kv_cpu(key, value, ours[:, 1, 0], ours[:, 1, 1], slots)
    store_kv_torch(key, value, theirs[:, 1, 0], theirs[:, 1, 1], slots)
    _assert_same(ours, theirs)


def test_store_kv_of_nothing_and_only_padding():
    ours, theirs = _pools(torch.float32)
    key = torch.zeros(2, 3, 40)
    store_kv_cpu(key[:0], key[:0], ours[:, 1, 0], ours[:, 1, 1], torch.zeros(0, dtype=torch.long))
    store_kv_cpu(key, key, ours[:, 1, 0], ours[:, 1, 1], torch.tensor([-1, -1]))
    _assert_same(ours, theirs)


@pytest.mark.parametrize(("slots", "message"), [
    ([0, 24], r"slot_mapping\[1\] = 24: must be -1 or in \[0, 24\)"),
    ([5, -2], r"slot_mapping\[1\] = -2"),
    ([2**40, 0], r"slot_mapping\[0\] = 1099511627776"),
])
def test_store_kv_refuses_a_slot_outside_the_pool_and_writes_nothing(slots, message):
    ours, untouched = _pools(torch.float32)
    key = torch.ones(2, 3, 40)
    with pytest.raises(ValueError, match=message):
        store_kv_cpu(key, key, ours[:, 1, 0], ours[:, 1, 1], torch.tensor(slots),
                     check_values=False)  # the C code checks whatever the caller says
    _assert_same(ours, untouched)


@pytest.mark.parametrize(("change", "message"), [
    (lambda key, slots: (key.double(), slots), "key is torch.float64"),
    (lambda key, slots: (key, slots.int()), "slot_mapping must be torch.int64"),
    (lambda key, slots: (key.transpose(1, 2).contiguous().transpose(1, 2), slots),
     "contiguous in the last"),
    (lambda key, slots: (key.to("meta"), slots.to("meta")), "on meta"),
])
def test_store_kv_refuses_bad_tensors(change, message):
    ours, untouched = _pools(torch.float32)
    key, slots = change(torch.ones(2, 3, 40), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=message):
        store_kv_cpu(key, torch.ones(2, 3, 40), ours[:, 1, 0], ours[:, 1, 1], slots)
    _assert_same(ours, untouched)


def test_the_cpu_backend_refuses_a_cache_off_the_cpu():
    cache = torch.zeros(2, 4, 1, 8, device="meta")
    with pytest.raises(ValueError, match="cpu attention backend takes CPU tensors"):
        store_kv_cpu(cache[0], cache[0], cache, cache, torch.zeros(4, dtype=torch.long,
                                                                    device="meta"))
    with pytest.raises(ValueError, match="runs on CPU tensors, not meta"):
        get_backend("cpu", "meta")


# (row, value written at column 1 of that row, error); the pool has 7 blocks.
@pytest.mark.parametrize(("row", "value", "message"), [
    (0, 7, r"block_tables\[0, 1\] = 7: a block in use must be in \[0, 7\)"),
    (1, -1, r"block_tables\[1, 1\] = -1"),
    (1, 2**31 - 1, r"block_tables\[1, 1\] = 2147483647")])
def test_decode_refuses_a_block_outside_the_pool(row, value, message):
    batch = make_paged_batch([20, 20], 16, 1, 32, torch.float32, "cpu")
    batch.block_tables[row, 1] = value
    query = random_tokens(2, 1, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        paged_decode_attention_cpu(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                   batch.seq_lens, SCALE, check_values=False)


def test_decode_reads_no_table_entry_past_a_sequence():
    # column 2 of a 2-block sequence is never used: any value there is fine
    batch = make_paged_batch([20, 20], 16, 1, 32, torch.float32, "cpu")
    batch.block_tables[:, 2] = 2**31 - 1
    query = random_tokens(2, 1, 32, torch.float32, "cpu")
    assert_close_to(*_decode_both(batch, query), torch.float32)


@pytest.mark.parametrize(("length", "message"), [
    (49, r"seq_lens\[1\] = 49: must be in \[1, 48\]"), (0, r"seq_lens\[1\] = 0"),
    (-5, r"seq_lens\[1\] = -5")])
def test_decode_refuses_a_length_the_table_cannot_hold(length, message):
    batch = make_paged_batch([20, 20], 16, 1, 32, torch.float32, "cpu")  # table: 3 blocks
    batch.seq_lens[1] = length
    query = random_tokens(2, 1, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        paged_decode_attention_cpu(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                   batch.seq_lens, SCALE, check_values=False)


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: (b.block_tables.long(), b.seq_lens), "block_tables must be torch.int32"),
    (lambda b: (b.block_tables, b.seq_lens.long()), "seq_lens must be torch.int32"),
    (lambda b: (b.block_tables[:1], b.seq_lens), "seq_lens must be torch.int32 of shape"),
])
def test_decode_refuses_bad_index_tensors(change, message):
    batch = make_paged_batch([20, 20], 16, 1, 32, torch.float32, "cpu")
    tables, lens = change(batch)
    query = random_tokens(2, 1, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        paged_decode_attention_cpu(query, batch.k_cache, batch.v_cache, tables, lens, SCALE)


def test_auto_picks_the_c_kernels_on_the_cpu():
    assert get_backend("auto", "cpu") is CPU_BACKEND
    assert get_backend("cpu", "cpu") is CPU_BACKEND
    assert get_backend("torch", "cpu") is TORCH_BACKEND
    assert get_backend("auto", "meta") is TORCH_BACKEND


def test_the_loops_are_vectorized_where_the_cpu_has_avx2():
    with open("/proc/cpuinfo") as cpuinfo:
        flags = cpuinfo.read().split()
    portable = os.environ.get("PAGEDKV_CPU_KERNELS") == "portable"  # the portable copy forced
    assert vectorized() == (not portable and all(f in flags for f in ("avx2", "fma", "f16c")))
