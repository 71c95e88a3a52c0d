"""The daemon's server bounds (issue 17 #10-#12), against the production gRPC server.

#10: the default answer bound fits gRPC's default receive limit, so a stock channel (no
options) receives the largest answer the daemon allows by default.
#11: a call beyond max_concurrent_rpcs is refused by gRPC, by the daemon's server and by the
runner's; large requests queued for the pool lock hold at most max_queued_request_bytes parsed,
the others wait unparsed; a connection without calls is closed after max_connection_idle_ms.
#12: a call's work is bounded before it waits for the lock (the issue's 1,024-Commit Batch).
"""

import asyncio
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pagedkv.client import StepOutputs
from pagedkv.daemon.service.answer_size import SEQUENCE_FIXED
from pagedkv.daemon.service.limits import Limits
from pagedkv.model_runner.models import ModelSource
from pagedkv.model_runner.process.server import RunnerConfig, _grpc_server
from pagedkv.process.server_bounds import ServerBounds
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc, runner_pb2_grpc
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto.limits import GRPC_DEFAULT_RECEIVE_BYTES, MAX_MESSAGE_BYTES, MESSAGE_SIZE_OPTIONS
from pagedkv.proto.metadata import ERROR_KEY

from daemon_harness import running_daemon

Stub = kvpool_pb2_grpc.KVPoolStub


