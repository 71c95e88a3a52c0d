"""Runner holds (issue 17, finding 4): while a runner may still write a session's blocks, no
caller but a runner frees them.

A client sends the runner a step, then frees its sequences (or closes its session) directly in
the daemon while that step's forward is queued or running: freed at once, the blocks would go to
another session, and the forward would write into its K/V. A runner's call carries hold_ms; until
the hold ends (end_hold, or its deadline) a public caller's Free, CloseSession or Batch free is
SessionBusy with nothing changed, and the lease does not expire the session. An in-process daemon
served by the production `grpc_server`, its runner socket included; its clock is the test's, so
holds and leases end when the test says, not by wall-clock time.
"""

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from pagedkv.client import (
    Allocate,
    Free,
    InvalidArgument,
    PagedKVError,
    PoolClient,
    Session,
    SessionBusy,
    Step,
    StepResult,
)
from pagedkv.client.pool.errors import error_from_rpc
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import Daemon, running_daemon
from hand_clock import HandClock

HOLD_MS = 5000
LEASE_MS = 1000




@pytest.fixture
async def daemon(clock: HandClock) -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=16, block_size=4, clock=clock) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def runner(daemon: Daemon) -> AsyncIterator[PoolClient]:
    """A client of the runner socket: what the runner's calls come from."""
    async with await PoolClient.connect(daemon.runners_target) as connected:
        yield connected


@pytest.fixture
async def app(client: PoolClient) -> AsyncIterator[Session]:
    """A tenant's session holding sequences 1 and 2 (5 tokens each: two blocks)."""
    session = await client.open_session("tenant-app", lease_ttl_ms=LEASE_MS, keep_alive=False)
    await session.allocate(1, token_ids=[1, 2, 3, 4, 5])
    await session.allocate(2, token_ids=[6, 7, 8, 9, 10])
    yield session


def as_runner(runner: PoolClient, session: Session) -> Session:
    """The session as the runner reaches it: a handle on the client's session id."""
    return runner.attach(session.session_id, session.block_size)


async def runner_step(runner: PoolClient, session: Session, hold_ms: int) -> StepResult:
    """The runner's decode Step of sequence 1, holding the session for its forward."""
    return await as_runner(runner, session).step([1], [11], hold_ms=hold_ms)


async def keep_alive(runner: PoolClient, session: Session, *, hold_ms: int = 0,
                     end_hold: bool = False) -> None:
    await as_runner(runner, session).keep_alive(hold_ms=hold_ms, end_hold=end_hold)


async def raw_close(target: str, session: Session) -> PagedKVError:
    """A CloseSession sent once (the bundled close waits out a hold): the error it got."""
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kvpool_pb2_grpc.KVPoolStub(channel).CloseSession(
                pb.CloseSessionRequest(session_id=session.session_id))
    return error_from_rpc(refused.value)


async def refusals(daemon: Daemon, client: PoolClient, session: Session) -> None:
    """Every way a public caller frees memory is SessionBusy, and nothing changes."""
    before = daemon.pool.stats()
    tables = await session.block_tables([1, 2])
    busy = r"(Free|Batch|CloseSession) refused: a runner holds session tenant-app#\d+ for " \
           r"\d+ ms more .*release the sequences through the runner"
    with pytest.raises(SessionBusy, match=busy) as refused:
        await session.free(1)
    assert session.session_id not in refused.value.message  # the id is a credential
    with pytest.raises(SessionBusy, match=busy):
        await session.batch([Allocate(3, token_ids=[1]), Free(2)])
    closed = await raw_close(daemon.unix_target, session)
    assert isinstance(closed, SessionBusy) and re.search(busy, closed.message)
    # On the wire: FAILED_PRECONDITION with the cause in the trailing metadata.
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await kvpool_pb2_grpc.KVPoolStub(channel).Free(
                pb.FreeRequest(session_id=session.session_id, seq_id=2))
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(raw.value.trailing_metadata() or ())["pagedkv-error"] == "SessionBusy"
    assert daemon.pool.stats() == before
    assert await session.block_tables([1, 2]) == tables


