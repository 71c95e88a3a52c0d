"""The host tier at the service, over real memory: the bytes a restore brings back, the order of
copies, private sessions, models, events and all-or-nothing (daemon/service/host_copies.py).

Pool: 4 blocks of 4 slots of the tiny geometry in float32, in shared memory; a host tier of 4
slots. Block b's K/V is filled with b + 1 (and later values) by the test, standing in for a
runner's writes.
"""

import asyncio
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.daemon.core import BlockPool, PoolError
from pagedkv.daemon.events.sink import MEDIUM_CPU, MEDIUM_GPU, StoredBlock
from pagedkv.daemon.memory.host_memory import HostMemory
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.service.models import KvShape
from pagedkv.daemon.service.operations import Allocate, Commit, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.tenants import Tenants
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

BLOCK = 4
PREFIX = list(range(8))  # two full blocks
OTHER = [100 + i for i in range(16)]  # four blocks: evicts the whole pool's cache


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[KVPoolMemory]:
    with KVPoolMemory.create(TINY_CPU_GEOMETRY, 4, BLOCK, "float32",
                             shm_dir=str(tmp_path)) as mem:
        yield mem


@pytest.fixture
def host(memory: KVPoolMemory, tmp_path: Path) -> Iterator[HostMemory]:
    host = HostMemory.create(4, memory, shm_dir=str(tmp_path))
    yield host
    host.close()


def make_service(memory: KVPoolMemory, host: HostMemory, **options: Any) -> PoolService:
    svc = PoolService(BlockPool(4, BLOCK), memory, pool_id="p", geometry=TINY_CPU_GEOMETRY,
                      **options)
    svc.attach_host_tier(host, copy_rate=1)
    return svc


def write(memory: KVPoolMemory, blocks: Sequence[int], base: float) -> None:
    """What a runner's forward would do: fill each block with base + its position."""
    for i, block in enumerate(blocks):
        memory.kv[block].fill_(base + i)


def values(memory: KVPoolMemory, blocks: Sequence[int]) -> list[float]:
    """Each block's value, checking that the block holds one value throughout."""
    out = []
    for block in blocks:
        data = memory.kv[block]
        assert bool((data == data.flatten()[0]).all()), f"block {block} is mixed"
        out.append(float(data.flatten()[0]))
    return out


async def cache_prefix(svc: PoolService, memory: KVPoolMemory, sid: str, seq: int,
                       tokens: list[int], base: float) -> list[int]:
    """Allocate, 'compute', commit and free a prompt: its blocks stay cached."""
    table = (await svc.allocate(sid, Allocate(seq, len(tokens), tokens))).block_table
    write(memory, table, base)
    await svc.commit(sid, Commit([seq]))
    await svc.free(sid, Free(seq))
    return table


async def evict_all(svc: PoolService, memory: KVPoolMemory, sid: str, seq: int) -> None:
    """Another prompt takes every block: the cached ones go to the host tier."""
    table = (await svc.allocate(sid, Allocate(seq, len(OTHER), OTHER))).block_table
    write(memory, table, 50.0)
    await svc.free(sid, Free(seq))


async def test_a_restore_brings_back_the_evicted_bytes(memory: KVPoolMemory,
                                                       host: HostMemory) -> None:
    svc = make_service(memory, host)
    sid = svc.open_session("a", cache_salt=b"shared").session_id
    assert await cache_prefix(svc, memory, sid, 1, PREFIX, 1.0) == [0, 1]  # values 1, 2
    await evict_all(svc, memory, sid, 2)  # blocks 0, 1 now hold 50-something
    assert values(memory, [0, 1]) != [1.0, 2.0]
    got = await svc.allocate(sid, Allocate(3, 9, [*PREFIX, 7]))
    assert got.num_cached_tokens == 8
    assert values(memory, got.block_table[:2]) == [1.0, 2.0]  # restored, in chain order
    tier = svc.host_tier
    assert tier is not None and (tier.stores, tier.restores) == (2, 2)
    svc.check_invariants()


async def test_skip_host_tier_recomputes(memory: KVPoolMemory, host: HostMemory) -> None:
    svc = make_service(memory, host)
    sid = svc.open_session("a", cache_salt=b"shared").session_id
    await cache_prefix(svc, memory, sid, 1, PREFIX, 1.0)
    await evict_all(svc, memory, sid, 2)
    got = await svc.allocate(sid, Allocate(3, 9, [*PREFIX, 7], skip_host_tier=True))
    assert got.num_cached_tokens == 0
    svc.check_invariants()


async def test_a_copy_still_being_made_is_waited_for_by_the_restore(tmp_path: Path) -> None:
    """The offload of an evicting call runs slowly; a restore of the same slots into other
    blocks (no work pending on them), asked while it runs, is ordered after it by slot and
    brings back the right bytes. Pool: 6 blocks."""
    with KVPoolMemory.create(TINY_CPU_GEOMETRY, 6, BLOCK, "float32",
                             shm_dir=str(tmp_path)) as memory:
        host = HostMemory.create(4, memory, shm_dir=str(tmp_path))
        svc = PoolService(BlockPool(6, BLOCK), memory, pool_id="p", geometry=TINY_CPU_GEOMETRY)
        svc.attach_host_tier(host, copy_rate=1)
        sid = svc.open_session("a", cache_salt=b"shared").session_id
        assert await cache_prefix(svc, memory, sid, 1, PREFIX, 1.0) == [0, 1]
        other = svc.open_session("b", cache_salt=b"shared").session_id
        assert (await svc.allocate(other, Allocate(2, 16, OTHER))).block_table == [2, 3, 4, 5]
        slow_to_host = host.to_host

        def to_host(blocks: Sequence[int], slots: Sequence[int]) -> None:
            time.sleep(0.3)
            slow_to_host(blocks, slots)

        host.to_host = to_host  # type: ignore[method-assign]
        evicting = asyncio.ensure_future(svc.allocate(other, Allocate(3, 8, [9] * 8)))
        await asyncio.sleep(0.05)  # applied: blocks 1, 0 evicted, their copy running
        assert not evicting.done()
        await svc.free(other, Free(2))  # never committed: 2..5 free, no work on them
        got = await svc.allocate(sid, Allocate(4, 8, PREFIX))
        assert set(got.block_table) <= {2, 3, 4, 5} and got.num_cached_tokens == 8
        assert values(memory, got.block_table) == [1.0, 2.0]
        await evicting
        host.close()


