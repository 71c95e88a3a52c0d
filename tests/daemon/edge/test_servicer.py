"""Every RPC and status code over a real grpc.aio server, with raw generated stubs.

External schedulers use their own stubs, so these tests speak protobuf directly. Pool: 16
blocks of 4 slots; fresh blocks come out in id order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest
import torch

from pagedkv.daemon.service.answer_size import STEP_MANY_ENTRY, STEP_MANY_FIXED, AnswerBudget
from pagedkv.daemon.service.errors import AnswerTooLarge
from pagedkv.daemon.service.limits import Limits
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import Daemon, running_daemon

if TYPE_CHECKING:
    from pagedkv.proto.kvpool_pb2_grpc import KVPoolAsyncStub as Stub

Code = grpc.StatusCode


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(with_memory=True) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def stub(daemon: Daemon) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        yield kvpool_pb2_grpc.KVPoolStub(channel)


async def open_session(stub: Stub, **fields: object) -> str:
    reply = await stub.OpenSession(pb.OpenSessionRequest(client_name="t", **fields))
    return reply.session_id


async def expect(code: grpc.StatusCode, call: object, match: str = "",
                 cause: str = "") -> None:
    """Await `call`, asserting it fails with `code`, a message containing `match`, and the
    `pagedkv-error` cause."""
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    assert failure.value.code() == code, failure.value.details()
    assert match in (failure.value.details() or "")
    if cause:
        assert (metadata_of(failure.value)).get("pagedkv-error") == cause


def metadata_of(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {key: value for key, value in error.trailing_metadata() or ()}


async def test_pool_info_describes_geometry_and_memory(daemon: Daemon, stub: Stub) -> None:
    info = await stub.GetPoolInfo(pb.GetPoolInfoRequest())
    assert (info.pool_id, info.num_blocks, info.block_size) == (daemon.service.pool_id, 16, 4)
    assert (info.model, info.num_layers, info.num_kv_heads, info.head_dim) == ("tiny", 2, 2, 64)
    assert info.dtype == "float32"
    assert info.bytes_per_block == 2 * 2 * 2 * 64 * 4 * 4
    assert info.layout.startswith("num_blocks,num_layers,2")
    assert not info.HasField("memory")  # the public socket's callers never get the memory
    assert daemon.memory is not None
    handle = daemon.memory.handle()
    async with grpc.aio.insecure_channel(daemon.runners_target) as channel:
        info = await kvpool_pb2_grpc.KVPoolStub(channel).GetPoolInfo(pb.GetPoolInfoRequest())
    assert (info.memory.kind, info.memory.shm_path) == ("shm", handle.shm_path)
    assert tuple(info.memory.shape) == handle.shape == (16, 2, 2, 4, 2, 64)


async def test_session_lifecycle(daemon: Daemon, stub: Stub) -> None:
    opened = await stub.OpenSession(pb.OpenSessionRequest(client_name="t", lease_ttl_ms=2000))
    assert (opened.lease_ttl_ms, opened.pool_id, opened.block_size) == (
        2000, daemon.service.pool_id, 4)
    sid = opened.session_id
    assert (await stub.KeepAlive(pb.KeepAliveRequest(session_id=sid))).lease_ttl_ms == 2000
    await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=5))
    closed = await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert closed.freed_sequences == 1
    assert daemon.pool.stats().used_blocks == 0
    await expect(Code.NOT_FOUND, stub.KeepAlive(pb.KeepAliveRequest(session_id=sid)),
                 "unknown session", cause="SessionNotFound")


async def test_sequence_rpcs(daemon: Daemon, stub: Stub) -> None:
    sid = await open_session(stub)
    seq = await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=6,
                                                 token_ids=range(6)))
    assert (seq.seq_id, list(seq.block_ids), seq.num_tokens) == (1, [0, 1], 6)
    assert list(seq.slot_mapping) == [0, 1, 2, 3, 4, 5]
    grown = await stub.Append(pb.AppendRequest(session_id=sid, seq_id=1, num_tokens=1))
    assert (list(grown.slot_mapping), grown.num_tokens) == ([6], 7)
    child = await stub.Fork(pb.ForkRequest(session_id=sid, parent_seq_id=1, child_seq_id=2))
    assert (child.seq_id, list(child.block_ids)) == (2, [0, 1])
    cow = await stub.CopyOnWrite(pb.CopyOnWriteRequest(session_id=sid, seq_id=2,
                                                       logical_block=1))
    assert list(cow.block_ids) == [0, 2]
    assert [(c.src, c.dst) for c in cow.copies] == [(1, 2)]
    tables = await stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid, seq_ids=[2, 1]))
    assert [(t.seq_id, list(t.block_ids), t.num_tokens) for t in tables.tables] == [
        (2, [0, 2], 7), (1, [0, 1], 7)]
    freed = await stub.Free(pb.FreeRequest(session_id=sid, seq_id=2))
    assert freed.released_blocks == 1


async def test_stats_show_capacity_and_own_session_only(daemon: Daemon, stub: Stub) -> None:
    """Anyone sees the pool's capacity; a session sees its own figures; no caller sees other
    sessions' activity (sequences, tokens, prefix-cache hits): that is for /metrics."""
    mine, other = await open_session(stub), await open_session(stub)
    await stub.Allocate(pb.AllocateRequest(session_id=mine, seq_id=1, num_tokens=5))
    prompt = list(range(8))
    await stub.Allocate(pb.AllocateRequest(session_id=other, seq_id=1, num_tokens=8,
                                           token_ids=prompt))
    await stub.Commit(pb.CommitRequest(session_id=other, seq_ids=[1]))
    await stub.Allocate(pb.AllocateRequest(session_id=other, seq_id=2, num_tokens=8,
                                           token_ids=prompt))  # a prefix-cache hit
    stats = await stub.GetStats(pb.GetStatsRequest(session_id=mine))
    assert (stats.num_blocks, stats.block_size, stats.free_blocks) == (16, 4, 12)
    assert [(s.name, s.blocks_held, s.num_sequences, s.prefix_cache_hits)
            for s in stats.sessions] == [("t#1", 2, 1, 0)]
    anonymous = await stub.GetStats(pb.GetStatsRequest())
    for seen in (stats, anonymous):  # nothing pool-wide beyond capacity, for anyone
        assert (seen.used_blocks, seen.cached_blocks, seen.pending_blocks, seen.filled_slots,
                seen.allocated_slots, seen.logical_tokens, seen.num_sequences,
                seen.num_sessions, seen.prefix_cache_queries, seen.prefix_cache_hits,
                seen.utilization, seen.sharing_ratio) == (0,) * 12
    assert (anonymous.num_blocks, anonymous.free_blocks, list(anonymous.sessions)) == (16, 12, [])
    assert daemon.pool.stats().prefix_cache_hits == 8  # the operator's view still has it all


