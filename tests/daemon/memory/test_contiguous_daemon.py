"""A daemon serving the contiguous baseline (`pagedkvd --allocator contiguous`) over gRPC.

Pool: 14 blocks of 4 slots with real (CPU) memory, max_model_len 16: each sequence reserves 4
blocks, three reservations fit (at blocks 0, 4, 8) and the last 2 blocks strand, so a client
sees free_blocks = 12 on an empty pool.
"""

from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
import torch

from pagedkv.client import (
    Allocate,
    Append,
    Commit,
    Fork,
    Free,
    InvalidArgument,
    PagedKVError,
    PoolClient,
    PoolExhausted,
    Session,
)
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.memory import PoolMemoryHandle

from daemon_harness import Daemon, running_daemon

RESERVATION = 4


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=14, block_size=4, with_memory=True,
                              allocator="contiguous", max_model_len=16) as running:
        yield running


async def free_blocks(session: Session) -> int:
    return (await session.stats()).free_blocks


async def test_every_call_a_client_makes_is_served_in_reservations(
        daemon: Daemon, session: Session) -> None:
    assert await free_blocks(session) == 12
    a = await session.allocate(1, token_ids=[5, 6, 7, 8, 9])
    assert (a.block_ids, a.slot_mapping, a.num_cached_tokens) == ([0, 1], [0, 1, 2, 3, 4], 0)
    assert (await session.append(1, token_ids=[10])).slot_mapping == [5]
    b = await session.allocate(2, num_tokens=1)
    assert b.block_ids == [4]
    step = await session.step([1, 2], [11, 12], num_tokens=1, commit=True)
    assert (step.slot_mapping, step.num_tokens) == ([6, 17], [7, 2])
    assert (step.changed_block_id, step.copies) == ([], [])
    daemon.service.check_invariants()
    # A 1-token sequence holds its whole reservation: 4 blocks charged, 4 held.
    stats = await session.stats()
    assert stats.free_blocks == 12 - 2 * RESERVATION
    assert stats.session is not None
    assert (stats.session.block_table_entries, stats.session.blocks_held) == (8, 8)
    assert daemon.registry.get_sample_value("pagedkv:free_blocks") == 4
    assert daemon.registry.get_sample_value("pagedkv:used_blocks") == 8
    assert [t.block_ids for t in await session.block_tables([1, 2])] == [[0, 1], [4]]
    assert await session.free(2) == RESERVATION
    assert await session.commit([1]) == 0
    daemon.service.check_invariants()


async def test_a_fork_copies_the_parents_kv_before_the_answer(
        daemon: Daemon, session: Session) -> None:
    assert daemon.memory is not None
    kv = daemon.memory.kv  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    await session.allocate(1, num_tokens=6)
    kv[0:2] = torch.arange(2, dtype=kv.dtype)[:, None, None, None, None, None]  # blocks 0, 1 differ
    child = await session.fork(1, 2)
    assert child.block_ids == [4, 5]
    assert [(c.src, c.dst) for c in child.copies] == [(0, 4), (1, 5)]
    assert torch.equal(kv[4:6], kv[0:2])
    assert (await session.append(2, num_tokens=1)).slot_mapping == [22]  # its own blocks
    daemon.service.check_invariants()


class BrokenMemory:
    """Pool memory whose copies fail, as after a device error."""

    def __init__(self, inner: KVPoolMemory) -> None:
        self.inner = inner

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int], /) -> None:
        raise RuntimeError("copy failed: device lost")

    def zero_blocks(self, ids: Sequence[int], /) -> None:
        self.inner.zero_blocks(ids)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def handle(self) -> PoolMemoryHandle:
        return self.inner.handle()


async def test_a_fork_whose_copies_fail_stops_the_pool(daemon: Daemon,
                                                      client: PoolClient) -> None:
    assert daemon.memory is not None
    session = await client.open_session("stopped")  # never closed: the pool refuses it
    await session.allocate(1, num_tokens=6)
    daemon.service.memory = BrokenMemory(daemon.memory)
    with pytest.raises(PagedKVError) as failure:
        await session.fork(1, 2)
    assert failure.value.code == grpc.StatusCode.INTERNAL
    daemon.service.check_invariants()  # applied: the copy's content is what is unknown
    daemon.service.memory = daemon.memory  # the device is back, the pool stays stopped
    with pytest.raises(PagedKVError) as refused:
        await session.allocate(3, num_tokens=1)
    assert refused.value.code == grpc.StatusCode.INTERNAL


async def test_refusals_name_their_cause_and_change_nothing(
        daemon: Daemon, session: Session) -> None:
    await session.batch([Allocate(1, num_tokens=15), Allocate(2, num_tokens=1),
                         Allocate(3, num_tokens=1)])
    before = [(t.block_ids, t.num_tokens) for t in await session.block_tables([1, 2, 3])]
    # Blocks 12 and 13 are free, but no run holds a reservation.
    with pytest.raises(PoolExhausted, match="needs 4 blocks, 2 available"):
        await session.allocate(4, num_tokens=1)
    with pytest.raises(InvalidArgument, match="max_model_len=16"):
        await session.append(1, num_tokens=2)
    # A Batch whose last op fails undoes the free, the fork and the append before it.
    with pytest.raises(InvalidArgument, match=r"op 3 .*max_model_len=16"):
        await session.batch([Free(3), Fork(2, 5), Append(5, num_tokens=3),
                             Append(1, num_tokens=2)])
    assert [(t.block_ids, t.num_tokens) for t in await session.block_tables([1, 2, 3])] == before
    assert await free_blocks(session) == 0
    daemon.service.check_invariants()
    await session.batch([Commit([1]), Free(1)])
    assert (await session.allocate(4, num_tokens=1)).block_ids == [0]
    daemon.service.check_invariants()


async def test_quotas_count_reservations_and_a_closed_session_frees_them(
        daemon: Daemon, client: PoolClient) -> None:
    async with await client.open_session("quota", max_blocks=RESERVATION) as small:
        await small.allocate(1, num_tokens=1)
        with pytest.raises(PoolExhausted, match="session quota"):
            await small.allocate(2, num_tokens=1)
        with pytest.raises(PoolExhausted, match="session quota"):
            await small.fork(1, 2)
        assert (await small.append(1, num_tokens=15)).block_ids == [0, 1, 2, 3]
        assert await free_blocks(small) == 8
    daemon.service.check_invariants()
    async with await client.open_session("after") as other:
        assert await free_blocks(other) == 12
