"""Swap on preemption end to end: the engine on a pool too small for its requests, with a host
tier and without, side by side (real pagedkvd + runner pairs, benchmarks/e2e.py).

Ten greedy requests growing from 48 to 79 tokens (5 blocks of 16 each, 50 in all) in a pool of
44 blocks: every one is admitted, they outgrow the pool, and the newest are preempted and
re-admitted. Without a tier a re-admitted request recomputes what the pool evicted meanwhile;
with one its committed blocks come back from the host tier, so the runner computes fewer tokens
for the same outputs.
"""

import numpy as np
from e2e import VOCAB, Job, Stack, run_trace, serving

from pagedkv.client import SamplingParams
from pagedkv.client.engine.scheduler import SchedulerConfig

NUM_BLOCKS = 44


def jobs() -> list[Job]:
    rng = np.random.default_rng(2)
    return [Job(rng.integers(0, VOCAB, 48).tolist(), SamplingParams(temperature=0.0,
                                                                    max_tokens=32))
            for _ in range(10)]


async def run(stack: Stack, swap: str) -> tuple[list[list[int]], int, int]:
    """Each request's tokens, the tokens the runner computed, and the preemptions."""
    result = await run_trace(stack, jobs(), SchedulerConfig(watermark=0.0, swap=swap))
    tokens = [list(output.outputs[0].token_ids) for output in result.outputs]
    return tokens, result.computed_tokens, result.num_preemptions


async def test_a_preempted_request_comes_back_from_the_host_tier_with_the_same_tokens() -> None:
    with serving(NUM_BLOCKS) as plain, serving(NUM_BLOCKS, "--host-tier-memory", "16MiB") as tiered:
        alone, recomputing, preempted = await run(plain, "auto")
        swapped, restoring, preempted_too = await run(tiered, "always")
        restored_blocks = tiered.daemon_metric("pagedkv:host_tier_restores_total")
        never, recomputing_too, _ = await run(tiered, "never")
    assert preempted and preempted_too  # the pool was too small both times
    assert restored_blocks > 0  # the swapping run took blocks back from the host tier
    assert swapped == alone == never  # the same tokens whichever way K/V came back
    needed = sum(len(job.prompt) + job.params.max_tokens - 1 for job in jobs())
    assert recomputing > needed and recomputing_too > needed  # recomputation happened
    assert restoring < recomputing and restoring < recomputing_too  # restores replaced it
