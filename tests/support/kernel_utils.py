"""Shared helpers for the paged-attention kernel tests: devices, paged batches, a float64 oracle.

A paged batch is built the way the block pool hands it out: each sequence owns a random
(permuted) set of physical blocks, its block-table row is padded with -1 past the blocks it uses,
and every slot that holds no token of any sequence is NaN, so a kernel that reads one leaks NaN
into its result.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch
from _pytest.mark import ParameterSet

from pagedkv.model_runner.kernels.triton_env import interpreter_enabled

# "cpu" runs Triton under the interpreter (skip_unless_triton_runs_on: only where it is on);
# "cuda" runs the compiled kernels on a GPU.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

TRITON_CPU_SKIP = ("Triton runs on CPU tensors only under its interpreter, which triton_env "
                   "switches on only without CUDA: here the compiled kernels are tested on "
                   "CUDA tensors instead (the gpu-marked cases, make gpu-check)")


def skip_unless_triton_runs_on(device: str | torch.device) -> None:
    """Skip the calling test where Triton kernels cannot run on tensors on `device`: CPU tensors
    need the interpreter, which is on where there is no CUDA (or with TRITON_INTERPRET=1). Call
    it first in every test that runs a Triton kernel on CPU tensors."""
    if torch.device(device).type == "cpu" and not interpreter_enabled():
        pytest.skip(TRITON_CPU_SKIP)


def device_matrix(cases: Iterable[object],
                  cpu: Iterable[object] | None = None) -> list[ParameterSet]:
    """A test's matrix on DEVICES: every case on "cuda", on "cpu" only the cases in `cpu`.

    Under the interpreter Triton runs a grid's programs one after another, each tl op a numpy
    call, so a Triton case on CPU tensors costs tenths of a second to seconds, and a shape or
    dtype that takes the kernel down a path another case already took adds that time and no
    coverage; what differs from shape to shape in the compiled kernel (tile layouts, tl.dot
    shapes, precision) shows only on a GPU. So a test that runs a Triton kernel passes, as `cpu`,
    one case per feature of the kernel its matrix reaches (MHA and GQA, each dtype the
    interpreter computes, a block size and a head_dim that are not powers of two, a window, a
    softcap, one split and several...; a feature with distinct paths, a few), and the gpu tier
    (the "cuda" params, marked gpu: `pytest -m gpu`, make gpu-check) keeps the full matrix.
    Torch twins, cheap on CPU, leave `cpu` at None: every case on both devices.

    `cases`: values of the test's other parameters, a tuple per case (a bare value for one
    parameter) or a pytest.param; `cpu`: some of them, as values. Returns pytest.params of the
    case's values then the device (so "device" comes last in the argnames), whose ids are those
    of `@pytest.mark.parametrize("device", DEVICES)` stacked over the cases' own parametrize:
    `<case id>-cpu` and `<case id>-cuda`, the case id being its values' param_id joined by "-",
    or its pytest.param id.
    """
    matrix = []
    for case in cases:
        if isinstance(case, ParameterSet):
            values, case_id, marks = case.values, case.id, list(case.marks)
        else:
            values = case if isinstance(case, tuple) else (case,)
            case_id, marks = "-".join(param_id(value) for value in values), []
        matrix.append((values, case_id, marks))
    kept = None if cpu is None else [c if isinstance(c, tuple) else (c,) for c in cpu]
    unknown = [c for c in kept or [] if c not in [values for values, _, _ in matrix]]
    assert not unknown, f"cpu names cases the matrix lacks: {unknown}"
    return [
        pytest.param(*values, device.values[0], id=f"{case_id}-{device.id}",
                     marks=[*marks, *device.marks])
        for values, case_id, marks in matrix
        for device in DEVICES
        if device.values[0] != "cpu" or kept is None or values in kept
    ]


# Tolerance of an output computed in fp32 and rounded to the dtype, per dtype: (atol, rtol).
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class PagedBatch:
    """One layer's paged cache filled for a batch of sequences, and the tables that address it."""

    pool: torch.Tensor  # [num_blocks, 2 layers, 2, block_size, H_kv, D]; the kernels use layer 1
    block_tables: torch.Tensor  # [S, max_blocks] int32, -1 past each sequence's used blocks
    seq_lens: torch.Tensor  # [S] int32, context length per sequence

    @property
    def k_cache(self) -> torch.Tensor:
        return self.pool[:, 1, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool[:, 1, 1]


def make_paged_batch(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> PagedBatch:
    """A NaN-poisoned pool whose slots for `seq_lens` tokens hold random K/V."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(used) + 3  # a few blocks nobody owns, still NaN
    pool = torch.full((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), float("nan"))
    tables = torch.full((len(seq_lens), max(used) + 1), -1, dtype=torch.int32)
    owned = torch.randperm(num_blocks, generator=gen).split([*used, num_blocks - sum(used)])
    for row, (blocks, length) in enumerate(zip(owned, seq_lens, strict=False)):
        tables[row, : len(blocks)] = blocks.to(torch.int32)
        positions = torch.arange(length)
        rows = blocks[positions // block_size]
        for kv in range(2):
            pool[:, 1, kv][rows, positions % block_size] = torch.randn(
                length, num_kv_heads, head_dim, generator=gen
            )
    return PagedBatch(
        pool.to(device=device, dtype=dtype),
        tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def random_tokens(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                  device: str, seed: int = 1) -> torch.Tensor:
    """[T, H, D] random rows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device=device,
                                                                          dtype=dtype)


def contiguous_kv(batch: PagedBatch, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `seq`'s keys and values [L, H_kv, D] in float64, gathered one block at a time."""
    length = int(batch.seq_lens[seq])
    keys, values = [], []
    for logical in range(-(-length // batch.k_cache.shape[1])):
        block = int(batch.block_tables[seq, logical])
        keys.append(batch.k_cache[block].double().cpu())
        values.append(batch.v_cache[block].double().cpu())
    return torch.cat(keys)[:length], torch.cat(values)[:length]


def oracle_attention(query: torch.Tensor, batch: PagedBatch, q_lens: list[int], scale: float,
                     sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The obviously right answer in float64: query [T, H_q, D] -> [T, H_q, D] on the CPU.

    Sequence s's queries are its last q_lens[s] positions; each attends to every position up to
    its own, or with a `sliding_window` W > 0 to the last W of them (transformers'
    sliding_window_overlay: key > query - W). A `softcap` c > 0 maps the scaled scores through
    c * tanh(score / c) before the mask (transformers' Gemma2 eager attention).
    """
    out = []
    start = 0
    for seq, q_len in enumerate(q_lens):
        keys, values = contiguous_kv(batch, seq)  # [L, H_kv, D]
        group = query.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [L, H_q, D]
        values = values.repeat_interleave(group, dim=1)
        q = query[start : start + q_len].double().cpu()  # [q_len, H_q, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale  # [H_q, q_len, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        positions = torch.arange(keys.shape[0])[None, None, :]
        own = (keys.shape[0] - q_len + torch.arange(q_len))[None, :, None]
        hidden = positions > own
        if sliding_window:
            hidden |= positions <= own - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += q_len
    return torch.cat(out)


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """`actual` matches `expected` within `dtype`'s precision and has no NaN."""
    assert not actual.isnan().any(), "NaN leaked into the result"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol,
                               rtol=rtol)


def query_start_loc(q_lens: list[int], device: str) -> torch.Tensor:
    """[S + 1] int32 cumulative query lengths."""
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def ragged_lengths(block_size: int) -> list[int]:
    """Context lengths around block boundaries: 1, B-1, B, B+1 and a few blocks plus change."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


def param_id(value: object) -> str:
    """Readable test ids: `bfloat16` rather than `dtype2`."""
    return str(value).removeprefix("torch.")