async def test_step_packs_a_decode_step(daemon: Daemon, stub: Stub) -> None:
    sid = await open_session(stub)
    for seq_id in (10, 11, 12):
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=seq_id, num_tokens=4))
    await stub.Fork(pb.ForkRequest(session_id=sid, parent_seq_id=12, child_seq_id=13))
    await stub.Append(pb.AppendRequest(session_id=sid, seq_id=12, num_tokens=1))  # block 3
    # 10 and 11 are full: they open blocks 4 and 5. 12 writes into its block 3. 13 shares
    # 12's full block 2 only, so its token opens block 6 and nothing is copied.
    reply = await stub.Step(pb.StepRequest(session_id=sid, seq_ids=[10, 11, 12, 13],
                                           token_ids=[1, 2, 3, 4]))
    assert list(reply.slot_mapping) == [16, 20, 13, 24]
    assert list(reply.changed_seq_index) == [0, 1, 3]
    assert list(reply.changed_logical_block) == [1, 1, 1]
    assert list(reply.changed_block_id) == [4, 5, 6]
    assert not reply.copy_src and not reply.copy_dst


async def test_step_copies_shared_partial_block_in_memory(
        daemon: Daemon, stub: Stub) -> None:
    sid = await open_session(stub)
    await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=2))
    await stub.Fork(pb.ForkRequest(session_id=sid, parent_seq_id=1, child_seq_id=2))
    assert daemon.memory is not None
    kv = daemon.memory.kv
    kv[0] = torch.randn_like(kv[0])
    reply = await stub.Step(pb.StepRequest(session_id=sid, seq_ids=[2], num_tokens=2))
    assert (list(reply.copy_src), list(reply.copy_dst)) == ([0], [1])
    assert list(reply.slot_mapping) == [6, 7]
    assert torch.equal(kv[1], kv[0])