async def until(condition: Callable[[], bool]) -> None:
    """Let the server run until `condition` holds (it must, soon)."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the server never got there")


async def test_a_stock_channel_receives_the_largest_default_answer() -> None:
    # One token a block on 2^21 blocks: past id 16,383 every block id and slot is a 3-byte
    # varint, as the bound assumes, so the answer's real size is close to its bound. Only the
    # answer bound (its default) limits the Allocate: tokens and quota are raised out of its way.
    limits = Limits(max_tokens=1 << 22, max_blocks_per_session=1 << 22, max_call_work=1 << 24)
    async with running_daemon(num_blocks=1 << 21, block_size=1, limits=limits) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as channel:  # gRPC's defaults
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        budget = daemon.service.answer_budget()  # the default max_answer_bytes
        largest = (budget.limit - SEQUENCE_FIXED) // (budget.block_bytes + budget.slot_bytes)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
        answer = await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1,
                                                        num_tokens=largest))
        assert len(answer.slot_mapping) == len(answer.block_ids) == largest
        assert 0.95 * GRPC_DEFAULT_RECEIVE_BYTES < answer.ByteSize() <= GRPC_DEFAULT_RECEIVE_BYTES
        # One token more (in a session of its own, whose quota has room) is refused by the
        # daemon, before anything changes: never applied and then lost to the client.
        used = daemon.pool.stats().used_blocks
        other = (await stub.OpenSession(pb.OpenSessionRequest(client_name="u"))).session_id
        try:
            await stub.Allocate(pb.AllocateRequest(session_id=other, seq_id=2,
                                                   num_tokens=largest + 1))
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(error.trailing_metadata() or ()).get(ERROR_KEY) == "AnswerTooLarge"
            assert "max_answer_bytes" in (error.details() or "")
        else:
            raise AssertionError("an answer over max_answer_bytes was sent")
        assert daemon.pool.stats().used_blocks == used


async def test_a_call_beyond_max_concurrent_rpcs_is_refused_by_grpc() -> None:
    async with running_daemon(limits=Limits(max_concurrent_rpcs=3)) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as channel:
        stub = Stub(channel)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
        session = daemon.service.sessions.get(sid)
        async with daemon.service.calls.lock:  # three Allocates wait for the pool
            waiting = [asyncio.ensure_future(stub.Allocate(pb.AllocateRequest(
                session_id=sid, seq_id=seq_id, num_tokens=1))) for seq_id in (1, 2, 3)]
            await until(lambda: session.in_flight == 3)
            try:
                await stub.KeepAlive(pb.KeepAliveRequest(session_id=sid))
            except grpc.aio.AioRpcError as error:  # refused by gRPC, before the daemon's code
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert ERROR_KEY not in dict(error.trailing_metadata() or ())
            else:
                raise AssertionError("a fourth call was served at once")
        assert [len(answer.block_ids) for answer in await asyncio.gather(*waiting)] == [1] * 3
        await stub.KeepAlive(pb.KeepAliveRequest(session_id=sid))  # served again
        daemon.service.check_invariants()


async def test_large_requests_queued_for_the_pool_hold_at_most_the_byte_budget() -> None:
    # Four Allocates of about 3 MiB each (350,000 token ids of 9 bytes) while the pool is busy:
    # two fit the smallest budget (8 MiB), the other two wait unparsed until those end.
    limits = Limits(max_queued_request_bytes=MAX_MESSAGE_BYTES)
    tokens = [2**62 + i for i in range(350_000)]
    async with running_daemon(num_blocks=100_000, block_size=16, limits=limits) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target, options=MESSAGE_SIZE_OPTIONS) as channel:
        stub = Stub(channel)
        budget = daemon.service.requests
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
        session = daemon.service.sessions.get(sid)
        requests = [pb.AllocateRequest(session_id=sid, seq_id=seq_id, num_tokens=len(tokens),
                                       token_ids=tokens) for seq_id in range(1, 5)]
        size = requests[0].ByteSize()
        assert size > 3 * 2**20 and 2 * size <= budget.limit < 3 * size
        async with daemon.service.calls.lock:
            calls = [asyncio.ensure_future(stub.Allocate(request)) for request in requests]
            await until(lambda: budget.waiting == 2 and session.in_flight == 2)
            assert budget.admitted == 2 * size <= budget.limit  # the parsed ones
            # A small call is never held by the budget.
            await stub.KeepAlive(pb.KeepAliveRequest(session_id=sid))
        answers = await asyncio.gather(*calls)
        assert [answer.num_tokens for answer in answers] == [len(tokens)] * 4
        assert budget.admitted == budget.waiting == 0
        daemon.service.check_invariants()


async def test_the_1024_commit_batch_is_refused_before_any_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The Batch: 1,024 Commits, each naming every sequence of the session (256 here,
    # 4,096 there): a few kilobytes of answer, and once 0.85 s under the pool lock.
    async with running_daemon(num_blocks=1024, block_size=16) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as channel:
        stub = Stub(channel)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
        seqs = range(256)
        await stub.Batch(pb.BatchRequest(session_id=sid, ops=[
            pb.BatchOp(allocate=pb.AllocateRequest(seq_id=seq_id, num_tokens=16))
            for seq_id in seqs]))
        committed: list[int] = []  # the work done: seq ids each pool commit walked
        commit = daemon.pool.commit
        monkeypatch.setattr(daemon.pool, "commit", lambda keys, *rest: (
            committed.append(len(keys)), commit(keys, *rest))[1])
        every = pb.BatchOp(commit=pb.CommitRequest(seq_ids=seqs))
        try:
            await stub.Batch(pb.BatchRequest(session_id=sid, ops=[every] * 1024))
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "the limit is max_call_work=262144" in (error.details() or "")
        else:
            raise AssertionError("the batch was served")
        assert committed == []  # refused before the lock: no commit ran
        # The most Commits one call may carry, at 1 + 256 items each: its work is what it
        # names, no more.
        largest = Limits().max_call_work // (1 + len(seqs))
        await stub.Batch(pb.BatchRequest(session_id=sid, ops=[every] * largest))
        assert committed == [len(seqs)] * largest
        daemon.service.check_invariants()


class HeldSteps:
    """What the Runner server reads of a RunnerState (a stand-in for one), its steps held until
    cancelled."""

    def __init__(self) -> None:
        # Set once a step has reached the engine.
        self.entered = asyncio.Event()
        # No figures (RunnerState.metrics).
        self.metrics = None

    async def step(self, *_: object) -> StepOutputs:
        self.entered.set()
        await asyncio.Event().wait()  # until the call is cancelled
        raise AssertionError("unreachable")

    async def follow(self, *_: object) -> None:
        """No decode run starts (RunnerState.follow): pushes would go through `step`."""

    def runner_info(self) -> rpb.RunnerInfo:
        return rpb.RunnerInfo(model="held")


async def test_the_runner_server_refuses_a_call_beyond_max_concurrent_rpcs() -> None:
    folder = Path(tempfile.mkdtemp(prefix="pkv-"))  # short: unix socket paths are limited
    config = RunnerConfig(model=ModelSource(random_init="tiny"),
                          listen=f"unix://{folder / 'runner.sock'}",
                          server_bounds=ServerBounds(max_concurrent_rpcs=1))
    state = HeldSteps()
    async with _grpc_server(config, state), \
            grpc.aio.insecure_channel(config.listen) as channel:
        stub = runner_pb2_grpc.RunnerStub(channel)
        held = asyncio.ensure_future(stub.Step(rpb.RunnerStepRequest(session_id="s")))
        await state.entered.wait()
        try:
            await stub.GetRunnerInfo(rpb.GetRunnerInfoRequest())
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            raise AssertionError("a second call was served at once")
        held.cancel()
    shutil.rmtree(folder, ignore_errors=True)


async def test_a_step_many_entry_past_max_call_work_fails_alone() -> None:
    # Each entry holds the pool on its own: one too large fails, the others are applied.
    async with running_daemon(num_blocks=256, block_size=16,
                              limits=Limits(max_call_work=1024)) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as channel:
        stub = Stub(channel)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=1))
        small = pb.StepRequest(session_id=sid, seq_ids=[1], num_tokens=1)
        large = pb.StepRequest(session_id=sid, seq_ids=[1], num_tokens=1024 * 16)  # 1,027 items
        reply = await stub.StepMany(pb.StepManyRequest(steps=[small, large, small]))
        assert [result.code for result in reply.results] == [
            0, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
        assert "max_call_work=1024" in reply.results[1].message
        assert daemon.pool.num_tokens(daemon.service.sessions.get(sid).key(1)) == 3
        daemon.service.check_invariants()


async def test_a_connection_without_calls_is_closed_after_max_connection_idle_ms() -> None:
    async with running_daemon(limits=Limits(max_connection_idle_ms=1000)) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as channel:
        stub = Stub(channel)
        await stub.GetPoolInfo(pb.GetPoolInfoRequest())
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        # The server closes it (GOAWAY) once it carried no call for a second; never without
        # the setting, so the wait would time out.
        await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 20)
        assert channel.get_state() != grpc.ChannelConnectivity.READY
        await stub.GetPoolInfo(pb.GetPoolInfoRequest())  # the client reconnects on its own
