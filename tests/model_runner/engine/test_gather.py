"""The runner's forward waits briefly for the clients of its last forward (`ForwardLoop._gather`),
so concurrent clients share forwards instead of alternating two half batches."""

import asyncio

from prometheus_client.registry import CollectorRegistry

from pagedkv.model_runner.engine.forward_loop import ForwardLoop, Prepared
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.sampling import Sampler
from pagedkv.model_runner.runner import SequenceChunk


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


async def test_a_decode_forward_is_idle_wait_only_if_a_step_was_ready_after_the_thread_freed(
        ) -> None:
    """pagedkv_runner:decode_forwards: idle_wait when a step of the forward that made a daemon
    call became ready after the previous forward ended (the thread sat idle for it), queued
    when all were waiting, or the late one made no daemon call (inside its reservations)."""
    registry = CollectorRegistry()
    loop = ForwardLoop(lambda: None, Sampler(),  # type: ignore[arg-type,return-value]
                       metrics=RunnerMetrics(registry))
    decode = [(0, SequenceChunk([5], 3, [3], [0]))]

    def observe(ready_at: tuple[float, ...], free_at: float, called: bool = True) -> None:
        batch = [(Prepared("s", [], [], [], ready_at=at, daemon_call=called), decode)
                 for at in ready_at]
        loop._observe(batch, started=20.0, free_at=free_at)

    observe((1.0, 2.0), free_at=5.0)    # both ready before the thread came free
    observe((1.0, 6.0), free_at=5.0)    # one became ready after: the thread idled for it
    observe((1.0, 6.0), free_at=5.0, called=False)  # later, but no daemon answer to wait for
    prefill = [(Prepared("s", [], [], [], ready_at=9.0),
                [(0, SequenceChunk([5, 6], 0, [0, 1], [0]))])]
    loop._observe(prefill, started=20.0, free_at=5.0)   # not decode-only: not counted

    def count(start: str) -> float | None:
        return registry.get_sample_value("pagedkv_runner:decode_forwards_total",
                                         {"start": start})

    assert (count("queued"), count("idle_wait")) == (2.0, 1.0)
