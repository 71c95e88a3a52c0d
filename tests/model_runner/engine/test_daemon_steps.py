"""The runner's daemon Steps (`DaemonSteps`): Steps made together go as one StepMany, each entry
succeeding or failing alone; over a real daemon (in-process, production gRPC server) and the
bundled client. Pool: 256 blocks of 4 slots; fresh blocks come out in id order."""

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pagedkv.client import OutcomeUnknown, PoolClient, SequenceNotFound, Session, Step
from pagedkv.model_runner.engine.daemon_steps import MAX_STEP_ENTRIES, DaemonSteps
from pagedkv.model_runner.engine.metrics import RunnerMetrics

from daemon_harness import Daemon, running_daemon


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=256, block_size=4) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def pool(daemon: Daemon) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target) as client:
        yield client


class Calls:
    """What the runner's metrics and the daemon's say about the calls made."""

    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        self.metrics = RunnerMetrics(self.registry)
        self.daemon = daemon

    def entries(self) -> tuple[float | None, float | None]:
        """(StepMany calls, entries in them), per the runner's histogram."""
        name = "pagedkv_runner:steps_per_daemon_call"
        return (self.registry.get_sample_value(f"{name}_count"),
                self.registry.get_sample_value(f"{name}_sum"))

    def daemon_calls(self, method: str) -> float:
        """Calls of `method` the daemon answered, per its RPC histogram."""
        return self.daemon.registry.get_sample_value(
            "pagedkv:rpc_duration_seconds_count",
            {"service": "pagedkv.v1.KVPool", "method": method}) or 0.0

    def stream_messages(self) -> float:
        """StepStream messages the daemon answered (the client's StepMany calls)."""
        return self.daemon.registry.get_sample_value(
            "pagedkv:stream_message_duration_seconds_count",
            {"service": "pagedkv.v1.KVPool", "method": "StepStream"}) or 0.0


async def session_with(pool: PoolClient, *seq_ids: int) -> Session:
    session = await pool.open_session("runner-test")
    for seq_id in seq_ids:
        await session.allocate(seq_id, token_ids=[seq_id % 1000])
    return session


def step(*seq_ids: int) -> Step:
    return Step(list(seq_ids), [7] * len(seq_ids))


async def test_steps_made_together_share_one_call(daemon: Daemon, pool: PoolClient) -> None:
    calls = Calls(daemon)
    steps = DaemonSteps(pool, calls.metrics)
    alice, bob = await session_with(pool, 1), await session_with(pool, 1, 2)
    answers = await asyncio.gather(steps.step(alice, step(1)), steps.step(bob, step(1, 2)),
                                   steps.step(bob, step(9)), return_exceptions=True)
    # Blocks 0-2 hold the three prompts; each sequence's second token lands in its block.
    assert [list(a.slot_mapping) for a in answers[:2]] == [[1], [5, 9]]  # type: ignore[union-attr]
    assert isinstance(answers[2], SequenceNotFound) and "[9]" in str(answers[2])
    assert calls.entries() == (1, 3)
    assert calls.stream_messages() == 1  # one StepMany, a message on the client's stream
    assert calls.daemon_calls("StepMany") == 0 and calls.daemon_calls("Step") == 0
    # A lone Step leaves at once, in a call of its own.
    answer = await steps.step(alice, step(1))
    assert list(answer.slot_mapping) == [2]
    assert calls.entries() == (2, 4)


async def test_a_burst_larger_than_one_call_is_split(daemon: Daemon, pool: PoolClient) -> None:
    calls = Calls(daemon)
    steps = DaemonSteps(pool, calls.metrics)
    count = MAX_STEP_ENTRIES + 1
    session = await session_with(pool, *range(count))
    answers = await asyncio.gather(*(steps.step(session, step(s)) for s in range(count)))
    # Sequence s holds block s; its second token is slot 4 s + 1.
    assert [list(a.slot_mapping) for a in answers] == [[4 * s + 1] for s in range(count)]
    assert calls.entries() == (2, count)


async def test_a_step_cancelled_before_the_call_is_left_out(daemon: Daemon,
                                                           pool: PoolClient) -> None:
    calls = Calls(daemon)
    steps = DaemonSteps(pool, calls.metrics)
    session = await session_with(pool, 1, 2)
    cancelled = asyncio.create_task(steps.step(session, step(1)))
    kept = asyncio.create_task(steps.step(session, step(2)))
    await asyncio.sleep(0)  # both queued; the call has not left
    cancelled.cancel()
    assert list((await kept).num_tokens) == [2]
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert [t.num_tokens for t in await session.block_tables([1, 2])] == [1, 2]
    assert calls.entries() == (1, 1)


async def test_a_call_without_answer_fails_every_entry() -> None:
    """No daemon at the target: every entry gets the call's OutcomeUnknown."""
    async with grpc.aio.insecure_channel("unix:///nonexistent/pagedkv.sock") as channel:
        pool = PoolClient(channel, timeout=0.5)
        steps = DaemonSteps(pool)
        answers = await asyncio.gather(
            steps.step(pool.attach("a", 4), Step([1])),
            steps.step(pool.attach("b", 4), Step([1])), return_exceptions=True)
    assert all(isinstance(a, OutcomeUnknown) for a in answers), answers


async def test_a_sender_cancelled_before_the_call_cancels_its_steps(daemon: Daemon,
                                                                   pool: PoolClient) -> None:
    """The event loop stopping while a burst gathers: its callers are cancelled, nothing is
    sent, and the next Step starts a sender of its own."""
    calls = Calls(daemon)
    steps = DaemonSteps(pool, calls.metrics)
    session = await session_with(pool, 1)
    waiting = asyncio.create_task(steps.step(session, step(1)))
    await asyncio.sleep(0)  # queued, its sender created but not run
    sender = steps._sender
    assert sender is not None
    sender.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (await session.block_tables([1]))[0].num_tokens == 1
    assert list((await steps.step(session, step(1))).num_tokens) == [2]
    assert calls.entries() == (1, 1)
