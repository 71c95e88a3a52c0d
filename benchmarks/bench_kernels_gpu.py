"""Paged attention kernels on a GPU: correctness first, then bandwidth against two baselines and
the host time of a 32-layer forward's launches (`make bench-gpu`).

    python benchmarks/bench_kernels_gpu.py               # on CUDA: check, then time (a few minutes)
    python benchmarks/bench_kernels_gpu.py --quick       # fewer points (make gpu-check's)
    python benchmarks/bench_kernels_gpu.py --cpu-check   # the check only, tiny shapes, interpreter

1. Check: store_kv, decode (with and without split-K) and prefill through the Triton kernels
   against the torch backend on ragged batches whose unused slots are NaN.
2. Baselines (paged_bench.baselines): the device's copy bandwidth, measured here, and its
   datasheet figure by device name (device_bandwidth; an unknown device is said so:
   `datasheet_known: 0`). Every bandwidth figure is reported as a fraction of both
   (`<kernel>_bw_frac_<point>` of the copy, `<kernel>_bw_of_datasheet_<point>`).
3. Decode timing in Llama-3.1-8B's attention geometry (32 query heads, 8 KV heads, D=128, bf16,
   16-token blocks, randomly permuted block tables) for batch x context in a grid. Achieved
   bandwidth = bytes read and written (K/V of every context token, q, out, block tables) / median
   time (L2 flushed between calls), and the time against torch SDPA on a contiguous copy of the
   same K/V (query heads of one KV head folded into the query length, so SDPA reads each K/V row
   once too).
4. Chunked prefill timing in the same geometry (PREFILL_POINTS: a whole prompt, chunks after a
   cached prefix): the bytes it must move over its median time, its TFLOP/s (QK^T and PV of the
   causal chunk), and its time against SDPA with the chunk's causal mask aligned to the end of
   the context (torch's causal_lower_right).
5. The matrix (CASES): decode and prefill, fp16 and bf16 models, their own cache dtype and the fp8
   cache (float8_e4m3fn), D=128 (Llama-3.1-8B's heads) and D=256 (Gemma2-9B's: 16 query heads,
   8 KV heads), at one point each (MATRIX_DECODE, MATRIX_PREFILL).
6. The layer loop (layer_loop_bench): LOOP_LAYERS layers of store_kv + decode back to back, as
   a forward launches them (each layer its own slice of one pool, one per_forward plan, the
   host's checks and launches included), timed by CUDA events around the whole loop with no L2
   flush between layers, so host time the device waits for is counted. Then the same loop
   captured in one CUDA graph and replayed: the device time alone. Their difference per layer is
   the launch overhead that CUDA graphs remove (`loop_host_us_per_layer`).

Without CUDA it fails (exit 1, the reason on one line of stderr); `--cpu-check` runs the check
on tiny shapes there (Triton under the interpreter). Figures print one per line as
`name: value unit`, then tables (benchmarks/gpu_check.py reads the figures).
"""

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from layer_loop_bench import LOOP_POINTS, QUICK_LOOP_POINTS, run_layer_loop
from paged_bench import (
    GEOMETRIES,
    LLAMA,
    Baselines,
    Geometry,
    PagedBatch,
    baselines,
    bench_ms,
    check,
    moved_bytes,
    paged_batch,
    report_bandwidth,
)

from pagedkv.memory.cuda_driver import why_no_cuda
from pagedkv.model_runner.kernels.attention_backend import TRITON_BACKEND

# Batch x context grid of the headline decode (Llama geometry, bf16).
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 4096, 8192, 32768)
# batch x context cap: 2**21 tokens are 8 GiB of bf16 K/V, plus as much again for SDPA's copy.
MAX_TOKENS = 1 << 21
# Prefill (batch, context, chunk): a whole 2k prompt, alone and 16 at once; 512-token chunks
# after 3.5k cached tokens; a 2k chunk at the end of a 32k context.
PREFILL_POINTS = ((1, 2048, 2048), (16, 2048, 2048), (8, 4096, 512), (1, 32768, 2048))
# --quick: the decode point gpu_check's target names and one prefill point.
QUICK_DECODE, QUICK_PREFILL = ((64, 4096),), ((8, 4096, 512),)
# Targets, printed as context: fraction of copy bandwidth at batch 64 / ctx 4096, and SDPA ratio.
TARGET_BW_FRAC, TARGET_SDPA_RATIO = 0.70, 1.25
# The matrix's points: decode (batch, context), prefill (batch, context, chunk).
MATRIX_DECODE, MATRIX_PREFILL = (64, 4096), (8, 4096, 512)


@dataclass(frozen=True)
class Case:
    """One cell of the matrix."""

    kernel: str  # "decode" or "prefill"
    head_dim: int  # D: picks the geometry (GEOMETRIES)
    dtype: torch.dtype  # the model's (query and output)
    kv_dtype: torch.dtype  # the cache's: the model's, or float8_e4m3fn

    @property
    def name(self) -> str:
        return (f"d{self.head_dim}_{str(self.dtype).removeprefix('torch.')}_kv"
                f"{str(self.kv_dtype).removeprefix('torch.')}")


