"""store_kv: new K/V rows land in their slots, padding slots and every other slot stay untouched.

Triton runs under the interpreter on CPU (kernels/triton_env.py turns it on when there
is no CUDA) and compiled on a GPU (the `gpu`-marked twins).
"""

import re

import pytest
import torch

from pagedkv.model_runner.kernels.store_kv import store_kv_torch, store_kv_triton

from kernel_utils import device_matrix, skip_unless_triton_runs_on

IMPLS = [pytest.param(store_kv_torch, id="torch"), pytest.param(store_kv_triton, id="triton")]


def _pool(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype,
          device: str) -> torch.Tensor:
    """[num_blocks, 2 layers, 2, block_size, H_kv, D], every slot NaN."""
    shape = (num_blocks, 2, 2, block_size, heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _new_tokens(num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value [T, H_kv, D] as strided slices of one fused [T, 3 * H_kv, D] projection."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, 3 * heads, head_dim, generator=gen).to(device, dtype)
    return qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]


# Every shape on both devices: store_kv is one small program per token, cheap under the
# interpreter, and each shape is a feature (fp32, fp16, bf16, heads and head_dim padded).
@pytest.mark.parametrize(("store", "device"), device_matrix(IMPLS))
@pytest.mark.parametrize(
    ("block_size", "heads", "head_dim", "dtype"),
    [
        (8, 1, 64, torch.float32),
        (16, 2, 128, torch.float16),
        (32, 8, 64, torch.bfloat16),
        (16, 3, 80, torch.float32),  # heads and head_dim that are not powers of two
    ],
)
def test_rows_land_in_their_slots(store, device, block_size, heads, head_dim, dtype):
    if store is store_kv_triton:
        skip_unless_triton_runs_on(device)
    pool = _pool(6, block_size, heads, head_dim, dtype, device)
    key, value = _new_tokens(9, heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(6 * block_size, generator=gen)[:9]
    slots[[2, 5]] = -1  # padding tokens
    expected = pool.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 1, 0, slot % block_size] = key[token]
            expected[slot // block_size, 1, 1, slot % block_size] = value[token]

    store(key, value, pool[:, 1, 0], pool[:, 1, 1], slots.to(device))

    torch.testing.assert_close(pool, expected, atol=0, rtol=0, equal_nan=True)
    assert pool.isnan().sum() == expected.isnan().sum() > 0  # untouched slots are still NaN


@pytest.mark.parametrize("store", IMPLS)
def test_all_padding_and_empty_batches_write_nothing(store):
    if store is store_kv_triton:
        skip_unless_triton_runs_on("cpu")
    pool = _pool(2, 8, 1, 16, torch.float32, "cpu")
    key, value = _new_tokens(3, 1, 16, torch.float32, "cpu")
    store(key, value, pool[:, 0, 0], pool[:, 0, 1], torch.full((3,), -1, dtype=torch.int64))
    store(key[:0], value[:0], pool[:, 0, 0], pool[:, 0, 1], torch.empty(0, dtype=torch.int64))
    assert pool.isnan().all()


BadCall = tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]


def _bad_calls(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> list[BadCall]:
    """(key, value, slot_mapping, error fragment) for calls that must be refused."""
    return [
        (key, value, torch.tensor([0, 1, 16]), "slot_mapping values"),  # 16 slots in the pool
        (key, value, torch.tensor([0, -2, 1]), "slot_mapping values"),
        (key, value, slots.int(), "slot_mapping must be torch.int64"),
        (key, value, slots[:2], "slot_mapping must be"),
        (key.half(), value.half(), slots, "key is torch.float16"),
        (key[:, :, :8], value[:, :, :8], slots, "key must be [T, H, 16]"),
        (key.repeat(1, 2, 1), value.repeat(1, 2, 1), slots, "key has 2 heads"),
        (key, value[:2], slots, "value shape"),
    ]


@pytest.mark.parametrize("store", IMPLS)
def test_bad_input_is_refused_and_changes_nothing(store):
    pool = _pool(2, 8, 1, 16, torch.float32, "cpu")
    key, value = _new_tokens(3, 1, 16, torch.float32, "cpu")
    for bad_key, bad_value, bad_slots, message in _bad_calls(key, value, torch.tensor([0, 1, 2])):
        with pytest.raises(ValueError, match=re.escape(message)):
            store(bad_key, bad_value, pool[:, 0, 0], pool[:, 0, 1], bad_slots)
    with pytest.raises(ValueError, match="share one dtype"):
        store(key, value, pool[:, 0, 0], pool[:, 0, 1].double(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="share strides"):  # one row index must serve both
        store(key, value, pool[:, 0, 0], pool[:, 0, 1].contiguous(), torch.tensor([0, 1, 2]))
    assert pool.isnan().all()