async def test_a_private_sessions_copies_go_when_it_ends_zeroed(memory: KVPoolMemory,
                                                                host: HostMemory) -> None:
    svc = make_service(memory, host, zero_freed_blocks=True)
    private = svc.open_session("private").session_id  # no salt: its own
    await cache_prefix(svc, memory, private, 1, PREFIX, 1.0)
    other = svc.open_session("other", cache_salt=b"shared").session_id
    await evict_all(svc, memory, other, 2)
    tier = svc.host_tier
    assert tier is not None and tier.num_held == 2
    slots = sorted(tier.slot_of.values())
    assert all(bool((host.slots[s] != 0).any()) for s in slots)
    await svc.close_session(private)
    assert tier.num_held == 0
    assert all(bool((host.slots[s] == 0).all()) for s in slots)  # zeroed
    svc.check_invariants()


async def test_another_salt_never_hits_a_copy(memory: KVPoolMemory, host: HostMemory) -> None:
    svc = make_service(memory, host)
    a = svc.open_session("a", cache_salt=b"salt-a").session_id
    await cache_prefix(svc, memory, a, 1, PREFIX, 1.0)
    await evict_all(svc, memory, a, 2)
    b = svc.open_session("b", cache_salt=b"salt-b").session_id
    assert (await svc.allocate(b, Allocate(1, 8, PREFIX))).num_cached_tokens == 0
    assert (await svc.allocate(a, Allocate(3, 8, PREFIX))).num_cached_tokens == 8


async def test_a_refused_call_leaves_the_tier_and_the_host_memory_as_they_were(
        memory: KVPoolMemory, host: HostMemory) -> None:
    """A Batch whose last op fails evicts (and would copy) nothing at all."""
    svc = make_service(memory, host)
    sid = svc.open_session("a", cache_salt=b"shared").session_id
    await cache_prefix(svc, memory, sid, 1, PREFIX, 1.0)
    tier = svc.host_tier
    assert tier is not None
    before = host.slots.clone()
    with pytest.raises(PoolError):
        await svc.batch(sid, [Allocate(2, 16, OTHER), Allocate(2, 4, [1, 2, 3, 4])])  # exists
    assert (tier.num_held, tier.stores) == (0, 0) and torch.equal(host.slots, before)
    assert (await svc.allocate(sid, Allocate(3, 8, PREFIX))).num_cached_tokens == 8  # in pool
    svc.check_invariants()


async def test_a_sleeping_models_copies_are_dropped(memory: KVPoolMemory,
                                                    host: HostMemory) -> None:
    svc = make_service(memory, host)
    svc.register_model("tiny-ft", KvShape(2, 2, 64, "float32"))  # the same format
    ft = svc.open_session("ft", cache_salt=b"shared", model="tiny-ft").session_id
    await cache_prefix(svc, memory, ft, 1, PREFIX, 1.0)
    own = svc.open_session("own", cache_salt=b"shared").session_id
    await evict_all(svc, memory, own, 2)
    tier = svc.host_tier
    assert tier is not None and tier.num_held == 2
    await svc.set_model_state("tiny-ft", asleep=True)
    assert tier.num_held == 0
    svc.check_invariants()


class Recorded:
    """A sink that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[object, ...], str]] = []

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = MEDIUM_GPU) -> None:
        self.calls.append(("stored", model, tuple(b.block_hash for b in blocks), medium))

    def removed(self, model: str, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        self.calls.append(("removed", model, tuple(hashes), medium))

    def cleared(self, model: str) -> None:
        raise AssertionError("never cleared")


async def test_events_follow_each_copy(memory: KVPoolMemory, host: HostMemory) -> None:
    tenants = Tenants.single(None)
    svc = make_service(memory, host, tenants=tenants)
    sink = Recorded()
    svc.formats.publish_events(sink, all_salts=True)
    sid = svc.open_session("a", cache_salt=b"shared").session_id
    await cache_prefix(svc, memory, sid, 1, PREFIX, 1.0)
    (kind, model, hashes, medium), = sink.calls
    assert (kind, medium, len(hashes)) == ("stored", MEDIUM_GPU, 2)
    sink.calls.clear()
    await evict_all(svc, memory, sid, 2)
    # Copied to the host tier (parents first), then removed from the pool.
    assert sink.calls == [("stored", model, hashes, MEDIUM_CPU),
                          ("removed", model, hashes[::-1], MEDIUM_GPU)]
    snapshot = list(svc.formats.kv_snapshot())
    assert [(item.medium, tuple(b.block_hash for b in item.blocks)) for item in snapshot] == \
        [(MEDIUM_CPU, hashes)]
    sink.calls.clear()
    await svc.allocate(sid, Allocate(3, 8, PREFIX))  # restored: stored in the pool again
    assert sink.calls == [("stored", model, hashes, MEDIUM_GPU)]



