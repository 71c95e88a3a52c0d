"""The client engine's own time per step with 256 running sequences (real pagedkvd and runner,
benchmarks/e2e.py).

NUM_SEQS requests of PROMPT_TOKENS random tokens, each generating OUTPUT_TOKENS greedily, all
submitted at once with max_num_seqs = NUM_SEQS: after a few prefill steps every sequence decodes
in every step until they finish together. StepRecord.schedule_s is the engine's time on a step
outside the runner call: planning it, and applying and publishing its answers. Only the steps
that decode all NUM_SEQS sequences are counted.

Figures: sched_ms_per_step_256 (median; vLLM's whole scheduler step is about 2-2.5 ms),
sched_ms_per_step_256_p90, sched_step_ms_256 (median wall time from one step's record to the
next: the runner's forward on this CPU dominates it), sched_frac_of_step (the two medians'
ratio). --profile prints where the client's time went (cProfile, top 25 by own time).
Usage: python benchmarks/bench_scheduler.py [--rounds 3] [--profile] [--quick]
"""

import argparse
import asyncio
import cProfile
import itertools
import pstats
import statistics

import numpy as np
from e2e import VOCAB, Job, Stack, TraceRun, add_quick_flag, figure, run_trace, serving

from pagedkv.client import SamplingParams
from pagedkv.client.engine.scheduler import SchedulerConfig

NUM_SEQS = 256
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 48
NUM_BLOCKS = 4096


def jobs(num_seqs: int, output_tokens: int) -> list[Job]:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens)
    return [Job(rng.integers(0, VOCAB, PROMPT_TOKENS).tolist(), params) for _ in range(num_seqs)]


def full_steps(run: TraceRun, num_seqs: int) -> tuple[list[float], list[float]]:
    """(schedule_s, wall s since the previous record) of the steps decoding every sequence."""
    records = run.records
    return ([r.schedule_s for r in records if r.num_sampled == r.num_seqs == num_seqs],
            [b.time_s - a.time_s for a, b in itertools.pairwise(records)
             if b.num_sampled == b.num_seqs == num_seqs])


def one_run(stack: Stack, todo: list[Job], num_seqs: int,
            profiler: cProfile.Profile | None) -> TraceRun:
    config = SchedulerConfig(max_num_seqs=num_seqs)
    if profiler is None:
        return asyncio.run(run_trace(stack, todo, config))
    profiler.enable()
    try:
        return asyncio.run(run_trace(stack, todo, config))
    finally:
        profiler.disable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    add_quick_flag(parser)
    args = parser.parse_args()
    num_seqs, output_tokens, rounds = NUM_SEQS, OUTPUT_TOKENS, args.rounds
    if args.quick:
        num_seqs, output_tokens, rounds = 16, 8, 1
    profiler = cProfile.Profile() if args.profile else None
    schedule, wall = [], []
    with serving(NUM_BLOCKS) as stack:
        for _ in range(rounds):
            run = one_run(stack, jobs(num_seqs, output_tokens), num_seqs, profiler)
            steps = full_steps(run, num_seqs)
            schedule += steps[0]
            wall += steps[1]
    suffix = "" if num_seqs == NUM_SEQS else f"_quick{num_seqs}"
    figure(f"sched_ms_per_step_256{suffix}", statistics.median(schedule) * 1e3, "ms")
    figure(f"sched_ms_per_step_256_p90{suffix}", float(np.percentile(schedule, 90)) * 1e3, "ms")
    figure(f"sched_step_ms_256{suffix}", statistics.median(wall) * 1e3, "ms", 1)
    figure(f"sched_frac_of_step{suffix}", statistics.median(schedule) / statistics.median(wall),
           "fraction")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