async def test_a_runner_hold_refuses_other_callers_frees_until_the_runner_ends_it(
        daemon: Daemon, client: PoolClient, runner: PoolClient, app: Session) -> None:
    await runner_step(runner, app, HOLD_MS)
    await refusals(daemon, client, app)
    (entry,) = await runner.step_many([  # a StepMany entry holds alike
        (as_runner(runner, app), Step([2], [12], hold_ms=HOLD_MS))])
    assert not isinstance(entry, Exception)
    await refusals(daemon, client, app)
    closing = asyncio.create_task(app.close())  # the bundled close waits for the hold to end
    await asyncio.sleep(0.1)
    assert not closing.done()
    await keep_alive(runner, app, end_hold=True)
    assert await closing == 2


async def test_a_runner_is_never_refused_and_its_batch_ends_the_hold(
        daemon: Daemon, client: PoolClient, runner: PoolClient, app: Session) -> None:
    """The runner's release path: its own Batch frees under its hold, and ends it. (A read
    back of the tables holds too: what the runner does before computing a sequence it does not
    append to.)"""
    await as_runner(runner, app).block_tables([1], hold_ms=HOLD_MS)
    with pytest.raises(SessionBusy):
        await app.free(1)
    await as_runner(runner, app).batch([Free(1)], end_hold=True)
    assert await app.close() == 1


async def test_a_hold_renewed_lasts_hold_ms_from_its_renewal(
        daemon: Daemon, clock: HandClock, client: PoolClient, runner: PoolClient,
        app: Session) -> None:
    await runner_step(runner, app, 100)
    clock.advance(90)
    await keep_alive(runner, app, hold_ms=100)  # renewed: now + 100 ms
    clock.advance(90)
    await refusals(daemon, client, app)
    await keep_alive(runner, app, end_hold=True)  # else it holds past its lapse (the fence)


async def test_a_lapsed_hold_of_a_runner_the_daemon_cannot_stop_holds_until_it_ends(
        daemon: Daemon, clock: HandClock, client: PoolClient, runner: PoolClient,
        app: Session) -> None:
    """The runner here is the daemon's own process, which the daemon never kills: a lapse
    alone proves nothing (the runner may be stopped, not dead), so its blocks stay out of
    circulation, and neither a free nor the lease's expiry takes them, until it ends the hold.
    (A runner of its own process is fenced: tests/daemon/service/test_fence.py.)"""
    await runner_step(runner, app, 100)
    clock.advance(3 * LEASE_MS)  # past the hold and the lease
    before = daemon.pool.stats()
    with pytest.raises(SessionBusy, match=r"Free refused: the runner holding session "
                                          r"tenant-app#\d+ stalled past its hold"):
        await app.free(1)
    assert await daemon.service.expire_due() == 0
    assert daemon.pool.stats() == before
    assert daemon.service.runner_processes.counts.refused == 1
    await keep_alive(runner, app, end_hold=True)
    assert await app.free(1) > 0
    assert await app.close() == 1


async def test_a_held_session_outlives_its_lease_and_expires_once_the_hold_ends(
        daemon: Daemon, clock: HandClock, runner: PoolClient, app: Session) -> None:
    await runner_step(runner, app, HOLD_MS)
    clock.advance(3 * LEASE_MS)  # past its lease, not past the hold
    assert await daemon.service.expire_due() == 0
    assert (await app.block_tables([1]))[0].num_tokens == 6
    await keep_alive(runner, app, end_hold=True)
    clock.advance(3 * LEASE_MS)
    assert await daemon.service.expire_due() == 1
    assert daemon.pool.stats().num_sequences == 0


async def test_hold_fields_are_for_runners_only_and_bounded(
        daemon: Daemon, client: PoolClient, runner: PoolClient, app: Session) -> None:
    """A public caller sending hold_ms or end_hold, a runner past max_hold_ms or sending both:
    INVALID_ARGUMENT naming the field, nothing changed (the Step appended nothing)."""
    held = as_runner(runner, app)
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: app.step([1], hold_ms=10), "hold_ms is for runners only"),
        (lambda: app.batch([Free(1)], end_hold=True), "end_hold is for runners only"),
        (lambda: app.keep_alive(hold_ms=10), "hold_ms is for runners only"),
        (lambda: app.block_tables([1], hold_ms=10), "hold_ms is for runners only"),
        (lambda: held.step([1], hold_ms=10_001),
         "hold_ms=10001; the limit is max_hold_ms=10000"),
        (lambda: held.keep_alive(hold_ms=5, end_hold=True), "hold_ms and end_hold are both set")]
    for call, field in calls:
        with pytest.raises(InvalidArgument, match=field):
            await call()
    assert (await app.block_tables([1]))[0].num_tokens == 5
    assert await app.free(1) > 0  # and no hold was set
