"""pagedkv.client against a real in-process daemon: typed results, exceptions, keep-alive errors.

Leases end to end are in test_client_process.py, TCP auth in
tests/daemon/edge/test_interceptors.py.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from pagedkv.client import (
    Allocate,
    AnswerTooLarge,
    Append,
    BlockCopy,
    CopyOnWrite,
    DaemonUnavailable,
    Fork,
    Free,
    InvalidArgument,
    PagedKVError,
    PoolClient,
    PoolExhausted,
    SequenceBlocks,
    SequenceExists,
    SequenceNotFound,
    SessionNotFound,
)
from pagedkv.daemon.edge.servicer import KVPoolServicer
from pagedkv.daemon.service.limits import Limits

from daemon_harness import Daemon, running_daemon


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon() as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target, timeout=2.0) as connected:
        yield connected


async def test_typed_results_for_every_call(daemon: Daemon, client: PoolClient) -> None:
    info = await client.pool_info()
    assert (info.pool_id, info.num_blocks, info.block_size, info.model) == (
        daemon.service.pool_id, 16, 4, "tiny")
    async with await client.open_session("typed") as session:
        assert session.pool_id == info.pool_id and session.block_size == 4
        seq = await session.allocate(1, token_ids=[5, 6, 7, 8, 9])
        assert seq == SequenceBlocks(1, [0, 1], 5, 0, [0, 1, 2, 3, 4], [])
        assert (await session.append(1)).slot_mapping == [5]
        assert (await session.fork(1, 2)).block_ids == [0, 1]
        cow = await session.copy_on_write(2, 1)
        assert (cow.block_ids, cow.copies) == ([0, 2], [BlockCopy(1, 2)])
        step = await session.step([1, 2], token_ids=[10, 11])
        assert (step.slot_mapping, step.copies) == ([6, 10], [])
        tables = await session.block_tables([2, 1])
        assert [(t.seq_id, t.block_ids, t.num_tokens) for t in tables] == [
            (2, [0, 2], 7), (1, [0, 1], 7)]
        results = await session.batch([Allocate(3, 2), Fork(3, 4), Append(4, 3),
                                       CopyOnWrite(3, 0), Free(1)])
        assert [r.seq_id for r in results] == [3, 4, 4, 3, 1]
        assert results[2].copies == [BlockCopy(3, 4)] and results[4].block_ids == []
        stats = await session.stats()
        assert stats.session is not None
        assert (stats.session.name, stats.session.num_sequences) == ("typed#1", 3)
        assert (stats.num_blocks, stats.free_blocks) == (16, 11)
        assert (await client.stats()).session is None
        # Block 0 was keyed pending and never committed: it goes back to the free list too.
        assert await session.free(2) == 2
        assert await session.keep_alive() == 10_000
    assert daemon.pool.stats().used_blocks == 0


async def test_block_tables_give_the_token_ids_the_daemon_holds(client: PoolClient) -> None:
    """Every id (cached blocks', pending blocks', the partial block's), across forks and
    appends; none for a sequence one of whose tokens came without an id."""
    async with await client.open_session("ids") as session:
        await session.allocate(1, token_ids=[5, 6, 7, 8, 9, 10])
        await session.commit([1])
        await session.allocate(2, token_ids=[5, 6, 7, 8, 1])  # hits the committed block 0
        await session.fork(2, 3)
        await session.step([2, 3], token_ids=[2, 3])
        await session.append(2, token_ids=[4, 4])
        await session.allocate(4, token_ids=[9, 9])
        await session.append(4)  # no id: the daemon no longer knows them all
        tables = await session.block_tables([1, 2, 3, 4], token_ids=True)
        assert [t.token_ids for t in tables] == [
            [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 1, 2, 4, 4], [5, 6, 7, 8, 1, 3], []]
        assert [t.num_cached_tokens for t in tables] == [4, 4, 4, 0]
        assert [t.token_ids for t in await session.block_tables([1, 2])] == [[], []]


async def test_token_ids_are_charged_in_the_answer_budget_before_it_is_built() -> None:
    """500 ids at up to ten bytes each pass a 4,096-byte answer limit: refused (AnswerTooLarge,
    nothing built); the same table without ids fits."""
    async with running_daemon(num_blocks=128, limits=Limits(max_answer_bytes=4096)) as daemon, \
            await PoolClient.connect(daemon.unix_target) as connected, \
            await connected.open_session("budget") as session:
        await session.allocate(1, token_ids=[3] * 500)
        assert (await session.block_tables([1]))[0].num_tokens == 500
        with pytest.raises(AnswerTooLarge, match="max_answer_bytes=4096"):
            await session.block_tables([1], token_ids=True)


async def test_errors_are_named_after_the_cause(client: PoolClient) -> None:
    session = await client.open_session("errors", max_blocks=3)
    await session.allocate(1, 4)
    failures: list[tuple[Callable[[], Awaitable[Any]], type[PagedKVError], grpc.StatusCode]] = [
        (lambda: session.append(9), SequenceNotFound, grpc.StatusCode.NOT_FOUND),
        (lambda: session.allocate(1, 1), SequenceExists, grpc.StatusCode.ALREADY_EXISTS),
        (lambda: session.allocate(2, 3, [1]), InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: session.allocate(-1, 1), InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: session.allocate(2, 40), PoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (lambda: session.step([]), InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for call, kind, code in failures:
        with pytest.raises(kind) as failure:
            await call()
        assert failure.value.code == code and failure.value.message
    await session.close()
    with pytest.raises(SessionNotFound, match="unknown session"):
        await session.allocate(5, 1)
    assert await session.close() == 0  # idempotent


async def test_cache_salt_decides_prefix_sharing(client: PoolClient) -> None:
    """The service-level isolation test; the core's exact one is in
    tests/daemon/core/test_block_pool.py."""
    prompt = list(range(40, 48))  # two full blocks
    first = await client.open_session("a", cache_salt="tenant-1")
    same = await client.open_session("b", cache_salt=b"tenant-1")
    other = await client.open_session("c", cache_salt="tenant-2")
    # No salt: each session gets its own, so these two share with nobody, not even each other.
    defaults = [await client.open_session(name) for name in ("d", "e")]
    owner = await first.allocate(1, token_ids=prompt)
    assert await first.commit([1]) == 2  # its K/V is written: the two full blocks are shared
    shared = await same.allocate(1, token_ids=prompt)
    assert (shared.num_cached_tokens, shared.block_ids) == (8, owner.block_ids)
    taken = set(owner.block_ids)
    for session in (other, *defaults):
        alone = await session.allocate(1, token_ids=prompt)
        assert alone.num_cached_tokens == 0
        assert not set(alone.block_ids) & taken
        taken |= set(alone.block_ids)
        assert await session.commit([1]) == 2  # shareable now, yet only under its own salt
    stats = await same.stats()
    assert stats.session is not None and stats.session.prefix_cache_hits == 8
    for session in (first, same, other, *defaults):
        await session.close()


async def test_keep_alive_records_a_lost_lease(daemon: Daemon, client: PoolClient) -> None:
    session = await client.open_session("lost", lease_ttl_ms=150)
    await daemon.service.close_session(session.session_id)  # the daemon forgets it behind our back
    for _ in range(40):
        await asyncio.sleep(0.025)
        if session.lease_error is not None:
            break
    assert isinstance(session.lease_error, SessionNotFound)
    await session.close()


async def test_connect_to_nothing_is_unavailable(tmp_path: Any) -> None:
    with pytest.raises(DaemonUnavailable, match="no pagedkv daemon"):
        await PoolClient.connect(f"unix:{tmp_path}/absent.sock", timeout=0.3)


async def test_every_call_has_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    get_stats = KVPoolServicer.GetStats

    async def slow_stats(self: KVPoolServicer, request: Any, context: Any) -> Any:
        await asyncio.sleep(0.5)  # past the client's deadline
        return await get_stats(self, request, context)

    monkeypatch.setattr(KVPoolServicer, "GetStats", slow_stats)  # before the server binds it
    async with running_daemon() as slow, \
            await PoolClient.connect(slow.unix_target, timeout=0.2) as client:
        with pytest.raises(PagedKVError) as failure:
            await client.stats()
        assert failure.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (await client.pool_info()).num_blocks == 16
