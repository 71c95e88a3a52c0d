"""What the GPU benchmarks share: paged batches of random K/V, the bytes an attention call must
move, the two bandwidth baselines (the copy measured here, the datasheet) every figure is reported
against, and the Triton-vs-torch correctness check that runs before any timing.

    base = baselines(device)                     # prints copy_bw, datasheet_bw (or says unknown)
    report_bandwidth("decode", "b64_c4096", moved, ms, base)   # us, GB/s, of copy, of datasheet
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from device_bandwidth import copy_bandwidth, datasheet_bandwidth

from pagedkv.model_runner.kernels.attention_backend import TORCH_BACKEND, TRITON_BACKEND
from pagedkv.model_runner.kernels.triton_env import triton

BLOCK_SIZE = 16
# Triton vs torch tolerance per dtype, on |a - e| / (1 + |e|): both compute in fp32 and round
# the output to the dtype, so they may differ by an ulp (bf16: 2**-7 relative).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class Geometry:
    """The attention shape a check or a timing runs in."""

    num_q_heads: int  # H_q
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    block_size: int  # tokens per cache block


# Llama-3.1-8B's attention (D=128) and Gemma2-9B's (D=256).
GEOMETRIES = {128: Geometry(32, 8, 128, BLOCK_SIZE), 256: Geometry(16, 8, 256, BLOCK_SIZE)}
LLAMA = GEOMETRIES[128]


@dataclass(frozen=True)
class Baselines:
    """What achieved bandwidth is compared against, in bytes/s."""

    copy: float  # the device-to-device copy measured in this run
    datasheet: float | None  # the device's datasheet figure; None for an unknown device


@dataclass
class PagedBatch:
    """A paged K/V pool holding a batch of sequences, and the tables that address it."""

    pool: torch.Tensor  # [num_blocks, 2, block_size, H_kv, D]: a one-layer block-major pool
    block_tables: torch.Tensor  # [S, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor  # [S] int32


def paged_batch(seq_lens: list[int], geo: Geometry, dtype: torch.dtype, device: torch.device,
                poison: bool) -> PagedBatch:
    """Random K/V for `seq_lens` tokens in permuted blocks; every other slot NaN if `poison`.
    An fp8 `dtype` gets bf16 random values cast to it."""
    blocks = [triton.cdiv(n, geo.block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1  # one block nobody owns
    shape = (num_blocks, 2, geo.block_size, geo.num_kv_heads, geo.head_dim)
    random_dtype = torch.bfloat16 if dtype.itemsize == 1 else dtype
    pool = torch.randn(shape, dtype=random_dtype, device=device).to(dtype)
    tables = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.int32, device=device)
    owned = torch.split(torch.randperm(num_blocks, device=device)[: sum(blocks)].int(), blocks)
    for row, ids in enumerate(owned):
        tables[row, : len(ids)] = ids
    if poison:  # NaN in every slot past a sequence's length, and in the unowned block
        lens = torch.tensor(seq_lens, device=device)
        positions = torch.arange(max(blocks) * geo.block_size, device=device)
        stale = (positions[None, :] >= lens[:, None]).view(len(seq_lens), max(blocks), -1)
        owned_stale = stale & (tables >= 0)[:, :, None]
        mask = torch.ones(num_blocks, geo.block_size, dtype=torch.bool, device=device)
        mask[tables[tables >= 0].long()] = owned_stale[tables >= 0]
        pool.transpose(0, 1)[:, mask] = float("nan")
    return PagedBatch(pool, tables, torch.tensor(seq_lens, dtype=torch.int32, device=device))


def max_error(name: str, actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Print and return max |actual - expected| / (1 + |expected|) (inf if NaN leaked)."""
    expected = expected.float()
    error = ((actual.float() - expected).abs() / (1 + expected.abs())).max().item()
    error = float("inf") if actual.isnan().any() else error
    print(f"check_{name}_max_err: {error:.3g} rel")
    return error


