"""KVPool.StepStream: StepMany calls as messages on one long-lived stream, served by the daemon's
production gRPC server (its interceptor, limits and metrics), and the bundled client's use of it
(`PoolClient.step_many`, client/pool/step_stream.py).

The daemon answers each message as the StepMany call with the same request, in order, with its
call_id; a message refused as a whole carries its status and the stream goes on; every gate of
a unary call holds for the stream (auth and tenant, the request budget per message, the cap on
calls at once) and the daemon counts every message answered. The client keeps one stream,
reads back every message a deadline or a break left unanswered, and opens a new stream after
a break. Pool: 16 blocks of 4 slots; fresh blocks come out in id order.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from pagedkv.client import (
    DaemonUnavailable,
    PagedKVError,
    PoolClient,
    SequenceNotFound,
    Session,
    SessionNotFound,
    Step,
    StepResult,
    Unauthenticated,
)
from pagedkv.client.pool.errors import InvalidArgument, MessageTooLarge
from pagedkv.daemon.edge.servicer import KVPoolServicer
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.request_budget import SMALL_REQUEST_BYTES
from pagedkv.daemon.service.tenants import Tenant, Tenants, bearer_of
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc
from pagedkv.proto.limits import MAX_MESSAGE_BYTES

from daemon_harness import Daemon, running_daemon
from pagedkvd_process import pagedkvd

if TYPE_CHECKING:
    from pagedkv.proto.kvpool_pb2_grpc import KVPoolAsyncStub as Stub

KVPOOL = "pagedkv.v1.KVPool"
TENANTS = Tenants([Tenant("alice", bearer_of("alice-token")),
                   Tenant("bob", bearer_of("bob-token"))])
# The client's deadline where a test makes an answer late.
TIMEOUT_S = 0.5


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(tcp=True, tenants=TENANTS) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def stub(daemon: Daemon) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        yield kvpool_pb2_grpc.KVPoolStub(channel)


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


async def session_with(stub: Stub, *lengths: int) -> str:
    """A new session holding sequences 1, 2, ... of these token counts."""
    sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
    for seq_id, length in enumerate(lengths, start=1):
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=seq_id, num_tokens=length))
    return sid


def many(*steps: tuple[str, list[int]]) -> pb.StepManyRequest:
    return pb.StepManyRequest(steps=[pb.StepRequest(session_id=sid, seq_ids=seq_ids)
                                     for sid, seq_ids in steps])


def messages(daemon: Daemon, code: str = "OK") -> float:
    """StepStream messages the daemon answered with `code`, per its metrics."""
    return daemon.registry.get_sample_value("pagedkv:stream_messages_total", {
        "service": KVPOOL, "method": "StepStream", "code": code}) or 0.0


def rpcs(daemon: Daemon, method: str) -> float:
    """`method` calls the daemon finished, every status code."""
    return sum(daemon.registry.get_sample_value("pagedkv:rpc_requests_total", {
        "service": KVPOOL, "method": method, "code": code.name}) or 0.0
        for code in grpc.StatusCode)


# ------------------------------------------------------------------ the daemon's side

async def test_messages_are_answered_in_order_each_as_its_step_many(
        daemon: Daemon, stub: Stub) -> None:
    """Three messages on one stream: answered in order with their call ids; an entry naming an
    unknown sequence fails alone with its status, as in StepMany; a message of 257 entries is
    refused whole (nothing of it applied) and the stream goes on. Each message is counted."""
    sid = await session_with(stub, 3, 4)  # blocks 0 and 1
    call = stub.StepStream(None)
    await call.write(pb.StepStreamRequest(call_id=7, many=many((sid, [1]), (sid, [9]))))
    await call.write(pb.StepStreamRequest(call_id=3, many=many(*[(sid, [1])] * 257)))
    await call.write(pb.StepStreamRequest(call_id=5, many=many((sid, [1, 2]))))
    answers = [await call.read() for _ in range(3)]
    assert all(isinstance(answer, pb.StepStreamResponse) for answer in answers)
    first, refused, third = answers  # type: ignore[misc]
    assert [first.call_id, refused.call_id, third.call_id] == [7, 3, 5]
    applied, failed = first.many.results
    assert (applied.code, list(applied.step.slot_mapping)) == (0, [3])
    assert (failed.code, failed.cause) == (grpc.StatusCode.NOT_FOUND.value[0], "SequenceNotFound")
    assert (refused.code, refused.cause) == (grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                             "InvalidArgument")
    assert "max_steps_per_call=256" in refused.message and not refused.HasField("many")
    # Sequence 1 took the first message's token only: 3 + 1, then + 1 in the third message.
    assert list(third.many.results[0].step.num_tokens) == [5, 5]
    assert (messages(daemon), messages(daemon, "INVALID_ARGUMENT")) == (2, 1)
    assert rpcs(daemon, "StepStream") == 0  # the stream itself is counted when it ends
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    assert rpcs(daemon, "StepStream") == 1


async def test_auth_holds_on_the_stream(daemon: Daemon) -> None:
    """A TCP caller without a token is refused before any message is read (nothing applied);
    a tenant naming another tenant's session gets NOT_FOUND for that entry, as for an unknown
    id, while its own entry is applied."""
    assert daemon.tcp_target is not None
    async with await PoolClient.connect(daemon.tcp_target, auth_token="alice-token") as alice, \
            await PoolClient.connect(daemon.tcp_target, auth_token="bob-token") as bob, \
            await PoolClient.connect(daemon.tcp_target) as anonymous:
        mine = await alice.open_session("a")
        await mine.allocate(1, 4)
        stolen = bob.attach(mine.session_id, mine.block_size)
        his = await bob.open_session("b")
        await his.allocate(1, 4)
        answers = await bob.step_many([(stolen, Step([1])), (his, Step([1]))])
        assert isinstance(answers[0], SessionNotFound) and "unknown session" in str(answers[0])
        assert isinstance(answers[1], StepResult) and answers[1].num_tokens == [5]
        with pytest.raises(Unauthenticated):
            await anonymous.step_many([(anonymous.attach(mine.session_id, 4), Step([1]))])
        assert (await mine.block_tables([1]))[0].num_tokens == 4
        assert bob.steps is not None and bob.steps.opened == 1  # both messages on one stream
    assert messages(daemon) == 1
    assert daemon.registry.get_sample_value("pagedkv:rpc_requests_total", {
        "service": KVPOOL, "method": "StepStream", "code": "UNAUTHENTICATED"}) == 1


async def test_the_peer_gate_names_the_streams_caller_by_uid() -> None:
    """Through the peer-credential gate, the stream's caller is the tenant listing its uid: a
    session of the unix tenant (opened by a runner) is NOT_FOUND to it, its own is stepped."""
    mapped = Tenants([Tenant("me", uids=frozenset({os.getuid()}))])
    async with running_daemon(tenants=mapped) as daemon, \
            await PoolClient.connect(daemon.unix_target) as me, \
            await PoolClient.connect(daemon.runners_target) as runner:
        # Both connections pass the gate: the runner socket's too (its caller's pid).
        assert daemon.gate is not None and daemon.gate.open_connections == 2
        theirs = await runner.open_session("the unix tenant's")
        await theirs.allocate(1, 3)
        mine = await me.open_session("mine")
        await mine.allocate(1, 3)
        answers = await me.step_many([(me.attach(theirs.session_id, 4), Step([1])),
                                      (mine, Step([1]))])
        assert isinstance(answers[0], SessionNotFound)
        assert isinstance(answers[1], StepResult) and answers[1].num_tokens == [4]
        assert (await theirs.block_tables([1]))[0].num_tokens == 3
        assert me.steps is not None and me.steps.opened == 1


async def test_each_large_message_holds_the_request_budget_until_answered(
        daemon: Daemon, stub: Stub) -> None:
    """A message over SMALL_REQUEST_BYTES takes its wire bytes from the request budget before
    it is parsed, and gives them back once answered, the stream still open."""
    sid = await session_with(stub, 1)
    tokens = [2**62 + i for i in range(SMALL_REQUEST_BYTES // 8)]
    request = pb.StepManyRequest(steps=[pb.StepRequest(
        session_id=sid, seq_ids=[1], num_tokens=len(tokens), token_ids=tokens)])
    message = pb.StepStreamRequest(call_id=1, many=request)
    budget = daemon.service.requests
    call = stub.StepStream(None)
    async with daemon.service.calls.lock:  # the message waits for the pool, parsed
        await call.write(message)
        await until(lambda: budget.admitted > 0)
        assert budget.admitted == message.ByteSize() > SMALL_REQUEST_BYTES
    answer = await call.read()
    assert isinstance(answer, pb.StepStreamResponse) and answer.code == 0, answer
    assert budget.admitted == 0 and not call.done()
    call.cancel()


async def test_an_open_stream_is_one_of_max_concurrent_rpcs() -> None:
    async with running_daemon(limits=Limits(max_concurrent_rpcs=1)) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as channel:
        stub: Stub = kvpool_pb2_grpc.KVPoolStub(channel)
        call = stub.StepStream(None)
        await call.write(pb.StepStreamRequest(call_id=1, many=pb.StepManyRequest()))
        assert isinstance(await call.read(), pb.StepStreamResponse)  # the stream is served
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetStats(pb.GetStatsRequest())
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
        await until_served(stub)


async def until_served(stub: Stub) -> None:
    """A call served once the server has seen the stream's end."""
    for _ in range(200):
        try:
            await stub.GetStats(pb.GetStatsRequest())
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.01)
    raise AssertionError("never served again")


