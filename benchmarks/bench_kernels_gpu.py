"""Paged attention kernels on a GPU: correctness first, then decode bandwidth against two baselines.

    python benchmarks/bench_kernels_gpu.py               # on CUDA: check, then time (a few minutes)
    python benchmarks/bench_kernels_gpu.py --cpu-check   # the check only, tiny shapes, interpreter

1. Check: store_kv, decode (with and without split-K) and prefill through the Triton kernels
   against the torch backend on ragged batches whose unused slots are NaN.
2. Decode timing in Llama-3.1-8B's attention geometry (32 query heads, 8 KV heads, D=128, bf16,
   16-token blocks, randomly permuted block tables) for batch x context in a grid. Achieved
   bandwidth = bytes read and written (K/V of every context token, q, out, block tables) / median
   time, reported as a fraction of the device-to-device copy bandwidth measured here, and the
   time against torch SDPA on a contiguous copy of the same K/V (query heads of one KV head
   folded into the query length, so SDPA reads each K/V row once too).
3. Chunked prefill timing in the same geometry (PREFILL_POINTS: a whole prompt, chunks after a
   cached prefix): the bytes it must move (each context token's K/V once, the chunk's q and out,
   the tables) over its median time, as a fraction of the copy bandwidth, its TFLOP/s (QK^T and
   PV of the causal chunk), and its time against SDPA on a contiguous copy with the chunk's
   causal mask aligned to the end of the context (torch's causal_lower_right).

Without CUDA it fails (exit 1, the reason on one line of stderr); `--cpu-check` runs the check
on tiny shapes there (Triton under the interpreter). Figures print one per line as
`name: value unit`, then a table (benchmarks/gpu_check.py reads them).
"""

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.memory.cuda_driver import why_no_cuda
from pagedkv.model_runner.kernels.attention_backend import TORCH_BACKEND, TRITON_BACKEND
from pagedkv.model_runner.kernels.triton_env import triton

# Llama-3.1-8B attention geometry.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 4096, 8192, 32768)
# batch x context cap: 2**21 tokens are 8 GiB of bf16 K/V, plus as much again for SDPA's copy.
MAX_TOKENS = 1 << 21
# Prefill (batch, context, chunk): a whole 2k prompt, alone and 16 at once; 512-token chunks
# after 3.5k cached tokens; a 2k chunk at the end of a 32k context.
PREFILL_POINTS = ((1, 2048, 2048), (16, 2048, 2048), (8, 4096, 512), (1, 32768, 2048))
# Targets, printed as context: fraction of copy bandwidth at batch 64 / ctx 4096, and SDPA ratio.
TARGET_BW_FRAC, TARGET_SDPA_RATIO = 0.70, 1.25
# Triton vs torch tolerance per dtype, on |a - e| / (1 + |e|): both compute in fp32 and round
# the output to the dtype, so they may differ by an ulp (bf16: 2**-7 relative).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}


@dataclass
class Geometry:
    """The attention shape a check or a timing runs in."""

    num_q_heads: int  # H_q
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    block_size: int  # tokens per cache block


@dataclass
class PagedBatch:
    """A paged K/V pool holding a batch of sequences, and the tables that address it."""

    pool: torch.Tensor  # [num_blocks, 2, block_size, H_kv, D]: a one-layer block-major pool
    block_tables: torch.Tensor  # [S, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor  # [S] int32