def check_attention(batch: PagedBatch, geo: Geometry, tag: str) -> float:
    """Largest Triton-vs-torch error of decode (1 and 4 splits) and chunked prefill."""
    args = (batch.pool[:, 0], batch.pool[:, 1], batch.block_tables, batch.seq_lens)
    scale, dtype, device = geo.head_dim**-0.5, batch.pool.dtype, batch.pool.device
    query = torch.randn(len(batch.seq_lens), geo.num_q_heads, geo.head_dim, dtype=dtype,
                        device=device)
    expected = TORCH_BACKEND.paged_decode_attention(query, *args, scale)
    errors = [max_error(f"decode_{tag}_splits{n}",
                        TRITON_BACKEND.paged_decode_attention(query, *args, scale, n), expected)
              for n in (1, 4)]
    q_lens = [max(1, int(n) // 3) for n in batch.seq_lens]  # chunks after a cached prefix
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=device)
    chunk = torch.randn(sum(q_lens), geo.num_q_heads, geo.head_dim, dtype=dtype, device=device)
    errors.append(max_error(f"prefill_{tag}",
                            TRITON_BACKEND.paged_prefill_attention(chunk, *args, qsl, scale),
                            TORCH_BACKEND.paged_prefill_attention(chunk, *args, qsl, scale)))
    return max(errors)


def check_store(batch: PagedBatch, geo: Geometry, tag: str) -> bool:
    """Whether Triton's and torch's store_kv leave identical pools (a padding slot included)."""
    pool = batch.pool
    new_kv = torch.randn(3, geo.num_kv_heads, geo.head_dim, dtype=pool.dtype, device=pool.device)
    slots = torch.tensor([0, -1, pool.shape[0] * geo.block_size - 1], device=pool.device)
    pools = [pool.clone(), pool.clone()]
    for backend, copy in zip((TRITON_BACKEND, TORCH_BACKEND), pools, strict=True):
        backend.store_kv(new_kv, new_kv, copy[:, 0], copy[:, 1], slots)
    same = torch.equal(pools[0].nan_to_num(), pools[1].nan_to_num())
    print(f"check_store_kv_{tag}_identical: {int(same)} bool")
    return same


def check(geo: Geometry, seq_lens: list[int], device: torch.device) -> bool:
    """Triton vs torch on a NaN-poisoned ragged batch per dtype; True when all agree."""
    passed = True
    for dtype, tolerance in TOLERANCE.items():
        tag = str(dtype).removeprefix("torch.")
        batch = paged_batch(seq_lens, geo, dtype, device, poison=True)
        error = check_attention(batch, geo, tag)
        passed = check_store(batch, geo, tag) and error <= tolerance and passed
    print(f"check_passed: {int(passed)} bool")
    return passed


def bench_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call (L2 flushed between calls)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def report_bandwidth(prefix: str, name: str, moved: int, ms: float, base: Baselines) -> float:
    """Print the time and the achieved bandwidth of moving `moved` bytes in `ms` against both
    baselines; return the bandwidth in GB/s."""
    per_s = moved / (ms * 1e-3)
    print(f"{prefix}_us_{name}: {ms * 1e3:.1f} us")
    print(f"{prefix}_gbps_{name}: {per_s / 1e9:.1f} GB/s")
    print(f"{prefix}_bw_frac_{name}: {per_s / base.copy:.2f} fraction")
    if base.datasheet is not None:
        print(f"{prefix}_bw_of_datasheet_{name}: {per_s / base.datasheet:.2f} fraction")
    return per_s / 1e9


def moved_bytes(batch: int, context: int, query_rows: int, geo: Geometry, dtype: torch.dtype,
                kv_dtype: torch.dtype, table_ints: int) -> int:
    """Bytes an attention call must move: each context token's K and V once, the query in and
    the output out, `table_ints` int32 of tables and lengths."""
    kv = 2 * batch * context * geo.num_kv_heads * geo.head_dim * kv_dtype.itemsize
    io = 2 * query_rows * geo.num_q_heads * geo.head_dim * dtype.itemsize
    return kv + io + 4 * table_ints


def baselines(device: torch.device) -> Baselines:
    """Measure the copy bandwidth, look the datasheet up, print both."""
    name = torch.cuda.get_device_name(device)
    base = Baselines(copy_bandwidth(device), datasheet_bandwidth(name))
    print(f"copy_bw: {base.copy / 1e9:.1f} GB/s")
    print(f"datasheet_known: {int(base.datasheet is not None)} bool")
    if base.datasheet is None:
        print(f"# no datasheet bandwidth for {name!r}: figures against the copy only")
    else:
        print(f"datasheet_bw: {base.datasheet / 1e9:.0f} GB/s")
        print(f"copy_of_datasheet: {base.copy / base.datasheet:.2f} fraction")
    return base


