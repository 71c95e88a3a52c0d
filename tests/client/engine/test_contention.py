"""The engine when another client holds the pool, with a scripted runner (no daemon, no model):
a request whose steps find the pool full twice in a row is preempted and waits for the blocks,
even when it runs alone; one not admitted yet waits; one that could never fit the pool fails."""

import asyncio
from collections.abc import Sequence

import pytest

from pagedkv.client import (
    PoolExhausted,
    SamplingParams,
    SeqStep,
    StepOutputs,
)

from scripted_engine import BS, ScriptedRunner, engine


async def test_a_request_alone_in_a_full_pool_is_preempted_and_finishes_later() -> None:
    """Its prefill goes through; its first two decodes find the pool full (another client):
    it is preempted (a release-only step), re-admitted from its tokens, and finishes."""
    runner = ScriptedRunner(full={2, 3})
    generating = engine(runner)
    output = await generating.generate(list(range(20)), SamplingParams(temperature=0,
                                                                       max_tokens=4))
    await generating.close()
    assert output.num_preemptions == 1
    assert list(output.outputs[0].token_ids) == [7, 7, 7, 7]


async def test_an_admission_that_finds_the_pool_full_waits() -> None:
    runner = ScriptedRunner(full={1, 2, 3})
    generating = engine(runner)
    output = await generating.generate([1] * 20, SamplingParams(temperature=0, max_tokens=2))
    await generating.close()
    assert (output.num_preemptions, list(output.outputs[0].token_ids)) == (0, [7, 7])
    assert runner.calls == 6  # three refused, the prefill, a decode, the release


async def test_a_request_larger_than_the_pool_fails() -> None:
    generating = engine(ScriptedRunner(full=set()))
    with pytest.raises(PoolExhausted, match="needs 9 blocks; the pool has 8"):
        await generating.generate([1] * 9 * BS, SamplingParams(max_tokens=1))
    await generating.close()


class SteppingRunner(ScriptedRunner):
    """A ScriptedRunner whose steps take a moment, as a real runner's do."""

    async def step(self, session: object, seqs: Sequence[SeqStep],
                   release: Sequence[int] = (), *, follow: bool = False) -> StepOutputs:
        await asyncio.sleep(0.001)
        return await super().step(session, seqs, release, follow=follow)


async def test_close_releases_the_running_sequences_through_the_runner() -> None:
    """A request still generating when the engine closes: its sequences are released by a
    last runner step (which the runner answers after any forward it still runs for the
    session, such as one decoded ahead) before the session closes."""
    runner = SteppingRunner(full=set())
    generating = engine(runner)
    task = asyncio.create_task(generating.generate([1] * 20, SamplingParams(max_tokens=1000)))
    while runner.calls < 3:
        await asyncio.sleep(0.001)
    assert runner.held
    await generating.close()
    assert runner.held == {}
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_prompt_outside_the_vocabulary_is_refused_before_any_step() -> None:
    runner = ScriptedRunner(full=set())
    generating = engine(runner)
    with pytest.raises(ValueError, match=r"^prompt token ids must be in \[0, 100\) \(the model's "
                                         r"vocabulary\), got \[100, -1\]$"):
        await generating.generate([1, 100, -1], SamplingParams(max_tokens=1))
    await generating.close()
    assert runner.calls == 0
