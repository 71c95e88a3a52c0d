"""The end-to-end benchmarks' shared module (benchmarks/e2e.py) on tiny traces: a real pagedkvd
and runner, and the invariants the figures rest on (tokens counted exactly, sharing saved in
[0, 1), recomputation only under preemption, paged concurrency at least the contiguous one)."""

from collections.abc import Iterator

import numpy as np
import pytest
from bench_e2e_concurrency import contiguous_args, contiguous_config
from e2e import VOCAB, Job, Stack, greedy, jobs_from_trace, run_trace, serving

from pagedkv.client import SamplingParams
from pagedkv.client.engine.scheduler import SchedulerConfig

from traces import TraceSpec, make_trace

# 64 blocks of 16; a contiguous pool of the same size reserving 128 tokens a sequence holds 8.
NUM_BLOCKS = 64
MAX_MODEL_LEN = 128
# Twelve requests of at most 3 blocks each: all of them fit in the paged pool at once.
SMALL = TraceSpec("small", 12.0, 10.0)


@pytest.fixture(scope="module")
def paged() -> Iterator[Stack]:
    with serving(NUM_BLOCKS) as stack:
        yield stack


def needed_tokens(jobs: list[Job]) -> int:
    """What generating the jobs computes without preemption: each prompt once, then one token
    per generated token but the last (which is never appended)."""
    return sum(len(job.prompt) + job.params.max_tokens - 1 for job in jobs)


async def test_tokens_are_counted_exactly_and_nothing_is_recomputed(paged: Stack) -> None:
    jobs = jobs_from_trace(make_trace(SMALL, 12, 48, VOCAB), greedy, rate_per_s=200.0)
    run = await run_trace(paged, jobs)
    assert run.generated_tokens == sum(job.params.max_tokens for job in jobs)
    assert run.num_preemptions == 0
    assert run.computed_tokens == needed_tokens(jobs)
    assert 1 <= run.peak_batch <= len(jobs)
    assert run.tok_s > 0 and len(run.records) >= max(job.params.max_tokens for job in jobs)


async def test_parallel_samples_save_a_fraction_in_0_1(paged: Stack) -> None:
    prompt = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    run = await run_trace(paged, [Job(prompt, SamplingParams(temperature=1.0, n=2, seed=1,
                                                             max_tokens=8))],
                          sample_sharing=True)
    assert run.saved and all(0 <= s < 1 for s in run.saved)
    assert run.mean_saved > 0  # the prompt's two full blocks are held once


async def test_a_pool_too_small_preempts_and_recomputes(paged: Stack) -> None:
    """Ten requests growing to 111 tokens (7 blocks each, 70 in all) in the pool's 64 blocks:
    all are admitted by their prompts, outgrow the pool, and what is recomputed is counted."""
    rng = np.random.default_rng(2)
    jobs = [Job(rng.integers(0, VOCAB, 48).tolist(), SamplingParams(temperature=0.0,
                                                                    max_tokens=64))
            for _ in range(10)]
    run = await run_trace(paged, jobs, SchedulerConfig(watermark=0.0))
    assert run.num_preemptions > 0
    recomputed = run.computed_tokens - needed_tokens(jobs)
    assert 0 < recomputed < run.computed_tokens


async def test_paged_runs_at_least_as_many_sequences_as_contiguous(paged: Stack) -> None:
    jobs = jobs_from_trace(make_trace(SMALL, 12, MAX_MODEL_LEN, VOCAB), greedy)
    with serving(NUM_BLOCKS, *contiguous_args(MAX_MODEL_LEN)) as contiguous:
        reserving = await run_trace(contiguous, jobs, contiguous_config())
    paging = await run_trace(paged, jobs)
    assert reserving.peak_batch == NUM_BLOCKS * 16 // MAX_MODEL_LEN  # reservations fill it
    assert paging.peak_batch >= reserving.peak_batch
    assert reserving.generated_tokens == paging.generated_tokens