async def test_a_draining_daemon_ends_each_stream_after_its_message_in_progress(
        daemon: Daemon, stub: Stub) -> None:
    """SIGTERM's drain: a stream waiting for its next message ends at once (OK), one whose
    message waits for the pool ends once that message is answered; neither holds the drain
    for its grace period, nor is cancelled at its end."""
    sid = await session_with(stub, 3)
    live = daemon.service.sessions.get(sid)
    idle, busy = stub.StepStream(None), stub.StepStream(None)
    for call_id, call in enumerate((idle, busy)):
        await call.write(pb.StepStreamRequest(call_id=call_id, many=many((sid, [1]))))
        assert isinstance(await call.read(), pb.StepStreamResponse)
    assert daemon.servers is not None
    async with daemon.service.calls.lock:
        await busy.write(pb.StepStreamRequest(call_id=2, many=many((sid, [1]))))
        await until(lambda: live.in_flight == 1)
        drain = asyncio.create_task(daemon.servers.drain())
        assert await idle.code() == grpc.StatusCode.OK  # while the other's message waits
    answer = await busy.read()
    assert isinstance(answer, pb.StepStreamResponse) and answer.call_id == 2
    assert list(answer.many.results[0].step.num_tokens) == [6]
    assert await busy.code() == grpc.StatusCode.OK
    await drain