async def test_step_failure_changes_nothing(daemon: Daemon, stub: Stub) -> None:
    sid = await open_session(stub)
    await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=3))
    await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=2, num_tokens=3))
    before = daemon.pool.stats()
    await expect(Code.INVALID_ARGUMENT, stub.Step(pb.StepRequest(session_id=sid)), "at least one")
    await expect(Code.INVALID_ARGUMENT, stub.Step(pb.StepRequest(
        session_id=sid, seq_ids=[1, 2], token_ids=[1, 2, 3])), "3 token_ids")
    await expect(Code.NOT_FOUND, stub.Step(pb.StepRequest(session_id=sid, seq_ids=[1, 3])),
                 "[3]", cause="SequenceNotFound")
    await expect(Code.RESOURCE_EXHAUSTED, stub.Step(pb.StepRequest(
        session_id=sid, seq_ids=[1, 2], num_tokens=40)), "pool full")
    assert daemon.pool.stats() == before
    assert daemon.pool.block_table((1, 1)) == [0]


async def test_batch_all_or_nothing(daemon: Daemon, stub: Stub) -> None:
    sid = await open_session(stub)
    await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=6))
    before = (daemon.pool.stats(), daemon.pool.block_table((1, 1)))
    ops = [pb.BatchOp(allocate=pb.AllocateRequest(seq_id=2, num_tokens=4)),
           pb.BatchOp(fork=pb.ForkRequest(parent_seq_id=1, child_seq_id=3)),
           pb.BatchOp(append=pb.AppendRequest(seq_id=3, num_tokens=100)),
           pb.BatchOp(free=pb.FreeRequest(seq_id=1))]
    await expect(Code.RESOURCE_EXHAUSTED, stub.Batch(pb.BatchRequest(session_id=sid, ops=ops)),
                 "op 2 (append): pool full")
    assert (daemon.pool.stats(), daemon.pool.block_table((1, 1))) == before
    daemon.service.check_invariants()
    ops[2] = pb.BatchOp(copy_on_write=pb.CopyOnWriteRequest(seq_id=3, logical_block=1))
    reply = await stub.Batch(pb.BatchRequest(session_id=sid, ops=ops))
    assert [(r.seq_id, list(r.block_ids)) for r in reply.results] == [
        (2, [2]), (3, [0, 1]), (3, [0, 3]), (1, [])]
    assert [(c.src, c.dst) for c in reply.results[2].copies] == [(1, 3)]


async def test_batch_op_checks(daemon: Daemon, stub: Stub) -> None:
    sid = await open_session(stub)
    await expect(Code.INVALID_ARGUMENT, stub.Batch(pb.BatchRequest(
        session_id=sid, ops=[pb.BatchOp()])), "op 0 sets no operation")
    await expect(Code.INVALID_ARGUMENT, stub.Batch(pb.BatchRequest(session_id=sid, ops=[
        pb.BatchOp(free=pb.FreeRequest(session_id="other", seq_id=1))])), "another session")
    await expect(Code.INVALID_ARGUMENT, stub.Batch(pb.BatchRequest(session_id=sid)), "at least")
    too_many = [pb.BatchOp(free=pb.FreeRequest(seq_id=1))] * 1025
    await expect(Code.INVALID_ARGUMENT, stub.Batch(pb.BatchRequest(session_id=sid, ops=too_many)),
                 "1025 ops in one request; the limit is max_batch_ops=1024")


