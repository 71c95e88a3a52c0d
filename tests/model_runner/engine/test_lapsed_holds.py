"""No forward starts on a session whose hold may lapse before the forward ends
(`ForwardLoop._refuse_lapsed`): a runner that was stalled (SIGSTOP, a frozen cgroup) resumes
with its renewals late, and the daemon may be handing that session's blocks to someone else
once it has stopped this runner. Such steps fail alone; the others of the batch go on."""

import asyncio
import time

import pytest

from pagedkv.model_runner.engine.forward_loop import ForwardLoop, HoldMayHaveLapsed, Prepared
from pagedkv.model_runner.engine.sampling import Sampler
from pagedkv.model_runner.runner import SequenceChunk

HOLD_MS = 5000
DECODE = [(0, SequenceChunk([5], 3, [3], [0]))]


class NoForward:
    """A model runner that must not be asked for a forward."""

    def step(self, chunks: list[SequenceChunk]) -> None:
        raise AssertionError(f"a forward started over {len(chunks)} chunks")


def held(session_id: str, ago_s: float) -> Prepared:
    """A step whose session the runner last asked to hold `ago_s` seconds ago."""
    since = time.monotonic() - ago_s
    return Prepared(session_id, [], [], DECODE, held_since=lambda: since)


async def test_a_step_whose_hold_may_lapse_fails_alone_and_the_rest_goes_on() -> None:
    loop = ForwardLoop(NoForward, Sampler(), hold_ms=HOLD_MS)  # type: ignore[arg-type]
    stalled, fresh, unheld = held("A", 4.9), held("B", 0.1), Prepared("C", [], [], DECODE)
    batch = [(stalled, DECODE), (fresh, DECODE), (unheld, DECODE)]
    # The last forward took 0.2 s: A's hold (4.9 s old of 5 s) may end within the next one.
    kept = loop._refuse_lapsed(batch, forward_s=0.2)
    assert [prepared.session_id for prepared, _ in kept] == ["B", "C"]
    with pytest.raises(HoldMayHaveLapsed, match="forward not started"):
        await stalled.done
    # With short forwards A still has time: nothing refused.
    stalled = held("A", 4.5)
    assert len(loop._refuse_lapsed([(stalled, DECODE)], forward_s=0.1)) == 1


async def test_a_forward_of_lapsed_steps_only_is_never_launched() -> None:
    loop = ForwardLoop(NoForward, Sampler(), hold_ms=HOLD_MS)  # type: ignore[arg-type]
    await loop.start()
    try:
        with pytest.raises(HoldMayHaveLapsed):
            await asyncio.wait_for(loop.compute(held("A", 60.0)), 10)
    finally:
        await loop.stop()


async def test_without_a_hold_length_nothing_is_checked() -> None:
    loop = ForwardLoop(NoForward, Sampler())  # type: ignore[arg-type]
    stalled = held("A", 60.0)
    assert loop._refuse_lapsed([(stalled, DECODE)], forward_s=1.0) == [(stalled, DECODE)]
