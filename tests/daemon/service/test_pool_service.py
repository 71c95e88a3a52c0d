"""PoolService without gRPC: exact block ids on a tiny pool, tenancy, quotas, all-or-nothing.

Pool: 8 blocks of 4 slots unless a test says otherwise. Fresh blocks come out in id order.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_service import make_service, snapshot

from pagedkv.daemon.core import InvalidArgument, SequenceExists, SequenceNotFound
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.service.errors import PoolExhausted
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.operations import (
    Allocate,
    Append,
    Commit,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
)
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY


@pytest.fixture
def service() -> PoolService:
    return make_service()


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[KVPoolMemory]:
    with KVPoolMemory.create(TINY_CPU_GEOMETRY, 8, 4, "float32", shm_dir=str(tmp_path)) as mem:
        yield mem


async def test_operations_exact_blocks_and_session_stats(service: PoolService) -> None:
    sid = service.open_session("a").session_id
    update = await service.allocate(sid, Allocate(1, 6, list(range(6))))
    assert (update.block_table, update.slot_mapping) == ([0, 1], [0, 1, 2, 3, 4, 5])
    assert (await service.append(sid, Append(1, 3))).slot_mapping == [6, 7, 8]  # fills 1, opens 2
    assert (await service.fork(sid, Fork(1, 2))).block_table == [0, 1, 2]
    cow = await service.copy_on_write(sid, CopyOnWrite(2, 2))
    assert cow.block_table == [0, 1, 3] and [(c.src, c.dst) for c in cow.copies] == [(2, 3)]
    stats = service.stats_of(sid)
    assert (stats.num_sequences, stats.block_table_entries, stats.blocks_held) == (2, 6, 4)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (6, 0)
    assert await service.free(sid, Free(2)) == 1  # only block 3 was private to seq 2
    assert (await service.block_tables(sid, [1]))[0].block_table == [0, 1, 2]
    service.check_invariants()
    assert await service.close_session(sid) == 1
    assert service.pool_stats().used_blocks == 0
    service.check_invariants()


async def test_sessions_cannot_touch_each_others_sequences(service: PoolService) -> None:
    a = service.open_session("a").session_id
    b = service.open_session("b").session_id
    await service.allocate(a, Allocate(1, 4))
    before = snapshot(service)
    for attempt in (lambda: service.append(b, Append(1, 1)), lambda: service.free(b, Free(1)),
                    lambda: service.fork(b, Fork(1, 2)), lambda: service.block_tables(b, [1]),
                    lambda: service.copy_on_write(b, CopyOnWrite(1, 0)),
                    lambda: service.step(b, [1])):
        with pytest.raises(SequenceNotFound, match="not found in this session"):
            await attempt()
    assert snapshot(service) == before
    # The same seq id is free to use in another session.
    assert (await service.allocate(b, Allocate(1, 4))).block_table == [1]
    service.check_invariants()


    sid = service.open_session("a", max_blocks=3).session_id
    await service.allocate(sid, Allocate(1, 8))  # 2 entries
    before = snapshot(service)
    for attempt in (lambda: service.allocate(sid, Allocate(2, 5)),
                    lambda: service.fork(sid, Fork(1, 2)),
                    lambda: service.append(sid, Append(1, 5)),
                    lambda: service.step(sid, [1], num_tokens=5)):
        with pytest.raises(PoolExhausted, match="max_blocks=3"):
            await attempt()
    assert snapshot(service) == before
    await service.append(sid, Append(1, 4))  # exactly the third entry
    assert service.stats_of(sid).block_table_entries == 3
    service.check_invariants()


async def test_pool_full_says_needed_and_available(service: PoolService) -> None:
    sid = service.open_session("a").session_id
    await service.allocate(sid, Allocate(1, 24))  # 6 of 8 blocks
    before = snapshot(service)
    with pytest.raises(PoolExhausted, match="needs 3 blocks, 2 available"):
        await service.allocate(sid, Allocate(2, 12))
    assert snapshot(service) == before


@pytest.mark.parametrize("bad_third_op", [
    Append(99, 1),                  # unknown sequence
    Allocate(1, 4),                 # seq id in use
    Allocate(3, 64),                # pool full
    CopyOnWrite(1, 9),              # logical block out of range
    Append(1, -2),                  # negative count
])
async def test_batch_is_all_or_nothing(service: PoolService, bad_third_op: Operation) -> None:
    sid = service.open_session("a").session_id
    await service.allocate(sid, Allocate(1, 6))
    await service.fork(sid, Fork(1, 5))
    before = snapshot(service)
    ops: list[Operation] = [Allocate(2, 3), CopyOnWrite(5, 1), bad_third_op, Free(1)]
    with pytest.raises(Exception, match=r"^op 2 \(") as failure:
        await service.batch(sid, ops)
    assert isinstance(failure.value, InvalidArgument | SequenceNotFound | SequenceExists
                      | PoolExhausted)
    assert snapshot(service) == before
    service.check_invariants()


async def test_batch_results_and_memory_work_in_order(memory: KVPoolMemory) -> None:
    service = make_service(memory=memory)
    sid = service.open_session("a").session_id
    await service.allocate(sid, Allocate(1, 6))
    await service.fork(sid, Fork(1, 2))
    memory.kv[1] = 7.0
    results = await service.batch(sid, [CopyOnWrite(2, 1), Free(1), Append(2, 1), Allocate(3, 2)])
    assert [r.block_table for r in results] == [[0, 2], [], [0, 2], [3]]
    assert [(c.src, c.dst) for c in results[0].copies] == [(1, 2)]
    assert bool((memory.kv[2] == 7.0).all())
    service.check_invariants()


async def test_copy_on_write_copies_pool_memory(memory: KVPoolMemory) -> None:
    service = make_service(memory=memory)
    sid = service.open_session("a").session_id
    await service.allocate(sid, Allocate(1, 6))
    await service.fork(sid, Fork(1, 2))
    pattern = torch.arange(memory.kv[1].numel(), dtype=torch.float32)
    memory.kv[1] = pattern.view_as(memory.kv[1])
    step = await service.step(sid, [2])  # seq 2 writes into shared, half-full block 1
    assert [(c.src, c.dst) for c in step.copies] == [(1, 2)]
    assert torch.equal(memory.kv[2], memory.kv[1])
    service.check_invariants()


@pytest.mark.parametrize("zero", [False, True])
async def test_zero_freed_blocks(memory: KVPoolMemory, zero: bool) -> None:
    service = make_service(memory=memory, zero_freed_blocks=zero)
    sid = service.open_session("a").session_id
    await service.allocate(sid, Allocate(1, 6))
    memory.kv[0:2] = 3.0
    await service.free(sid, Free(1))
    assert bool((memory.kv[0:2] == 0).all()) is zero
    assert bool((memory.kv[0:2] == 3.0).all()) is not zero


async def test_step_happy_path_and_failures_change_nothing(service: PoolService) -> None:
    sid = service.open_session("a").session_id
    for seq_id in (1, 2, 3):
        await service.allocate(sid, Allocate(seq_id, 3))  # blocks 0, 1, 2
    result = await service.step(sid, [3, 1, 2], 2, [1, 2, 3, 4, 5, 6])
    # Each crosses into a new block, handed out in request order: 3 gets 3, 1 gets 4, 2 gets 5.
    assert result.slot_mapping.tolist() == [11, 12, 3, 16, 7, 20]
    assert result.changed_seq_index.tolist() == [0, 1, 2]
    assert result.changed_logical_block.tolist() == [1, 1, 1]
    assert result.changed_block_id.tolist() == [3, 4, 5]
    service.check_invariants()
    before = snapshot(service)
    failures: list[tuple[Any, type[Exception], str]] = [
        (lambda: service.step(sid, []), InvalidArgument, "at least one"),
        (lambda: service.step(sid, [1, 9]), SequenceNotFound, r"\[9\]"),
        (lambda: service.step(sid, [1, 1]), InvalidArgument, "more than once"),
        (lambda: service.step(sid, [1, 2], 1, [5]), InvalidArgument, "1 token_ids"),
        (lambda: service.step(sid, [1], 0), InvalidArgument, "num_tokens"),
        (lambda: service.step(sid, [1, 2, 3], 8), PoolExhausted, "pool full"),
    ]
    for attempt, kind, message in failures:
        with pytest.raises(kind, match=message):
            await attempt()
        assert snapshot(service) == before


async def test_invalid_arguments_name_the_problem(service: PoolService) -> None:
    sid = service.open_session("a").session_id
    with pytest.raises(InvalidArgument, match="num_tokens must be >= 0"):
        await service.allocate(sid, Allocate(1, -1))
    with pytest.raises(InvalidArgument, match="2 token_ids given for num_tokens=3"):
        await service.allocate(sid, Allocate(1, 3, [1, 2]))
    await service.allocate(sid, Allocate(1, 3))
    with pytest.raises(InvalidArgument, match="outside the 1 blocks"):
        await service.copy_on_write(sid, CopyOnWrite(1, 1))
    with pytest.raises(InvalidArgument, match="no seq_ids"):
        await service.block_tables(sid, [])
    with pytest.raises(InvalidArgument, match="at least one op"):
        await service.batch(sid, [])
    with pytest.raises(SequenceExists):
        await service.allocate(sid, Allocate(1, 3))
    assert service.stats_of(sid).num_sequences == 1


async def test_request_limits_name_the_limit() -> None:
    service = make_service(limits=Limits(max_batch_ops=2, max_seq_ids=2, max_tokens=8))
    sid = service.open_session("a").session_id
    with pytest.raises(InvalidArgument, match="3 ops in one request; the limit is max_batch_ops=2"):
        await service.batch(sid, [Allocate(1, 1), Allocate(2, 1), Allocate(3, 1)])
    with pytest.raises(InvalidArgument, match="the limit is max_seq_ids=2"):
        await service.step(sid, [1, 2, 3])
    with pytest.raises(InvalidArgument, match="9 tokens in one request; the limit is max_tokens=8"):
        await service.allocate(sid, Allocate(1, 9))
    assert len(service.pool) == 0


# ----------------------------------------------------------- random sequences

_seq = st.integers(0, 5)
_ops = st.one_of(
    st.builds(Allocate, _seq, st.integers(0, 9), st.just(())),
    st.builds(lambda q, n: Allocate(q, n, [7] * n), _seq, st.integers(0, 9)),
    st.builds(Append, _seq, st.integers(1, 6)),
    st.builds(Fork, _seq, _seq),
    st.builds(CopyOnWrite, _seq, st.integers(0, 3)),
    st.builds(lambda q: Commit([q]), _seq),
    st.builds(Free, _seq),
)


@pytest.mark.parametrize("host_slots", [0, 6])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(_ops, min_size=1, max_size=3)),
                max_size=25))
async def test_random_operations_keep_sessions_and_pool_consistent(
        host_slots: int, script: list[tuple[int, list[Operation]]]) -> None:
    """check_invariants also recounts the figures the pool keeps as it goes (pool stats, each
    session's and tenant's blocks_held): b and c share cached blocks (same salt). With a host
    tier (bookkeeping only), evicted blocks are copied and restored, and its records too are
    checked after every call and left as they were by a refused one."""
    service = make_service(num_blocks=12, block_size=2)
    if host_slots:
        service.attach_host_tier(None, host_slots)
    sids = [service.open_session("a", max_blocks=10).session_id,
            service.open_session("b", cache_salt=b"s").session_id,
            service.open_session("c", cache_salt=b"s").session_id]
    for index, ops in script:
        sid = sids[index]
        before = snapshot(service)
        try:
            await service.batch(sid, ops)
        except (InvalidArgument, SequenceNotFound, SequenceExists, PoolExhausted):
            assert snapshot(service) == before
        service.check_invariants()


async def test_step_commit_and_expiry_decide_what_is_shareable() -> None:
    now = [0.0]
    service = make_service(clock=lambda: now[0])
    team = [service.open_session(n, cache_salt=b"team", lease_ttl_ms=ttl).session_id
            for n, ttl in (("t", 300), ("u", 10_000))]
    prompt = list(range(100, 107))  # one full block and three tokens
    await service.allocate(team[0], Allocate(1, 7, prompt))
    await service.step(team[0], [1], 1, [107], commit=True)  # prefill computed: block 0 shared
    await service.step(team[0], [1], 1, [108])  # fills block 1; the next forward is not done
    assert service.pool_stats().pending_blocks == 1
    now[0] += 0.301  # team[0]'s client died before computing it
    assert await service.expire_due() == 1
    hit = await service.allocate(team[1], Allocate(1, 9, [*prompt, 107, 108]))
    assert hit.num_cached_tokens == 4  # block 0 only: block 1's K/V was never certified
    assert service.pool_stats().pending_blocks == 1  # team[1]'s own block 1, now pending
    service.check_invariants()