CASES = [Case(kernel, head_dim, dtype, kv_dtype)
         for kernel in ("decode", "prefill") for head_dim in (128, 256)
         for dtype in (torch.float16, torch.bfloat16)
         for kv_dtype in (dtype, torch.float8_e4m3fn)]


def decode_call(batch: int, context: int, geo: Geometry, dtype: torch.dtype,
                kv_dtype: torch.dtype, device: torch.device
                ) -> tuple[Callable[[], torch.Tensor], PagedBatch, torch.Tensor]:
    """(the paged decode of `batch` sequences of `context`, its cache, its query)."""
    cache = paged_batch([context] * batch, geo, kv_dtype, device, poison=False)
    query = torch.randn(batch, geo.num_q_heads, geo.head_dim, dtype=dtype, device=device)

    def paged() -> torch.Tensor:
        return TRITON_BACKEND.paged_decode_attention(
            query, cache.pool[:, 0], cache.pool[:, 1], cache.block_tables, cache.seq_lens,
            geo.head_dim**-0.5, check_values=False)

    return paged, cache, query


def decode_point(batch: int, context: int, geo: Geometry,
                 device: torch.device) -> tuple[float, float, int]:
    """(paged ms, SDPA ms, bytes moved by the paged kernel) for `batch` bf16 sequences of
    `context`."""
    paged, cache, query = decode_call(batch, context, geo, torch.bfloat16, torch.bfloat16,
                                      device)
    # SDPA baseline: contiguous [S, H_kv, L, D]; the group's query heads become query rows.
    table = cache.block_tables.long()
    k_dense, v_dense = (kv[table].flatten(1, 2).transpose(1, 2).contiguous()
                        for kv in cache.pool.unbind(1))
    q_dense = query.view(batch, geo.num_kv_heads, -1, geo.head_dim)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense,
                                              scale=geo.head_dim**-0.5)

    torch.testing.assert_close(paged().view_as(q_dense), sdpa(), atol=2e-2, rtol=2e-2)
    moved = moved_bytes(batch, context, batch, geo, torch.bfloat16, torch.bfloat16,
                        cache.block_tables.numel() + batch)
    return bench_ms(paged), bench_ms(sdpa), moved


def prefill_call(batch: int, context: int, chunk: int, geo: Geometry, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device
                 ) -> tuple[Callable[[], torch.Tensor], PagedBatch, torch.Tensor]:
    """(the paged prefill of `batch` sequences of `context` tokens whose last `chunk` are new
    queries, its cache, its query)."""
    cache = paged_batch([context] * batch, geo, kv_dtype, device, poison=False)
    query = torch.randn(batch * chunk, geo.num_q_heads, geo.head_dim, dtype=dtype, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * chunk

    def paged() -> torch.Tensor:
        return TRITON_BACKEND.paged_prefill_attention(
            query, cache.pool[:, 0], cache.pool[:, 1], cache.block_tables, cache.seq_lens,
            starts, geo.head_dim**-0.5, check_values=False)

    return paged, cache, query


def prefill_point(batch: int, context: int, chunk: int, geo: Geometry,
                  device: torch.device) -> tuple[float, float, int, int]:
    """(paged ms, SDPA ms, bytes the paged kernel must move, its flops) for `batch` bf16
    sequences of `context` tokens whose last `chunk` are new queries."""
    # Imported here: it imports triton, which must load after triton_env's TRITON_INTERPRET.
    from torch.nn.attention.bias import causal_lower_right

    group = geo.num_q_heads // geo.num_kv_heads
    paged, cache, query = prefill_call(batch, context, chunk, geo, torch.bfloat16,
                                       torch.bfloat16, device)
    # SDPA baseline: contiguous [S, H_q, L, D] (each KV head repeated for its query heads), the
    # chunk's causal mask aligned to the context's end.
    table = cache.block_tables.long()
    k_dense, v_dense = (kv[table].flatten(1, 2)[:, :context].transpose(1, 2)
                        .repeat_interleave(group, dim=1).contiguous()
                        for kv in cache.pool.unbind(1))
    q_dense = query.view(batch, chunk, geo.num_q_heads, geo.head_dim).transpose(1, 2)
    mask = causal_lower_right(chunk, context)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask,
                                              scale=geo.head_dim**-0.5)

    expected = sdpa().transpose(1, 2).reshape_as(query)
    torch.testing.assert_close(paged(), expected, atol=2e-2, rtol=2e-2)
    moved = moved_bytes(batch, context, batch * chunk, geo, torch.bfloat16, torch.bfloat16,
                        cache.block_tables.numel() + 2 * batch + 1)
    return bench_ms(paged), bench_ms(sdpa), moved, prefill_flops(batch, context, chunk, geo)


