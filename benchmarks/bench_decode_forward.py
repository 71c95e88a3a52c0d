"""The runner's bare decode forward against transformers' own decode step, one process, on CPU.

    python benchmarks/bench_decode_forward.py [--rounds 5] [--threads 1]

Model and workload are bench_runner's: the "tiny-llama" preset (fp32, seed 0), its NUM_PROMPTS
(32) seeded prompts of 20-120 tokens, NEW_TOKENS greedy tokens each. Every round generates them
with each contestant from the same prompts, one after another in this process:
- runner: `ModelRunner.step` (what the runner's forward thread calls: input preparation, the
  model with "pagedkv" attention, the logits out) on a pool of NUM_BLOCKS blocks of BLOCK_SIZE
  slots, the sequences' blocks taken from a seeded permutation (scattered, as a daemon's are);
  one packed prefill of every prompt, then one step per token, each sequence bringing its last
  token; the CPU's default attention backend (get_backend("auto", "cpu"): "cpu", the C kernels
  of cpu_paged for store_kv and the decode).
- twin: the same runner on the "torch" backend (the vectorized torch twins of the Triton
  kernels), for comparison.
- transformers: the same model with sdpa; one left-padded prefill of all prompts with an
  attention mask into a DynamicCache, then one `model(...)` per token with the cache, the
  extended mask and explicit positions (what `generate`'s loop runs per step, without its
  logits processors).
Greedy sampling (argmax) is outside every timed call. Timed: each decode step alone (the
prefill is not), wall clock; a figure is the median over every decode step of every round.

Figures:
    decode_forward_ms          runner decode step, median
    hf_decode_step_ms          transformers decode step, median
    decode_forward_vs_hf_step  their ratio (target <= 1.0)
    decode_forward_twin_ms     the twin's decode step, median
    decode_forward_vs_twin     runner / twin
    decode_attention_frac      share of the runner's decode steps spent in the "pagedkv"
                               attention hook (store_kv + decode attention, every layer)
    hf_attention_frac          share of transformers' decode steps spent in its sdpa attention
                               (the DynamicCache's concatenation is outside it)
    decode_tokens_match_hf     share of the sequences whose runner tokens equal transformers'
                               (the script exits 1 below 1, or if the twin's differ)
    {runner,hf}_aten_calls_per_step  aten calls (nested ones included) per decode step under
                               torch.profiler: the glue's op count, whatever the load
    {runner,hf}_op_ms_<op>     the PROFILED_OPS costliest aten ops of each contestant's decode
                               steps, self CPU ms per step under torch.profiler (which inflates
                               small ops: read them as shares, not as times)
The attention shares and the op profile come from more generations of each, with the hook
wrapped by a timer or the profiler on (not part of the ratio's rounds).
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from bench_runner import (
    BLOCK_SIZE,
    NEW_TOKENS,
    NUM_BLOCKS,
    PAD_ID,
    load_hf_model,
    make_prompts,
)
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pagedkv.model_runner.kernels.attention_backend import (
    TORCH_BACKEND,
    AttentionBackend,
    get_backend,
)
from pagedkv.model_runner.kernels.paged_attention import ATTENTION_NAME, paged_attention_forward
from pagedkv.model_runner.models import kv_geometry
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk
from pagedkv.vocab.blocks import blocks_for

# transformers' name of the attention its contestant runs.
HF_ATTENTION = "sdpa"
# How many of the costliest aten ops the profile prints per contestant.
PROFILED_OPS = 6

Prompts = list[list[int]]


def nothing() -> None:
    """The default call after a contestant's prefill."""


class Contestant(Protocol):
    def __call__(self, prompts: Prompts,
                 prefilled: Callable[[], None] = nothing) -> tuple[Prompts, list[float]]:
        """Generate the prompts' tokens; return them with each decode step's seconds. Calls
        `prefilled` once the prefill is done."""


class RunnerContestant:
    """ModelRunner over a private pool; each sequence holds the same scattered blocks every
    round (a round rewrites them)."""

    def __init__(self, backend: AttentionBackend, prompts: Prompts) -> None:
        model = load_hf_model()
        layers, kv_heads, head_dim, _ = kv_geometry(model)
        pool = torch.zeros(NUM_BLOCKS, layers, 2, BLOCK_SIZE, kv_heads, head_dim)
        self.runner = ModelRunner(model, pool, BLOCK_SIZE, backend)
        free = list(range(NUM_BLOCKS))
        random.Random(1).shuffle(free)
        self.tables = []
        for prompt in prompts:
            used = blocks_for(len(prompt) + NEW_TOKENS, BLOCK_SIZE)
            self.tables.append(free[:used])
            del free[:used]

    def slot(self, seq: int, position: int) -> int:
        table = self.tables[seq]
        return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def decode_chunk(self, seq: int, position: int, token: int) -> SequenceChunk:
        """Sequence `seq`'s token at `position`, to decode."""
        return SequenceChunk([token], position, [self.slot(seq, position)], self.tables[seq])

    def __call__(self, prompts: Prompts,
                 prefilled: Callable[[], None] = nothing) -> tuple[Prompts, list[float]]:
        chunks = [SequenceChunk(p, 0, [self.slot(s, i) for i in range(len(p))], self.tables[s])
                  for s, p in enumerate(prompts)]
        tokens = [[t] for t in self.runner.step(chunks).argmax(-1).tolist()]
        prefilled()
        seconds = []
        for step in range(1, NEW_TOKENS):
            chunks = [self.decode_chunk(s, len(p) + step - 1, out[-1])
                      for s, (p, out) in enumerate(zip(prompts, tokens, strict=True))]
            started = time.perf_counter()
            logits = self.runner.step(chunks)
            seconds.append(time.perf_counter() - started)
            for out, token in zip(tokens, logits.argmax(-1).tolist(), strict=True):
                out.append(token)
        return tokens, seconds


