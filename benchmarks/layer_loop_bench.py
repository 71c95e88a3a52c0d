"""The launch overhead of a forward: LOOP_LAYERS layers of store_kv + decode back to back, as the
runner launches them, eager and replayed from one CUDA graph (bench_kernels_gpu's part 6).

Each layer writes the batch's new token into its own slice of one pool and attends over its
context, with one per_forward plan per forward and the launchers' host checks, as
paged_attention does. The eager loop is timed by CUDA events around whole forwards with no L2
flush between layers, so the time the device waits for the host counts; the graph replays the same
launches with no host in between. Their difference per layer is the host's launch overhead.
"""

from collections.abc import Callable

import torch
from paged_bench import LLAMA, Baselines, moved_bytes, report_bandwidth

from pagedkv.model_runner.decode_graphs import cuda_capture
from pagedkv.model_runner.kernels.attention_backend import TRITON_BACKEND
from pagedkv.model_runner.kernels.triton_env import triton

# The layer loop: layers per forward, (batch, context) points, timed forwards per figure.
LOOP_LAYERS = 32
LOOP_POINTS = ((1, 1024), (16, 2048), (64, 2048))
QUICK_LOOP_POINTS = ((1, 1024), (64, 2048))
LOOP_REPS = 20


def layer_loop(batch: int, context: int,
               device: torch.device) -> tuple[Callable[[], torch.Tensor], int]:
    """(one forward's LOOP_LAYERS layers of store_kv + decode, Llama bf16, the bytes they move).
    Each layer writes the batch's new token into its own slice of one pool and attends over its
    context; one per_forward dict per forward, as the runner's."""
    geo = LLAMA
    blocks = triton.cdiv(context, geo.block_size)
    pool = torch.randn(batch * blocks, LOOP_LAYERS, 2, geo.block_size, geo.num_kv_heads,
                       geo.head_dim, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(batch * blocks, device=device).int().view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    last = context - 1  # the new token's position: its slot in each table
    slots = (tables[:, last // geo.block_size].long() * geo.block_size + last % geo.block_size)
    query = torch.randn(batch, geo.num_q_heads, geo.head_dim, dtype=torch.bfloat16,
                        device=device)
    new_kv = torch.randn(batch, geo.num_kv_heads, geo.head_dim, dtype=torch.bfloat16,
                         device=device)

    def forward() -> torch.Tensor:
        """The loop; the last layer's attention output (what a graph capture keeps)."""
        per_forward: dict[tuple[object, ...], object] = {}
        for layer in range(LOOP_LAYERS):
            k_cache, v_cache = pool[:, layer].unbind(1)
            TRITON_BACKEND.store_kv(new_kv, new_kv, k_cache, v_cache, slots, check_values=False)
            out = TRITON_BACKEND.paged_decode_attention(
                query, k_cache, v_cache, tables, lens, geo.head_dim**-0.5, check_values=False,
                per_forward=per_forward, max_seq_len=context)
        return out

    per_layer = moved_bytes(batch, context, batch, geo, torch.bfloat16, torch.bfloat16,
                            tables.numel() + batch) + 2 * new_kv.numel() * 2 + 8 * batch
    return forward, LOOP_LAYERS * per_layer


def events_us(fn: Callable[[], object], reps: int) -> float:
    """Microseconds per call of `reps` calls back to back, between two CUDA events: no L2 flush,
    and the device's idle time while the host prepares the next launch counts."""
    fn()
    torch.cuda.synchronize()
    # torch leaves Event's constructor unannotated.
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / reps


def run_layer_loop(points: tuple[tuple[int, int], ...], device: torch.device,
                   base: Baselines) -> None:
    """The layer loop at each point, eager and replayed from a CUDA graph."""
    for batch, context in points:
        forward, moved = layer_loop(batch, context, device)
        name = f"b{batch}_c{context}"
        eager_us = events_us(forward, LOOP_REPS)
        print(f"loop{LOOP_LAYERS}_us_per_layer_{name}: {eager_us / LOOP_LAYERS:.1f} us")
        report_bandwidth(f"loop{LOOP_LAYERS}", name, moved, eager_us * 1e-3, base)
        replay, _ = cuda_capture(forward)  # the runner's own capture (--cuda-graphs)
        graph_us = events_us(replay, LOOP_REPS)
        print(f"loop{LOOP_LAYERS}_graph_us_per_layer_{name}: {graph_us / LOOP_LAYERS:.1f} us")
        print(f"loop_host_us_per_layer_{name}: {(eager_us - graph_us) / LOOP_LAYERS:.1f} us")
        print(f"loop_graph_speedup_{name}: {eager_us / graph_us:.2f} ratio")
        del forward, replay
        torch.cuda.empty_cache()
