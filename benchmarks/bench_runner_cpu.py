"""A decode step of ModelRunner on the CPU (torch backend): where the time goes.

    python benchmarks/bench_runner_cpu.py [--reps N] [--rounds N] [--threads N] [--clock cpu]

Two random-initialized fp32 Llamas, the runner's presets: tiny is tiny-llama (2 layers, hidden
128, 4 heads, 2 KV heads, intermediate 256) and small is small-llama (4 layers, hidden 1024, 16
heads, 4 KV heads, intermediate 2816), vocab 1000. The pool is a plain tensor
[blocks, layers, 2, 16, H_kv, D] of random K/V; each of the batch's sequences holds a context
of 100-700 tokens (seeded) in randomly permuted blocks, and each step decodes one token per
sequence (`ModelRunner.step`: prepare, the model forward with "pagedkv" attention, the logits
out). The same step repeats, rewriting the same slots.

    decode_step_ms_{tiny,small}_b{16,32}   median wall time of one ModelRunner.step
    runner_overhead_frac                   small, batch 16: share of ModelRunner.step's time
                                           spent outside `model(...)` (input preparation, the
                                           host-to-device copy, the logits out)
    decode_attention_frac_{tiny,small}     batch 16: share of `model(...)` spent in the
                                           "pagedkv" attention hook (store_kv + paged decode)

Every figure is also measured on a baseline that keeps this file's copy of the runner's input
preparation and the torch twins as they were before the CPU work (gather whole blocks, pad,
einsum scores; several tensors each moved to the device on its own): the `_baseline` lines.
Rounds alternate new and baseline, REPS steps each, so load on the machine hits both alike; a
figure is the median over rounds of the per-round sums.
"""

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, LlamaForCausalLM

from pagedkv.model_runner.kernels.attention_backend import TORCH_BACKEND, AttentionBackend
from pagedkv.model_runner.kernels.paged_attention import (
    ATTENTION_NAME,
    PagedContext,
    paged_attention_forward,
)
from pagedkv.model_runner.kernels.paged_checks import (
    check_attention_args,
    check_index,
    check_window_softcap,
)
from pagedkv.model_runner.kernels.per_forward import PerForward
from pagedkv.model_runner.models import kv_geometry, preset_config
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk, StepInputs
from pagedkv.vocab.blocks import blocks_for
from pagedkv.vocab.geometry import PRESETS

BLOCK_SIZE = 16
CONTEXTS = (100, 700)  # each sequence's context length is drawn from this range, inclusive
# The figures' names -> the runner's presets (pagedkv.vocab.geometry.PRESETS).
MODELS = {"tiny": PRESETS["tiny-llama"], "small": PRESETS["small-llama"]}
BATCHES = (16, 32)


# -- the baseline: the torch twins and the input preparation before the CPU work --------------

def baseline_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float, *,
                     sliding_window: int | None = None, softcap: float | None = None,
                     check_values: bool = True, per_forward: PerForward | None = None,
                     max_q_len: int | None = None) -> torch.Tensor:
    """The torch prefill twin before: padded queries, whole blocks gathered, einsum scores
    (the runner's hook passes check_values=False: only the shape checks ran, as here), all of
    it in every layer (per_forward and the host's max_q_len unused)."""
    geometry = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, False)
    check_index("query_start_loc", query_start_loc, torch.int32, (seq_lens.shape[0] + 1,),
                k_cache.device)
    window, cap = check_window_softcap(sliding_window, softcap)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], geometry.num_kv_heads
    group = num_q_heads // num_kv_heads
    q_lens = query_start_loc.diff().long()
    max_q_len = int(q_lens.max())
    seq_of = torch.repeat_interleave(torch.arange(num_seqs), q_lens, output_size=num_tokens)
    row_of = torch.arange(num_tokens) - query_start_loc[seq_of]
    q = query.new_zeros((num_seqs, max_q_len, num_q_heads, head_dim), dtype=torch.float32)
    q[seq_of, row_of] = query.float()
    q = q.view(num_seqs, max_q_len, num_kv_heads, group, head_dim)
    used_blocks = (seq_lens.long() + BLOCK_SIZE - 1) // BLOCK_SIZE
    width = int(used_blocks.max())
    table = torch.where(torch.arange(width) < used_blocks[:, None], block_tables[:, :width], 0)
    valid = torch.arange(width * BLOCK_SIZE) < seq_lens[:, None].long()
    keys = k_cache[table.long()].flatten(1, 2).float()
    values = v_cache[table.long()].flatten(1, 2).float().masked_fill(~valid[:, :, None, None], 0)
    q_pos = (seq_lens.long() - q_lens)[:, None] + torch.arange(max_q_len)
    positions = torch.arange(keys.shape[1])
    counted = valid[:, None, :] & (positions[None, None, :] <= q_pos[:, :, None])
    if window:
        counted &= positions[None, None, :] > q_pos[:, :, None] - window
    scores = torch.einsum("sqhgd,slhd->shgql", q, keys) * scale
    if cap:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~counted[:, None, None], float("-inf"))
    out = torch.einsum("shgql,slhd->sqhgd", scores.softmax(-1), values)
    return out.reshape(num_seqs, max_q_len, num_q_heads, head_dim)[seq_of, row_of].to(query.dtype)