def prefill_flops(batch: int, context: int, chunk: int, geo: Geometry) -> int:
    """QK^T and PV flops of causal chunks (2 a multiply-add): query i of a chunk sees the cached
    prefix and i + 1 of the chunk's own keys."""
    attended = batch * (chunk * (context - chunk) + chunk * (chunk + 1) // 2)
    return 4 * attended * geo.num_q_heads * geo.head_dim


def run_decode(points: tuple[tuple[int, int], ...], device: torch.device,
               base: Baselines) -> None:
    """Time the headline decode points (Llama, bf16) and print their figures, then a table."""
    print(f"target_decode_bw_frac_b64_c4096: {TARGET_BW_FRAC:.2f} fraction")
    print(f"target_decode_vs_sdpa: {TARGET_SDPA_RATIO:.2f} ratio")
    rows = []
    for batch, context in points:
        paged_ms, sdpa_ms, moved = decode_point(batch, context, LLAMA, device)
        name = f"b{batch}_c{context}"
        gbps = report_bandwidth("decode", name, moved, paged_ms, base)
        print(f"decode_vs_sdpa_{name}: {paged_ms / sdpa_ms:.2f} ratio")
        rows.append((batch, context, paged_ms, sdpa_ms, gbps))
        torch.cuda.empty_cache()
    print(f"\n{'batch':>6} {'ctx':>6} {'paged us':>9} {'sdpa us':>9} {'GB/s':>7} {'of copy':>8}"
          f" {'vs sdpa':>8}")
    for batch, context, paged_ms, sdpa_ms, gbps in rows:
        print(f"{batch:>6} {context:>6} {paged_ms * 1e3:>9.1f} {sdpa_ms * 1e3:>9.1f} {gbps:>7.0f}"
              f" {gbps * 1e9 / base.copy:>8.2f} {paged_ms / sdpa_ms:>8.2f}")
    print()


def run_prefill(points: tuple[tuple[int, int, int], ...], device: torch.device,
                base: Baselines) -> None:
    """Time the headline prefill points and print their figures, then a table."""
    rows = []
    for batch, context, chunk in points:
        paged_ms, sdpa_ms, moved, flops = prefill_point(batch, context, chunk, LLAMA, device)
        name = f"b{batch}_c{context}_q{chunk}"
        gbps = report_bandwidth("prefill", name, moved, paged_ms, base)
        tflops = flops / (paged_ms * 1e-3) / 1e12
        print(f"prefill_tflops_{name}: {tflops:.1f} TFLOP/s")
        print(f"prefill_vs_sdpa_{name}: {paged_ms / sdpa_ms:.2f} ratio")
        rows.append((batch, context, chunk, paged_ms, sdpa_ms, gbps, tflops))
        torch.cuda.empty_cache()
    print(f"\n{'batch':>6} {'ctx':>6} {'chunk':>6} {'paged us':>9} {'sdpa us':>9} {'GB/s':>7}"
          f" {'TFLOP/s':>8} {'vs sdpa':>8}")
    for batch, context, chunk, paged_ms, sdpa_ms, gbps, tflops in rows:
        print(f"{batch:>6} {context:>6} {chunk:>6} {paged_ms * 1e3:>9.1f} {sdpa_ms * 1e3:>9.1f}"
              f" {gbps:>7.0f} {tflops:>8.1f} {paged_ms / sdpa_ms:>8.2f}")
    print()


def run_matrix(device: torch.device, base: Baselines) -> None:
    """Each of CASES at its kernel's matrix point: time, bandwidth against both baselines."""
    for case in CASES:
        geo = GEOMETRIES[case.head_dim]
        if case.kernel == "decode":
            batch, context = MATRIX_DECODE
            paged, cache, query = decode_call(batch, context, geo, case.dtype, case.kv_dtype,
                                              device)
            tables = cache.block_tables.numel() + batch
        else:
            batch, context, chunk = MATRIX_PREFILL
            paged, cache, query = prefill_call(batch, context, chunk, geo, case.dtype,
                                               case.kv_dtype, device)
            tables = cache.block_tables.numel() + 2 * batch + 1
        moved = moved_bytes(batch, context, query.shape[0], geo, case.dtype, case.kv_dtype,
                            tables)
        report_bandwidth(case.kernel, f"{case.name}_b{batch}_c{context}", moved,
                         bench_ms(paged), base)
        del paged, cache, query
        torch.cuda.empty_cache()


def run_gpu(device: torch.device, quick: bool) -> int:
    print(f"device: {torch.cuda.get_device_name(device)}")
    if not check(LLAMA, [1, 15, 16, 17, 1000, 4100], device):
        print("correctness check failed: no timings", file=sys.stderr)
        return 1
    base = baselines(device)
    grid = tuple((b, c) for b in BATCHES for c in CONTEXTS if b * c <= MAX_TOKENS)
    run_decode(QUICK_DECODE if quick else grid, device, base)
    run_prefill(QUICK_PREFILL if quick else PREFILL_POINTS, device, base)
    run_matrix(device, base)
    run_layer_loop(QUICK_LOOP_POINTS if quick else LOOP_POINTS, device, base)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="one headline decode and prefill point, the matrix, two loop "
                             "points (make gpu-check)")
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
    return run_gpu(torch.device("cuda"), args.quick)


if __name__ == "__main__":
    sys.exit(main())