# ------------------------------------------------------------------ the client's side

async def test_the_client_keeps_one_stream_and_fails_entries_as_step_many(
        daemon: Daemon) -> None:
    async with await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session("s")
        await session.allocate(1, 3)
        for expected in ([3], [4]):
            (answer,) = await client.step_many([(session, Step([1]))])
            assert isinstance(answer, StepResult) and answer.slot_mapping == expected
        missing, applied = await client.step_many([(session, Step([9])), (session, Step([1]))])
        assert isinstance(missing, SequenceNotFound) and isinstance(applied, StepResult)
        with pytest.raises(InvalidArgument, match="max_steps_per_call"):  # refused whole
            await client.step_many([(session, Step([1]))] * 257)
        assert client.steps is not None and client.steps.opened == 1
    assert messages(daemon) == 3 and rpcs(daemon, "StepMany") == 0


async def test_a_message_over_the_size_limit_fails_alone(daemon: Daemon) -> None:
    """gRPC would end the stream for it (and lose every message in flight): the client refuses
    it before sending, and the stream goes on."""
    async with await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session("s")
        await session.allocate(1, 3)
        await client.step_many([(session, Step([1]))])
        tokens = [2**62] * (MAX_MESSAGE_BYTES // 9 + 1)  # 9 bytes each
        with pytest.raises(MessageTooLarge, match="split the call"):
            await client.step_many([(session, Step([1], tokens, num_tokens=len(tokens)))])
        (answer,) = await client.step_many([(session, Step([1]))])
        assert isinstance(answer, StepResult) and answer.num_tokens == [5]
        assert client.steps is not None and client.steps.opened == 1


@pytest.mark.parametrize("applied", [True, False])
async def test_messages_left_unanswered_are_read_back(daemon: Daemon, applied: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls in flight on one stream, the first's answer late: the client ends the stream
    and reads both back entry by entry. Not applied (the daemon was still waiting for the pool:
    the stream's cancel undid the first, and the second was never read): each is sent again as
    a Step. Applied (answered after the deadline): rebuilt from the tables, sent again only if
    not applied. Every sequence ends one token longer, and the next call opens a new stream."""
    if applied:
        late_answer(monkeypatch)
    async with await PoolClient.connect(daemon.unix_target, timeout=TIMEOUT_S) as client:
        alice, bob = await client.open_session("a"), await client.open_session("b")
        await alice.allocate(1, 3)  # block 0
        await bob.allocate(1, 5)  # blocks 1 and 2
        live = next(s for s in daemon.service.sessions if s.client_name == "a")
        if applied:
            answers = await asyncio.gather(client.step_many([(alice, Step([1]))]),
                                           client.step_many([(bob, Step([1]))]))
        else:
            async with daemon.service.calls.lock:  # the first message waits for the pool
                calls = asyncio.gather(client.step_many([(alice, Step([1]))]),
                                       client.step_many([(bob, Step([1]))]))
                await until(lambda: live.in_flight == 1)
                await until(lambda: live.in_flight == 0)  # cancelled by the client's deadline
            answers = await calls
        assert [(a.num_tokens, a.slot_mapping) for (a,) in answers  # type: ignore[union-attr]
                ] == [([4], [3]), ([6], [9])]
        assert [(await s.block_tables([1]))[0].num_tokens for s in (alice, bob)] == [4, 6]
        assert rpcs(daemon, "Step") == (1 if applied else 2)  # the second was never handled
        (again,) = await client.step_many([(alice, Step([1]))])
        assert isinstance(again, StepResult) and again.num_tokens == [5]
        assert client.steps is not None and client.steps.opened == 2


def late_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's first StepStream message is applied and answered after the deadline."""
    original = KVPoolServicer._stream_answer
    late = [True]

    async def slow(servicer: KVPoolServicer, request: pb.StepStreamRequest) -> Any:
        answer = await original(servicer, request)
        if late.pop() if late else False:
            await asyncio.sleep(3 * TIMEOUT_S)
        return answer

    monkeypatch.setattr(KVPoolServicer, "_stream_answer", slow)


async def test_the_client_opens_a_new_stream_after_the_daemon_restarts() -> None:
    """A real pagedkvd killed and started again on the same socket: the stream broke; the old
    session's entry fails (lost, or unknown to the new daemon), and the next calls go on a
    new stream to the new daemon."""
    with pagedkvd("--num-blocks", "16") as first:
        async with await PoolClient.connect(first.unix_target, timeout=5) as client:
            old = await client.open_session("before", keep_alive=False)
            await old.allocate(1, 3)
            (answer,) = await client.step_many([(old, Step([1]))])
            assert isinstance(answer, StepResult) and client.steps is not None
            assert client.steps.opened == 1
            first.send(signal.SIGKILL)
            await asyncio.to_thread(first.process.wait, 30)
            socket = Path(first.unix_target.removeprefix("unix://"))
            with pagedkvd("--num-blocks", "16", listen_path=socket) as second:
                (lost,) = await client.step_many([(old, Step([1]))])
                assert isinstance(lost, PagedKVError)
                new = await reconnected(client)
                await new.allocate(1, 3)
                (answer,) = await client.step_many([(new, Step([1]))])
                assert isinstance(answer, StepResult) and answer.num_tokens == [4]
                assert client.steps.opened >= 2
                await client.close()
                assert second.stop() == 0


async def reconnected(client: PoolClient) -> Session:
    """A new session, once the client's channel reaches the restarted daemon."""
    for _ in range(100):
        try:
            return await client.open_session("after", keep_alive=False)
        except DaemonUnavailable:
            await asyncio.sleep(0.1)
    raise AssertionError("the client never reached the new daemon")


async def test_a_daemon_without_step_stream_gets_step_many_calls(
        daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older daemon answers StepStream UNIMPLEMENTED: nothing was applied, the client sends
    the call as StepMany, and every later one too."""

    async def unimplemented(servicer: KVPoolServicer, requests: Any,
                            context: Any) -> AsyncIterator[pb.StepStreamResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield pb.StepStreamResponse()  # never reached: makes this an async generator

    monkeypatch.setattr(KVPoolServicer, "StepStream", unimplemented)
    async with running_daemon() as older, \
            await PoolClient.connect(older.unix_target) as client:
        session = await client.open_session("s")
        await session.allocate(1, 3)
        for expected in ([4], [5]):
            (answer,) = await client.step_many([(session, Step([1]))])
            assert isinstance(answer, StepResult) and answer.num_tokens == expected
        assert client.steps is not None and not client.steps.served
        assert client.steps.opened == 1 and rpcs(older, "StepMany") == 2
