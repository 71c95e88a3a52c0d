"""CUDA graphs for decode steps (`pagedkv runner --cuda-graphs`): one forward's launches replayed
at once instead of 2-3 Triton launches and their Python checks per layer.

    graphs = DecodeGraphs(runner)             # captures one graph per bucket (seconds)
    if graphs.fits(inputs): logits = graphs.run(inputs)   # else the eager forward

A graph replays fixed launches on fixed addresses, so everything a decode forward reads lives in
static buffers sized for the largest bucket, and a step of S sequences runs the graph of the
smallest bucket of at least S (BUCKETS), padded:

- the block table has a fixed width, the longest a sequence can need (max_model_len /
  block_size blocks); a step's tables are copied into its first columns;
- the decode kernel's split plan is static: sized for max_model_len (PagedContext.max_decode_len),
  whatever the step's longest context, since the plan is part of the captured launches;
- nothing in the captured forward reads a device value back (the host passes every size);
- a padded row reads one position of block 0 (seq_len 1) and writes nothing (slot -1), and its
  logits are dropped.

`run` copies the step's inputs (already on the device: ModelRunner.prepare) into the static
buffers, writes the padding, replays, and returns a copy of the bucket's first S logits rows.
Capture and replay come from `GraphOps`: CUDA's by default; the CPU tests inject a stand-in that
runs the captured function again (torch.cuda.CUDAGraph cannot run on a CPU). A mixed or prefill
step, more sequences than the largest bucket, or a table wider than the fixed width runs eagerly.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv.model_runner.kernels.paged_attention import CONTEXT_KWARG, PagedContext
from pagedkv.vocab.blocks import blocks_for

if TYPE_CHECKING:
    from pagedkv.model_runner.runner import ModelRunner, StepInputs

# Batch sizes a graph is captured for; a step pads to the smallest that holds it.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A padded row's slot (store_kv writes nothing there) and context length (one position read).
PAD_SLOT, PAD_SEQ_LEN = -1, 1

# A captured forward: (replay it, the static [bucket, vocab] logits each replay rewrites).
Captured = tuple[Callable[[], None], torch.Tensor]


@dataclass(frozen=True)
class GraphOps:
    """How a forward is captured into something replayable."""

    # Capture `forward` (which returns its logits) on the device; what replays it and the
    # static tensor the replays write.
    capture: Callable[[Callable[[], torch.Tensor]], Captured]


def cuda_capture(forward: Callable[[], torch.Tensor]) -> Captured:
    """`forward` captured in a CUDA graph, after one run on a side stream (Triton compiles and
    torch's allocator settles outside the capture). Every graph shares one memory pool."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_graph_pool()):
        logits = forward()
    return graph.replay, logits


_POOL: list[torch.cuda._POOL_HANDLE] = []


def _graph_pool() -> torch.cuda._POOL_HANDLE:
    """One memory pool for every graph of the process: buckets are captured largest first, so
    the smaller ones reuse its memory (only one replays at a time)."""
    if not _POOL:
        _POOL.append(torch.cuda.graph_pool_handle())
    return _POOL[0]


CUDA_GRAPH_OPS = GraphOps(cuda_capture)


class StaticInputs:
    """The buffers every graph reads, sized for the largest bucket; a bucket reads the first
    rows. Filled with padding (and `last`, `query_start_loc` fixed: one token per sequence)."""

    def __init__(self, max_seqs: int, width: int, device: torch.device) -> None:
        def full(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        self.width = width  # blocks per table: max_model_len / block_size, rounded up
        self.input_ids = full((max_seqs,), 0, torch.int64)  # [B] each sequence's new token
        self.positions = full((max_seqs,), 0, torch.int64)  # [B] its position
        self.slots = full((max_seqs,), PAD_SLOT, torch.int64)  # [B] where its K/V goes
        self.tables = full((max_seqs, width), 0, torch.int32)  # [B, width] block tables
        self.seq_lens = full((max_seqs,), PAD_SEQ_LEN, torch.int32)  # [B] contexts
        # [B] / [B + 1]: row i is sequence i's last (only) token, and starts at i.
        self.last = torch.arange(max_seqs, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)

    def load(self, inputs: "StepInputs", bucket: int) -> None:
        """Copy a decode step's inputs into the first rows and pad the rest of `bucket`."""
        context = inputs.context
        num_seqs, width = context.block_tables.shape
        self.input_ids[:num_seqs].copy_(inputs.input_ids[0])
        self.positions[:num_seqs].copy_(inputs.position_ids[0])
        self.slots[:num_seqs].copy_(context.slot_mapping)
        self.tables[:num_seqs, :width].copy_(context.block_tables)
        self.seq_lens[:num_seqs].copy_(context.seq_lens)
        # Padding: rows past the step's read one position and never write the pool.
        self.input_ids[num_seqs:bucket].zero_()
        self.positions[num_seqs:bucket].zero_()
        self.slots[num_seqs:bucket].fill_(PAD_SLOT)
        self.seq_lens[num_seqs:bucket].fill_(PAD_SEQ_LEN)


class DecodeGraphs:
    """One captured decode forward per bucket of `runner`'s batch sizes."""

    def __init__(self, runner: "ModelRunner", ops: GraphOps = CUDA_GRAPH_OPS,
                 buckets: tuple[int, ...] = BUCKETS) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"graph buckets must be sizes >= 1, got {buckets}")
        self.runner = runner
        self.buckets = tuple(sorted(set(buckets)))
        width = blocks_for(runner.max_model_len, runner.block_size)
        self.static = StaticInputs(self.buckets[-1], width, runner.pool.device)
        # bucket -> its captured forward, captured largest first (they share memory).
        self.graphs = {bucket: ops.capture(self._forward(bucket))
                       for bucket in reversed(self.buckets)}

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket of at least `num_seqs` sequences; None past the largest."""
        return next((bucket for bucket in self.buckets if bucket >= num_seqs), None)

    def fits(self, inputs: "StepInputs") -> bool:
        """Whether a graph can run this step: decodes only, a bucket holds them, and their
        tables fit the fixed width."""
        context = inputs.context
        num_seqs, width = context.block_tables.shape
        return (context.num_decodes == num_seqs and self.bucket_for(num_seqs) is not None
                and width <= self.static.width)

    def run(self, inputs: "StepInputs") -> torch.Tensor:
        """[S, vocab] fp32 logits of a step that `fits`, from its bucket's graph."""
        num_seqs = inputs.context.block_tables.shape[0]
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None and self.fits(inputs), "run a step that fits a graph"
        self.static.load(inputs, bucket)
        replay, logits = self.graphs[bucket]
        replay()
        return logits[:num_seqs].float().clone()

    def _forward(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The decode forward of `bucket` sequences on the static buffers: [bucket, vocab]."""
        runner, static = self.runner, self.static

        def forward() -> torch.Tensor:
            context = PagedContext(
                backend=runner.backend, pool=runner.pool, slot_mapping=static.slots[:bucket],
                block_tables=static.tables[:bucket], seq_lens=static.seq_lens[:bucket],
                query_start_loc=static.query_start_loc[:bucket + 1], num_decodes=bucket,
                max_decode_len=runner.max_model_len, max_q_len=1)
            with torch.inference_mode():
                output = runner.model(input_ids=static.input_ids[None, :bucket],
                                      position_ids=static.positions[None, :bucket],
                                      use_cache=False, logits_to_keep=static.last[:bucket],
                                      **{CONTEXT_KWARG: context})
            logits: torch.Tensor = output.logits[0]  # [bucket, vocab]
            return logits

        return forward