def paged_batch(seq_lens: list[int], geo: Geometry, dtype: torch.dtype, device: torch.device,
                poison: bool) -> PagedBatch:
    """Random K/V for `seq_lens` tokens in permuted blocks; every other slot NaN if `poison`."""
    blocks = [triton.cdiv(n, geo.block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1  # one block nobody owns
    shape = (num_blocks, 2, geo.block_size, geo.num_kv_heads, geo.head_dim)
    pool = torch.randn(shape, dtype=dtype, device=device)
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


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)


def decode_point(batch: int, context: int, geo: Geometry,
                 device: torch.device) -> tuple[float, float, int]:
    """(paged ms, SDPA ms, bytes moved by the paged kernel) for `batch` sequences of `context`."""
    cache = paged_batch([context] * batch, geo, torch.bfloat16, device, poison=False)
    k_cache, v_cache = cache.pool[:, 0], cache.pool[:, 1]
    query = torch.randn(batch, geo.num_q_heads, geo.head_dim, dtype=torch.bfloat16,
                        device=device)
    scale = geo.head_dim**-0.5

    def paged() -> torch.Tensor:
        return TRITON_BACKEND.paged_decode_attention(
            query, k_cache, v_cache, cache.block_tables, cache.seq_lens, scale,
            check_values=False)

    # SDPA baseline: contiguous [S, H_kv, L, D]; the group's query heads become query rows.
    table = cache.block_tables.long()
    k_dense = k_cache[table].flatten(1, 2).transpose(1, 2).contiguous()
    v_dense = v_cache[table].flatten(1, 2).transpose(1, 2).contiguous()
    q_dense = query.view(batch, geo.num_kv_heads, -1, geo.head_dim)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale)

    torch.testing.assert_close(paged().view_as(q_dense), sdpa(), atol=2e-2, rtol=2e-2)
    bf16_bytes, int32_bytes = 2, 4
    kv_bytes = 2 * batch * context * geo.num_kv_heads * geo.head_dim * bf16_bytes  # K and V
    io_bytes = 2 * query.numel() * bf16_bytes  # query in, output out
    table_bytes = (cache.block_tables.numel() + batch) * int32_bytes  # tables and seq_lens
    moved = kv_bytes + io_bytes + table_bytes
    return bench_ms(paged), bench_ms(sdpa), moved