def baseline_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    num_splits: int | None = None, *, sliding_window: int | None = None,
                    softcap: float | None = None, check_values: bool = True,
                    per_forward: PerForward | None = None,
                    max_seq_len: int | None = None) -> torch.Tensor:
    """The torch decode twin before: prefill with one query per sequence (no split-K, so
    `max_seq_len` sizes nothing)."""
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return baseline_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            scale, sliding_window=sliding_window, softcap=softcap,
                            check_values=check_values)


BASELINE_BACKEND = AttentionBackend("torch", TORCH_BACKEND.store_kv, baseline_decode,
                                    baseline_prefill)


class BaselineRunner(ModelRunner):
    """ModelRunner with its input preparation as it was: torch ops, one copy per tensor."""

    def prepare(self, chunks: Sequence[SequenceChunk]) -> StepInputs:
        if not chunks or any(not c.token_ids or c.start < 0
                             or len(c.slot_mapping) != len(c.token_ids) for c in chunks):
            raise ValueError("bad chunks")
        lens = torch.tensor([len(c.token_ids) for c in chunks])
        starts = torch.tensor([c.start for c in chunks])
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
        slots = torch.tensor([s for c in chunks for s in c.slot_mapping], dtype=torch.int64)
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor([[*c.block_table, *[0] * (width - len(c.block_table))]
                               for c in chunks], dtype=torch.int64)
        if bool((token_ids < 0).any()) or bool((token_ids >= self.vocab_size).any()):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        seq_of = torch.repeat_interleave(torch.arange(len(chunks)), lens)
        positions = torch.arange(len(token_ids)) - query_start_loc[seq_of] + starts[seq_of]
        table_lens, seq_lens = torch.tensor([len(c.block_table) for c in chunks]), starts + lens
        if bool((table_lens < (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE).any()):
            raise ValueError("a block table is shorter than its sequence")
        used = torch.arange(tables.shape[1]) < table_lens[:, None]
        if bool((tables[used] < 0).any()) or bool((tables[used] >= self.pool.shape[0]).any()):
            raise ValueError("block ids out of range")
        expected = tables[seq_of, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        if bool(((slots != expected) & (slots != -1)).any()):
            raise ValueError("a slot is neither -1 nor its token's slot in the block table")
        device, decode = self.pool.device, len(token_ids) == len(chunks)
        context = PagedContext(
            backend=self.backend, pool=self.pool, slot_mapping=slots.to(device),
            block_tables=tables.to(device, torch.int32),
            seq_lens=(starts + lens).to(device, torch.int32),
            query_start_loc=query_start_loc.to(device, torch.int32),
            # as before: the decode kernel only when every sequence decodes
            num_decodes=len(chunks) if decode else 0,
            max_decode_len=int((starts + lens).max()) if decode else 0)
        return StepInputs(token_ids[None].to(device), positions[None].to(device),
                          (query_start_loc[1:] - 1).to(device), context)


# -- the measurement ---------------------------------------------------------------------------

# The clock every figure reads: wall time, or with --clock cpu this thread's CPU time (torch then
# runs on one thread, the calling one), which other processes' load on the machine distorts less.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


class Stopwatch:
    """Seconds accumulated inside calls of a wrapped callable."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += clock() - started
        return timed


class TimedModel:
    """The model, with the time spent inside `model(...)` counted (ModelRunner calls it)."""

    def __init__(self, model: LlamaForCausalLM, watch: Stopwatch) -> None:
        self.model, self.call = model, watch.wrap(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)


@dataclass
class Setup:
    """One runner on one decode batch, with its stopwatches."""

    runner: ModelRunner
    chunks: list[SequenceChunk]
    forward: Stopwatch  # inside model(...)
    attention: Stopwatch  # inside the "pagedkv" attention hook, every layer


def decode_batch(model: LlamaForCausalLM, batch: int, seed: int) -> tuple[torch.Tensor,
                                                                       list[SequenceChunk]]:
    """A random pool and one decode chunk per sequence (its last context token)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(CONTEXTS[0], CONTEXTS[1] + 1, (batch,), generator=generator).tolist()
    used = [blocks_for(n, BLOCK_SIZE) for n in lengths]
    num_blocks = sum(used) + 8
    layers, kv_heads, head_dim, _ = kv_geometry(model)
    pool = torch.randn(num_blocks, layers, 2, BLOCK_SIZE, kv_heads, head_dim,
                       generator=generator)
    owned = torch.split(torch.randperm(num_blocks, generator=generator),
                        [*used, num_blocks - sum(used)])
    chunks = []
    for length, blocks in zip(lengths, owned, strict=False):
        table, position = blocks.tolist(), length - 1
        slot = table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
        token = int(torch.randint(0, model.config.vocab_size, (1,), generator=generator))
        chunks.append(SequenceChunk([token], position, [slot], table))
    return pool, chunks


def make_setup(model: LlamaForCausalLM, batch: int, baseline: bool) -> Setup:
    pool, chunks = decode_batch(model, batch, seed=batch)
    runner_type = BaselineRunner if baseline else ModelRunner
    runner = runner_type(model, pool, BLOCK_SIZE, BASELINE_BACKEND if baseline else TORCH_BACKEND)
    forward = Stopwatch()
    runner.model = TimedModel(model, forward)  # type: ignore[assignment]
    return Setup(runner, chunks, forward, Stopwatch())


def run_round(setup: Setup, reps: int) -> tuple[float, float, float]:
    """(step, forward, attention) seconds summed over `reps` steps."""
    setup.forward.seconds = setup.attention.seconds = 0.0
    AttentionInterface.register(ATTENTION_NAME, setup.attention.wrap(paged_attention_forward))
    try:
        started = clock()
        for _ in range(reps):
            setup.runner.step(setup.chunks)
        step = clock() - started
    finally:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return step, setup.forward.seconds, setup.attention.seconds


def measure(model: LlamaForCausalLM, batch: int, reps: int,
            rounds: int) -> dict[str, tuple[float, float, float]]:
    """{"new"/"baseline": (median step s, overhead fraction, attention fraction of forward)}."""
    setups = {"new": make_setup(model, batch, False), "baseline": make_setup(model, batch, True)}
    logits = [setup.runner.step(setup.chunks) for setup in setups.values()]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)  # same computation
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name, setup in setups.items():
            samples[name].append(run_round(setup, reps))
    result = {}
    for name, rows in samples.items():
        step = statistics.median(row[0] for row in rows)
        overhead = statistics.median((row[0] - row[1]) / row[0] for row in rows)
        attention = statistics.median(row[2] / row[1] for row in rows)
        result[name] = (step / reps, overhead, attention)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per setup")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall time, or this thread's CPU time (implies --threads 1)")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    if args.threads or args.clock == "cpu":
        torch.set_num_threads(1 if args.clock == "cpu" else args.threads)
    print(f"torch_threads: {torch.get_num_threads()} threads")
    print(f"clock: {args.clock}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, preset in MODELS.items():
            model = LlamaForCausalLM(preset_config(preset)).eval()  # type: ignore[no-untyped-call]
            for batch in BATCHES:
                figures = measure(model, batch, args.reps, args.rounds)
                for variant, suffix in (("new", ""), ("baseline", "_baseline")):
                    step, overhead, attention = figures[variant]
                    print(f"decode_step_ms_{name}_b{batch}{suffix}: {step * 1e3:.2f} ms")
                    if batch == 16:
                        print(f"decode_attention_frac_{name}{suffix}: {attention:.3f} ratio")
                        if name == "small":
                            print(f"runner_overhead_frac{suffix}: {overhead:.3f} ratio")
                        else:
                            print(f"runner_overhead_frac_{name}{suffix}: {overhead:.3f} ratio")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