class HFContestant:
    """transformers' model with sdpa and a DynamicCache, stepped as generate's loop does."""

    def __init__(self) -> None:
        self.model = load_hf_model()

    @torch.inference_mode()
    def __call__(self, prompts: Prompts,
                 prefilled: Callable[[], None] = nothing) -> tuple[Prompts, list[float]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            cache=cache, use_cache=True, logits_to_keep=1).logits
        next_ids = logits[:, -1].argmax(-1)
        tokens = [[t] for t in next_ids.tolist()]
        last = positions[:, -1:]
        prefilled()
        seconds = []
        for _ in range(1, NEW_TOKENS):
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
            last = last + 1
            started = time.perf_counter()
            logits = self.model(input_ids=next_ids[:, None], attention_mask=mask,
                                position_ids=last, cache=cache, use_cache=True).logits
            seconds.append(time.perf_counter() - started)
            next_ids = logits[:, -1].argmax(-1)
            for out, token in zip(tokens, next_ids.tolist(), strict=True):
                out.append(token)
        return tokens, seconds


@contextmanager
def timed_attention(name: str, function: Callable[..., Any]) -> Iterator[list[float]]:
    """Register a wrapper of the attention `name` that adds up its seconds; restores it."""
    spent = [0.0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    AttentionInterface.register(name, wrapper)
    try:
        yield spent
    finally:
        AttentionInterface.register(name, function)


def attention_frac(contestant: Contestant, prompts: Prompts, name: str,
                   function: Callable[..., Any]) -> float:
    """Share of one generation's decode steps spent in attention `name` (the prefill's
    attention is dropped: the count restarts once the prefill is done)."""
    with timed_attention(name, function) as spent:
        _, seconds = contestant(prompts, lambda: spent.__setitem__(0, 0.0))
    return spent[0] / sum(seconds)


def op_profile(contestant: Contestant,
               prompts: Prompts) -> tuple[list[tuple[str, float]], float]:
    """The PROFILED_OPS aten ops with the most self CPU time over one generation's decode steps
    (the profiler starts once the prefill is done): (name, ms per step), costliest first; and
    the aten calls per step (nested ones included), a count the machine's load leaves alone."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    _, seconds = contestant(prompts, profiler.start)
    profiler.stop()
    events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    return [(e.key.removeprefix("aten::"), e.self_cpu_time_total / 1e3 / len(seconds))
            for e in events[:PROFILED_OPS]], calls / len(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="generations per contestant")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = make_prompts()
    runner, hf = RunnerContestant(get_backend("auto", "cpu"), prompts), HFContestant()
    contestants: dict[str, Contestant] = {"runner": runner, "hf": hf,
                                          "twin": RunnerContestant(TORCH_BACKEND, prompts)}
    steps: dict[str, list[float]] = {name: [] for name in contestants}
    tokens = {name: contestant(prompts)[0]  # untimed: warms every path once
              for name, contestant in contestants.items()}
    for _ in range(args.rounds):  # interleaved, so the machine's load hits both alike
        for name, contestant in contestants.items():
            steps[name] += contestant(prompts)[1]
    runner_ms, hf_ms, twin_ms = (statistics.median(steps[name]) * 1e3
                                 for name in ("runner", "hf", "twin"))
    runner_attention = attention_frac(runner, prompts, ATTENTION_NAME, paged_attention_forward)
    hf_attention = attention_frac(hf, prompts, HF_ATTENTION, sdpa_attention_forward)
    matches = sum(a == b for a, b in zip(tokens["runner"], tokens["hf"], strict=True))
    print(f"torch_threads: {torch.get_num_threads()} threads")
    print(f"decode_forward_ms: {runner_ms:.3f} ms")
    print(f"hf_decode_step_ms: {hf_ms:.3f} ms")
    print(f"decode_forward_vs_hf_step: {runner_ms / hf_ms:.3f} ratio")
    print(f"decode_forward_twin_ms: {twin_ms:.3f} ms")
    print(f"decode_forward_vs_twin: {runner_ms / twin_ms:.3f} ratio")
    print(f"decode_attention_frac: {runner_attention:.3f} ratio")
    print(f"hf_attention_frac: {hf_attention:.3f} ratio")
    print(f"decode_tokens_match_hf: {matches / len(prompts):.3f} ratio")
    for name in ("runner", "hf"):
        ops, calls = op_profile(contestants[name], prompts)
        print(f"{name}_aten_calls_per_step: {calls:.1f} calls")
        for op, ms in ops:
            print(f"{name}_op_ms_{op}: {ms:.3f} ms")
    return 0 if matches == len(prompts) and tokens["twin"] == tokens["runner"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