async def test_status_codes(daemon: Daemon, stub: Stub) -> None:
    sid = await open_session(stub, max_blocks=2)
    await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=4))
    cases = [
        (Code.INVALID_ARGUMENT, stub.Allocate(pb.AllocateRequest(
            session_id=sid, seq_id=2, num_tokens=-1)), "num_tokens must be >= 0", ""),
        (Code.INVALID_ARGUMENT, stub.Allocate(pb.AllocateRequest(
            session_id=sid, seq_id=2, num_tokens=3, token_ids=[1])), "1 token_ids", ""),
        (Code.INVALID_ARGUMENT, stub.CopyOnWrite(pb.CopyOnWriteRequest(
            session_id=sid, seq_id=1, logical_block=5)), "outside the 1 blocks", ""),
        (Code.INVALID_ARGUMENT, stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid)),
         "no seq_ids", ""),
        (Code.INVALID_ARGUMENT, stub.KeepAlive(pb.KeepAliveRequest()), "session_id is empty", ""),
        (Code.NOT_FOUND, stub.Free(pb.FreeRequest(session_id=sid, seq_id=9)),
         "sequence 9 not found", "SequenceNotFound"),
        (Code.NOT_FOUND, stub.Free(pb.FreeRequest(session_id="nope", seq_id=1)),
         "unknown session", "SessionNotFound"),
        (Code.ALREADY_EXISTS, stub.Fork(pb.ForkRequest(
            session_id=sid, parent_seq_id=1, child_seq_id=1)), "already exists", ""),
        (Code.RESOURCE_EXHAUSTED, stub.Allocate(pb.AllocateRequest(
            session_id=sid, seq_id=2, num_tokens=8)), "needs 2 more blocks, 1 of max_blocks=2", ""),
        (Code.FAILED_PRECONDITION, stub.KeepAlive(pb.KeepAliveRequest(
            session_id="0ldp00l-1-0123456789abcdef")), "before a daemon restart", ""),
    ]
    before = daemon.pool.stats()
    for code, call, match, cause in cases:
        await expect(code, call, match, cause)
    assert daemon.pool.stats() == before


async def test_unexpected_error_is_internal_and_server_survives(
        daemon: Daemon, stub: Stub,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(daemon.service, "capacity", broken)
    await expect(Code.INTERNAL, stub.GetStats(pb.GetStatsRequest()), "RuntimeError")
    monkeypatch.undo()
    assert (await stub.GetStats(pb.GetStatsRequest())).num_blocks == 16


async def test_session_from_before_a_restart_is_failed_precondition() -> None:
    async with running_daemon(pool_id="first") as first, \
            grpc.aio.insecure_channel(first.unix_target) as channel:
        sid = await open_session(kvpool_pb2_grpc.KVPoolStub(channel))
    async with running_daemon(pool_id="second") as second, \
            grpc.aio.insecure_channel(second.unix_target) as channel:
        call = kvpool_pb2_grpc.KVPoolStub(channel).Allocate(
            pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=1))
        await expect(Code.FAILED_PRECONDITION, call, "pool first, before a daemon restart")


async def test_step_many_applies_each_entry_alone(daemon: Daemon, stub: Stub) -> None:
    """Each entry is a Step of its own session: a failed entry changes nothing of it and fails
    alone, with the status and cause a Step call would have got."""
    alice, bob = await open_session(stub), await open_session(stub)
    await stub.Allocate(pb.AllocateRequest(session_id=alice, seq_id=1, num_tokens=4))  # block 0
    await stub.Allocate(pb.AllocateRequest(session_id=bob, seq_id=1, num_tokens=2))  # block 1
    steps = [
        pb.StepRequest(session_id=alice, seq_ids=[1], token_ids=[5], commit=True),  # block 2
        pb.StepRequest(session_id=bob, seq_ids=[1, 9]),  # 9 is not bob's
        pb.StepRequest(session_id=bob, seq_ids=[1], num_tokens=2),  # fills bob's block 1
        pb.StepRequest(session_id=alice, seq_ids=[1], num_tokens=100),  # more than the pool
        pb.StepRequest(session_id="nope", seq_ids=[1]),
        pb.StepRequest(session_id=alice, seq_ids=[1], token_ids=[1, 2]),
    ]
    reply = await stub.StepMany(pb.StepManyRequest(steps=steps))
    assert [(r.code, r.cause) for r in reply.results] == [
        (0, ""), (Code.NOT_FOUND.value[0], "SequenceNotFound"), (0, ""),
        (Code.RESOURCE_EXHAUSTED.value[0], "PoolExhausted"),
        (Code.NOT_FOUND.value[0], "SessionNotFound"),
        (Code.INVALID_ARGUMENT.value[0], "InvalidArgument")]
    assert "[9]" in reply.results[1].message and "pool full" in reply.results[3].message
    assert "2 token_ids" in reply.results[5].message
    assert not any(r.HasField("step") for r in reply.results if r.code)
    first, third = reply.results[0].step, reply.results[2].step
    assert (list(first.slot_mapping), list(first.changed_block_id), list(first.num_tokens)) == (
        [8], [2], [5])
    assert (list(third.slot_mapping), list(third.changed_block_id), list(third.num_tokens)) == (
        [6, 7], [], [4])
    assert reply.free_blocks == 16 - 3 == daemon.service.free_blocks
    # Its third field: the tokens committed (the first entry's commit: alice's 4, none of bob's).
    mine = await stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=alice, seq_ids=[1]))
    theirs = await stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=bob, seq_ids=[1]))
    assert [(list(t.block_ids), t.num_tokens, t.num_cached_tokens)
            for t in (*mine.tables, *theirs.tables)] == [([0, 2], 5, 4), ([1], 4, 0)]


