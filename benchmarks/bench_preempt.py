"""Preemption end to end: one trace on a pool too small for it, recomputing preempted requests
or restoring them from a host tier, and on one large enough, side by side (three real pagedkvd
+ runner pairs, benchmarks/e2e.py).

The trace: ShareGPT-like lengths (input ~161, output ~338 tokens, each request within
MAX_MODEL_LEN), every request submitted at once, greedy, exactly its output length. On the small
pool the engine admits by free blocks and, when running sequences outgrow the pool, preempts the
newest request (frees its blocks) and re-admits it with its tokens once blocks are free again.
Without a host tier its blocks that the pool evicted meanwhile are recomputed; with one
(`--host-tier-memory` of TIER_FACTOR x the small pool's blocks, kvpool.proto's "The host-memory
tier") the daemon copied them to host memory as it evicted them and restores them at the
re-admission, so only its last partial block is computed again. The three pools are up at once;
runs alternate between them (the order rotating), one round each per --rounds.

Computed tokens are the runner's own count (prefill + decode, /metrics). The large pool computes
exactly what the trace needs (each prompt once, one token per generated token but the last);
what the small pool computes beyond that is recomputation of preempted sequences.

Figures (medians over rounds): preempt_tok_s and preempt_baseline_tok_s (generated tokens per
second), preempt_tok_s_ratio (small / large), preempt_recomputed_frac (recomputed tokens /
all tokens the small pool computed), preempt_num_preemptions; with the host tier:
preempt_swap_tok_s, preempt_swap_tok_s_ratio (small with the tier / small without: what
swapping gains over recompute), preempt_swap_recomputed_frac, preempt_swap_num_preemptions,
preempt_swap_stored_blocks and preempt_swap_restored_blocks (the daemon's
pagedkv:host_tier_stores and _restores during a run). The host-tier pair also runs the trace
with `SchedulerConfig(swap="never")`: the tier still takes every evicted committed block, but
re-admissions recompute, so it separates what the copies to the tier cost from what restoring
gains: preempt_swap_never_tok_s, preempt_swap_never_ratio (never / small without a tier),
preempt_swap_vs_never_ratio (restoring / recomputing on the same daemon),
preempt_swap_never_recomputed_frac, preempt_swap_never_restored_blocks (0 expected).
{preempt,preempt_swap,preempt_swap_never,baseline}_steps and _step_ms: engine steps of a run,
mean time between them.
`--trace alpaca` runs short requests (input ~19, output ~58 tokens: a few committed blocks each)
on a pool scaled to the trace, where there is little to restore.
Usage: python benchmarks/bench_preempt.py [--requests 48] [--rounds 2] [--trace sharegpt]
       [--preset tiny-llama] [--small-blocks N] [--quick]
"""

import argparse
import asyncio
import statistics

from bench_host_tier import RESTORES, STORES, host_tier_args
from e2e import (
    PRESET,
    VOCAB,
    Job,
    Stack,
    TraceRun,
    add_quick_flag,
    figure,
    greedy,
    jobs_from_trace,
    run_trace,
    serving,
)

from pagedkv.client.engine.scheduler import SchedulerConfig

from traces import ALPACA, SHAREGPT, make_trace

MAX_MODEL_LEN = 1024
# The trace's sequences at full length need ~1,500 blocks together; the small pool holds a
# quarter of that, the large one all of it.
SMALL_BLOCKS, LARGE_BLOCKS = 384, 4096
# No watermark: the small pool's preemptions come from growth alone, not from admission slack.
CONFIG = SchedulerConfig(watermark=0.0)
# The same, recomputing what the host tier holds (the tier still takes the pool's evictions).
NEVER = SchedulerConfig(watermark=0.0, swap="never")
# The host tier holds this many times the small pool's blocks.
TIER_FACTOR = 3
# Alpaca's requests need about a sixth of ShareGPT's blocks: the pools shrink with them.
ALPACA_SMALL_BLOCKS, ALPACA_REQUESTS = 64, 96


def run_counting(stack: Stack, jobs: list[Job],
                 config: SchedulerConfig) -> tuple[TraceRun, tuple[int, int]]:
    """The trace on `stack`, and the blocks its daemon copied to its host tier and restored from
    it meanwhile."""
    before = [stack.daemon_metric(name) for name in (STORES, RESTORES)]
    run = asyncio.run(run_trace(stack, jobs, config))
    stored, restored = (round(stack.daemon_metric(name) - count)
                        for name, count in zip((STORES, RESTORES), before, strict=True))
    return run, (stored, restored)


