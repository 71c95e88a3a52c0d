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
from collections.abc import AsyncIterator

import grpc
import pytest

from pagedkv.client import Allocate, Free, InvalidArgument, PoolClient, Session, SessionBusy
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import Daemon, running_daemon

HOLD_MS = 5000
LEASE_MS = 1000


class Clock:
    """The daemon's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def daemon(clock: Clock) -> AsyncIterator[Daemon]:
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


async def runner_step(runner: PoolClient, session: Session, hold_ms: int) -> pb.StepResponse:
    """The runner's decode Step of sequence 1, holding the session for its forward."""
    return await runner.call(runner.stub.Step, lambda: pb.StepRequest(
        session_id=session.session_id, seq_ids=[1], token_ids=[11], hold_ms=hold_ms))


async def keep_alive(runner: PoolClient, session: Session, **hold: int | bool) -> None:
    await runner.call(runner.stub.KeepAlive, lambda: pb.KeepAliveRequest(
        session_id=session.session_id, **hold))  # type: ignore[arg-type]


async def refusals(daemon: Daemon, client: PoolClient, session: Session) -> None:
    """Every way a public caller frees memory is SessionBusy, and nothing changes."""
    before = daemon.pool.stats()
    tables = await session.block_tables([1, 2])
    busy = r"(Free|Batch|CloseSession) refused: a runner holds session tenant-app#\d+ for " \
           r"\d+ ms more .*release the sequences through the runner"
    with pytest.raises(SessionBusy, match=busy) as refused:
        await client.call(client.stub.Free, lambda: pb.FreeRequest(
            session_id=session.session_id, seq_id=1))
    assert session.session_id not in refused.value.message  # the id is a credential
    with pytest.raises(SessionBusy, match=busy):
        await session.batch([Allocate(3, token_ids=[1]), Free(2)])
    with pytest.raises(SessionBusy, match=busy):
        await client.call(client.stub.CloseSession, lambda: pb.CloseSessionRequest(
            session_id=session.session_id))
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
    (entry,) = await runner.step_many([pb.StepRequest(  # a StepMany entry holds alike
        session_id=app.session_id, seq_ids=[2], token_ids=[12], hold_ms=HOLD_MS)])
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
    await runner.call(runner.stub.GetBlockTables, lambda: pb.GetBlockTablesRequest(
        session_id=app.session_id, seq_ids=[1], hold_ms=HOLD_MS))
    with pytest.raises(SessionBusy):
        await app.free(1)
    await runner.call(runner.stub.Batch, lambda: pb.BatchRequest(
        session_id=app.session_id, ops=[Free(1).batch_op()], end_hold=True))
    assert await app.close() == 1


async def test_a_hold_lapses_at_its_deadline(
        daemon: Daemon, clock: Clock, client: PoolClient, runner: PoolClient,
        app: Session) -> None:
    """No end_hold (a runner that died): the hold lapses hold_ms after its last renewal."""
    await runner_step(runner, app, 100)
    clock.advance(90)
    await keep_alive(runner, app, hold_ms=100)  # renewed: now + 100 ms
    clock.advance(90)
    await refusals(daemon, client, app)
    clock.advance(20)
    assert await app.free(1) > 0
    assert await app.close() == 1


async def test_a_held_session_outlives_its_lease_and_expires_once_the_hold_ends(
        daemon: Daemon, clock: Clock, runner: PoolClient, app: Session) -> None:
    await runner_step(runner, app, HOLD_MS)
    clock.advance(3 * LEASE_MS)  # past its lease, not past the hold
    assert await daemon.service.expire_due() == 0
    assert (await app.block_tables([1]))[0].num_tokens == 6
    clock.advance(HOLD_MS)
    assert await daemon.service.expire_due() == 1
    assert daemon.pool.stats().num_sequences == 0


async def test_hold_fields_are_for_runners_only_and_bounded(
        daemon: Daemon, client: PoolClient, runner: PoolClient, app: Session) -> None:
    """A public caller sending hold_ms or end_hold, a runner past max_hold_ms or sending both:
    INVALID_ARGUMENT naming the field, nothing changed (the Step appended nothing)."""
    for sender, request, field in (
            (client, pb.StepRequest(session_id=app.session_id, seq_ids=[1], hold_ms=10),
             "hold_ms is for runners only"),
            (client, pb.BatchRequest(session_id=app.session_id, ops=[Free(1).batch_op()],
                                     end_hold=True), "end_hold is for runners only"),
            (client, pb.KeepAliveRequest(session_id=app.session_id, hold_ms=10),
             "hold_ms is for runners only"),
            (client, pb.GetBlockTablesRequest(session_id=app.session_id, seq_ids=[1],
                                              hold_ms=10), "hold_ms is for runners only"),
            (runner, pb.StepRequest(session_id=app.session_id, seq_ids=[1], hold_ms=10_001),
             "hold_ms=10001; the limit is max_hold_ms=10000"),
            (runner, pb.KeepAliveRequest(session_id=app.session_id, hold_ms=5, end_hold=True),
             "hold_ms and end_hold are both set")):
        method = getattr(sender.stub, type(request).__name__.removesuffix("Request"))
        with pytest.raises(InvalidArgument, match=field):
            await sender.call(method, lambda request=request: request)  # type: ignore[misc]
    assert (await app.block_tables([1]))[0].num_tokens == 5
    assert await app.free(1) > 0  # and no hold was set