async def test_step_many_refused_as_a_whole(stub: Stub) -> None:
    """Too many entries, or envelopes past max_answer_bytes: the whole call is refused before
    any entry is applied."""
    sid = await open_session(stub)
    await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=1))
    step = pb.StepRequest(session_id=sid, seq_ids=[1])
    await expect(Code.INVALID_ARGUMENT, stub.StepMany(pb.StepManyRequest(steps=[step] * 257)),
                 "257 steps in one request; the limit is max_steps_per_call=256")
    tables = await stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid, seq_ids=[1]))
    assert tables.tables[0].num_tokens == 1
    reply = await stub.StepMany(pb.StepManyRequest())
    assert not reply.results


async def test_step_many_shares_one_answer_budget() -> None:
    """The entries' answers share max_answer_bytes: the envelopes are charged first (all or the
    call is refused), then each entry's Step answer as it is applied, and an entry whose answer
    no longer fits fails alone (AnswerTooLarge) while the others are applied."""
    async with running_daemon(num_blocks=4096, block_size=4,
                              limits=Limits(max_answer_bytes=4096)) as running, \
            grpc.aio.insecure_channel(running.unix_target) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        sid = await open_session(stub)
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=1))
        fits = (4096 - STEP_MANY_FIXED) // STEP_MANY_ENTRY
        await expect(Code.RESOURCE_EXHAUSTED, stub.StepMany(pb.StepManyRequest(
            steps=[pb.StepRequest(session_id=sid, seq_ids=[1])] * (fits + 1))),
            "the limit is max_answer_bytes=4096", cause="AnswerTooLarge")
        # Room left after 2 envelopes: about 3,450 bytes. A Step of 600 tokens is charged about
        # 2,000 (a 2-byte slot per token, a new 2-byte block id per 4 tokens): once, not twice.
        big = pb.StepRequest(session_id=sid, seq_ids=[1], num_tokens=600)
        reply = await stub.StepMany(pb.StepManyRequest(steps=[big, big]))
        assert [(r.code, r.cause) for r in reply.results] == [
            (0, ""), (Code.RESOURCE_EXHAUSTED.value[0], "AnswerTooLarge")]
        assert "max_answer_bytes=4096" in reply.results[1].message
        assert reply.results[0].step.num_tokens == [601]
        assert reply.ByteSize() <= 4096
        running.service.check_invariants()


async def test_a_failed_step_many_entry_gives_its_answer_charge_back() -> None:
    """An entry that fails after its Step answer was charged (here: the pool has no room) gives
    the charge back, since its answer is its status, charged with the envelope: a later entry
    that fits only without that charge is applied."""
    first, second = 600, 440  # tokens of each entry's step (150 and 110 new blocks)
    spent = AnswerBudget.for_pool(4096, 1000, 4)
    spent.step_many(2)
    spent.step(1, first, 4)
    with pytest.raises(AnswerTooLarge):  # kept, the failed entry's charge would refuse the next
        spent.step(1, second, 4)
    async with running_daemon(num_blocks=1000, block_size=4,
                              limits=Limits(max_answer_bytes=4096)) as running, \
            grpc.aio.insecure_channel(running.unix_target) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        other, sid = await open_session(stub), await open_session(stub)
        for seq_id in range(4):  # 880 blocks held elsewhere: 119 free once seq 1 takes one
            await stub.Allocate(pb.AllocateRequest(session_id=other, seq_id=seq_id,
                                                   num_tokens=880))
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=1))
        reply = await stub.StepMany(pb.StepManyRequest(steps=[
            pb.StepRequest(session_id=sid, seq_ids=[1], num_tokens=n) for n in (first, second)]))
        assert [(r.code, r.cause) for r in reply.results] == [
            (Code.RESOURCE_EXHAUSTED.value[0], "PoolExhausted"), (0, "")]
        assert reply.results[1].step.num_tokens == [1 + second]
        running.service.check_invariants()