def step_ms(run: TraceRun) -> float:
    """Mean time between the engine's steps."""
    times = [record.time_s for record in run.records]
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trace", choices=("sharegpt", "alpaca"), default="sharegpt")
    parser.add_argument("--preset", default=PRESET,
                        help="the model (a preset: small-llama's forward costs ~100x "
                             "tiny-llama's per token, its blocks 8x the bytes)")
    parser.add_argument("--small-blocks", type=int, help="the small pools' blocks (default: "
                        f"{SMALL_BLOCKS}, {ALPACA_SMALL_BLOCKS} for alpaca)")
    add_quick_flag(parser)
    args = parser.parse_args()
    spec, requests, small_blocks = SHAREGPT, args.requests, SMALL_BLOCKS
    if args.trace == "alpaca":
        spec, requests, small_blocks = ALPACA, ALPACA_REQUESTS, ALPACA_SMALL_BLOCKS
    small_blocks = args.small_blocks or small_blocks
    max_model_len, rounds = MAX_MODEL_LEN, args.rounds
    if args.quick:  # one sequence at most 256 tokens (16 blocks), the small pool 24 blocks
        requests, max_model_len, small_blocks, rounds = 6, 256, 24, 1
    jobs = jobs_from_trace(make_trace(spec, requests, max_model_len, VOCAB), greedy)
    runs: dict[str, list[TraceRun]] = {"small": [], "swap": [], "never": [], "large": []}
    copied: dict[str, list[tuple[int, int]]] = {name: [] for name in runs}
    preset = args.preset
    with serving(small_blocks, preset=preset) as small, \
            serving(LARGE_BLOCKS, preset=preset) as large, \
            serving(small_blocks, *host_tier_args(small, TIER_FACTOR * small_blocks),
                    preset=preset) as swap:
        sides = {"small": (small, CONFIG), "swap": (swap, CONFIG), "never": (swap, NEVER),
                 "large": (large, CONFIG)}
        for index in range(rounds):
            order = list(sides)[index % 4:] + list(sides)[:index % 4]
            for name in order:
                stack, config = sides[name]
                run, blocks = run_counting(stack, jobs, config)
                runs[name].append(run)
                copied[name].append(blocks)
    assert all(run.num_preemptions == 0 for run in runs["large"]), \
        "the large pool preempted: make it larger"
    report(runs, copied)


def report(runs: dict[str, list[TraceRun]],
           copied: dict[str, list[tuple[int, int]]]) -> None:
    """The figures, medians over rounds; a round's recomputed tokens are what its small pool
    computed beyond the large pool's run of the same round."""
    tok_s = {name: statistics.median(run.tok_s for run in kind) for name, kind in runs.items()}

    def recomputed(name: str) -> float:
        return statistics.median((run.computed_tokens - roomy.computed_tokens)
                                 / run.computed_tokens
                                 for run, roomy in zip(runs[name], runs["large"], strict=True))

    def preemptions(name: str) -> float:
        return statistics.median(run.num_preemptions for run in runs[name])

    figure("preempt_tok_s", tok_s["small"], "tok/s", 1)
    figure("preempt_baseline_tok_s", tok_s["large"], "tok/s", 1)
    figure("preempt_tok_s_ratio", tok_s["small"] / tok_s["large"], "ratio", 2)
    figure("preempt_recomputed_frac", recomputed("small"), "fraction")
    figure("preempt_num_preemptions", preemptions("small"), "preemptions", 0)
    figure("preempt_swap_tok_s", tok_s["swap"], "tok/s", 1)
    figure("preempt_swap_tok_s_ratio", tok_s["swap"] / tok_s["small"], "ratio", 2)
    figure("preempt_swap_vs_baseline_ratio", tok_s["swap"] / tok_s["large"], "ratio", 2)
    figure("preempt_swap_recomputed_frac", recomputed("swap"), "fraction")
    figure("preempt_swap_num_preemptions", preemptions("swap"), "preemptions", 0)
    figure("preempt_swap_stored_blocks", statistics.median(c[0] for c in copied["swap"]),
           "blocks", 0)
    figure("preempt_swap_restored_blocks", statistics.median(c[1] for c in copied["swap"]),
           "blocks", 0)
    figure("preempt_swap_never_tok_s", tok_s["never"], "tok/s", 1)
    figure("preempt_swap_never_ratio", tok_s["never"] / tok_s["small"], "ratio", 2)
    figure("preempt_swap_vs_never_ratio", tok_s["swap"] / tok_s["never"], "ratio", 2)
    figure("preempt_swap_never_recomputed_frac", recomputed("never"), "fraction")
    figure("preempt_swap_never_restored_blocks",
           statistics.median(c[1] for c in copied["never"]), "blocks", 0)
    for name, label in (("small", "preempt"), ("swap", "preempt_swap"),
                        ("never", "preempt_swap_never"), ("large", "baseline")):
        figure(f"{label}_steps", statistics.median(len(run.records) for run in runs[name]),
               "steps", 0)
        figure(f"{label}_step_ms", statistics.median(step_ms(run) for run in runs[name]), "ms")


if __name__ == "__main__":
    main()