def prefill_point(batch: int, context: int, chunk: int, geo: Geometry,
                  device: torch.device) -> tuple[float, float, int, int]:
    """(paged ms, SDPA ms, bytes the paged kernel must move, its flops) for `batch` sequences of
    `context` tokens whose last `chunk` are new queries (the rest a cached prefix)."""
    # Imported here: it imports triton, which must load after triton_env's TRITON_INTERPRET.
    from torch.nn.attention.bias import causal_lower_right

    dtype, scale, group = torch.bfloat16, geo.head_dim**-0.5, geo.num_q_heads // geo.num_kv_heads
    cache = paged_batch([context] * batch, geo, dtype, device, poison=False)
    k_cache, v_cache = cache.pool[:, 0], cache.pool[:, 1]
    query = torch.randn(batch * chunk, geo.num_q_heads, geo.head_dim, dtype=dtype, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * chunk

    def paged() -> torch.Tensor:
        return TRITON_BACKEND.paged_prefill_attention(
            query, k_cache, v_cache, cache.block_tables, cache.seq_lens, starts, scale,
            check_values=False)

    # SDPA baseline: contiguous [S, H_q, L, D] (each KV head repeated for its query heads), the
    # chunk's causal mask aligned to the context's end.
    table = cache.block_tables.long()
    k_dense, v_dense = (kv[table].flatten(1, 2)[:, :context].transpose(1, 2)
                        .repeat_interleave(group, dim=1).contiguous() for kv in (k_cache, v_cache))
    q_dense = query.view(batch, chunk, geo.num_q_heads, geo.head_dim).transpose(1, 2)
    mask = causal_lower_right(chunk, context)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask,
                                              scale=scale)

    expected = sdpa().transpose(1, 2).reshape_as(query)
    torch.testing.assert_close(paged(), expected, atol=2e-2, rtol=2e-2)
    bf16_bytes, int32_bytes = 2, 4
    kv_bytes = 2 * batch * context * geo.num_kv_heads * geo.head_dim * bf16_bytes
    io_bytes = 2 * query.numel() * bf16_bytes
    table_bytes = (cache.block_tables.numel() + 2 * batch + 1) * int32_bytes
    # Query i of a chunk sees the cached prefix and i + 1 of the chunk's own keys.
    attended = batch * (chunk * (context - chunk) + chunk * (chunk + 1) // 2)
    flops = 4 * attended * geo.num_q_heads * geo.head_dim  # QK^T and PV, 2 flops a multiply-add
    return bench_ms(paged), bench_ms(sdpa), kv_bytes + io_bytes + table_bytes, flops


def run_gpu(device: torch.device) -> int:
    geo = Geometry(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    print(f"device: {torch.cuda.get_device_name(device)}")
    if not check(geo, [1, 15, 16, 17, 1000, 4100], device):
        print("correctness check failed: no timings", file=sys.stderr)
        return 1
    copy_bw = copy_bandwidth(device)
    print(f"copy_bw: {copy_bw / 1e9:.1f} GB/s")
    print(f"target_decode_bw_frac_b64_c4096: {TARGET_BW_FRAC:.2f} fraction")
    print(f"target_decode_vs_sdpa: {TARGET_SDPA_RATIO:.2f} ratio")
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            if batch * context > MAX_TOKENS:
                continue
            paged_ms, sdpa_ms, moved = decode_point(batch, context, geo, device)
            frac = moved / (paged_ms * 1e-3) / copy_bw
            name = f"b{batch}_c{context}"
            print(f"decode_us_{name}: {paged_ms * 1e3:.1f} us")
            print(f"decode_gbps_{name}: {moved / (paged_ms * 1e-3) / 1e9:.1f} GB/s")
            print(f"decode_bw_frac_{name}: {frac:.2f} fraction")
            print(f"decode_vs_sdpa_{name}: {paged_ms / sdpa_ms:.2f} ratio")
            rows.append((batch, context, paged_ms, sdpa_ms, moved / (paged_ms * 1e-3) / 1e9, frac))
            torch.cuda.empty_cache()
    print(f"\n{'batch':>6} {'ctx':>6} {'paged us':>9} {'sdpa us':>9} {'GB/s':>7} {'of copy':>8}"
          f" {'vs sdpa':>8}")
    for batch, context, paged_ms, sdpa_ms, gbps, frac in rows:
        print(f"{batch:>6} {context:>6} {paged_ms * 1e3:>9.1f} {sdpa_ms * 1e3:>9.1f} {gbps:>7.0f}"
              f" {frac:>8.2f} {paged_ms / sdpa_ms:>8.2f}")
    print()
    run_prefill(geo, device, copy_bw)
    return 0


def run_prefill(geo: Geometry, device: torch.device, copy_bw: float) -> None:
    """Time PREFILL_POINTS and print their figures, then their table."""
    rows = []
    for batch, context, chunk in PREFILL_POINTS:
        paged_ms, sdpa_ms, moved, flops = prefill_point(batch, context, chunk, geo, device)
        gbps, tflops = moved / (paged_ms * 1e-3) / 1e9, flops / (paged_ms * 1e-3) / 1e12
        name = f"b{batch}_c{context}_q{chunk}"
        print(f"prefill_us_{name}: {paged_ms * 1e3:.1f} us")
        print(f"prefill_gbps_{name}: {gbps:.1f} GB/s")
        print(f"prefill_bw_frac_{name}: {gbps * 1e9 / copy_bw:.2f} fraction")
        print(f"prefill_tflops_{name}: {tflops:.1f} TFLOP/s")
        print(f"prefill_vs_sdpa_{name}: {paged_ms / sdpa_ms:.2f} ratio")
        rows.append((batch, context, chunk, paged_ms, sdpa_ms, gbps, tflops))
        torch.cuda.empty_cache()
    print(f"\n{'batch':>6} {'ctx':>6} {'chunk':>6} {'paged us':>9} {'sdpa us':>9} {'GB/s':>7}"
          f" {'TFLOP/s':>8} {'vs sdpa':>8}")
    for batch, context, chunk, paged_ms, sdpa_ms, gbps, tflops in rows:
        print(f"{batch:>6} {context:>6} {chunk:>6} {paged_ms * 1e3:>9.1f} {sdpa_ms * 1e3:>9.1f}"
              f" {gbps:>7.0f} {tflops:>8.1f} {paged_ms / sdpa_ms:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-check", action="store_true",
                        help="only the correctness check, on tiny CPU shapes (Triton's "
                             "interpreter: TRITON_INTERPRET=1 on a machine with CUDA)")
    args = parser.parse_args(argv)
    if args.cpu_check:
        passed = check(Geometry(8, 2, 64, 16), [1, 15, 16, 17, 100], torch.device("cpu"))
        return 0 if passed else 1
    missing = why_no_cuda()
    if missing is not None:
        print(f"bench-gpu: {missing}; --cpu-check runs the correctness check alone on the CPU",
              file=sys.stderr)
        return 1
    return run_gpu(torch.device("cuda"))


if __name__ == "__main__":
    sys.exit(main())
