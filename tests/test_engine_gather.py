"""The runner's forward waits briefly for the clients of its last forward (`ForwardLoop._gather`),
so concurrent clients share forwards instead of alternating two half batches."""

import asyncio

from pagedkv.model_runner.engine.forward_loop import ForwardLoop, Prepared
from pagedkv.model_runner.engine.sampling import Sampler


def prepared(session_id: str) -> Prepared:
    return Prepared(session_id, [], [], [])


def engine() -> ForwardLoop:
    # _gather reads only the ready queue and the wake-up event: no model needed.
    return ForwardLoop(lambda: None, Sampler())  # type: ignore[arg-type,return-value]


async def test_a_forward_waits_for_the_last_forwards_sessions_then_goes() -> None:
    """C is ready; A and B were in the last forward. A comes back, then B: the gather returns
    as soon as both are ready, well before its window."""
    loop = asyncio.get_running_loop()
    waiting = engine()
    waiting._ready.append(prepared("C"))

    async def arrive(session_id: str, after: float) -> None:
        await asyncio.sleep(after)
        waiting._ready.append(prepared(session_id))
        waiting._wake.set()

    arrivals = [asyncio.create_task(arrive("A", 0.01)), asyncio.create_task(arrive("B", 0.02))]
    began = loop.time()
    await waiting._gather({"A", "B"}, window=30.0)
    assert loop.time() - began < 30.0
    assert [p.session_id for p in waiting._ready] == ["C", "A", "B"]
    await asyncio.gather(*arrivals)


async def test_a_session_that_does_not_come_back_costs_at_most_the_window() -> None:
    loop = asyncio.get_running_loop()
    waiting = engine()
    waiting._ready.append(prepared("C"))
    began = loop.time()
    await waiting._gather({"A"}, window=0.05)
    assert loop.time() - began >= 0.05
    assert [p.session_id for p in waiting._ready] == ["C"]


async def test_nothing_to_wait_for_returns_at_once() -> None:
    waiting = engine()
    waiting._ready.append(prepared("A"))
    await asyncio.wait_for(waiting._gather({"A"}, window=30.0), timeout=1.0)
