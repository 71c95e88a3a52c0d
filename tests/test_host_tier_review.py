"""Review of the host-memory tier: each test pins a bug found in review (it failed before the
fix beside it). Pools are bookkeeping-only unless a test says otherwise; block size 4."""

from collections.abc import Sequence

import pytest

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.events.sink import MEDIUM_GPU, StoredBlock
from pagedkv.daemon.service import kv_events
from pagedkv.daemon.service.operations import Allocate, Commit, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.tenants import Tenants
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

BLOCK = 4


class Stored:
    """A sink keeping each stored block's hash and parent hash, in the order sent."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int | None, str]] = []

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = MEDIUM_GPU) -> None:
        self.blocks += [(b.block_hash, b.parent_hash, medium) for b in blocks]

    def removed(self, model: str, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        pass

    def cleared(self, model: str) -> None:
        raise AssertionError("never cleared")


def bookkeeping(num_blocks: int, slots: int) -> PoolService:
    svc = PoolService(BlockPool(num_blocks, BLOCK), None, pool_id="p",
                      geometry=TINY_CPU_GEOMETRY, tenants=Tenants.single(None))
    svc.attach_host_tier(None, num_slots=slots)
    return svc


async def test_the_host_snapshot_sends_parents_first_across_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain offloaded deepest first (the LRU evicts a freed table's tail first) is in the
    snapshot parents first even when parent and child fall in different chunks."""
    monkeypatch.setattr(kv_events, "SNAPSHOT_CHUNK", 1)
    svc = bookkeeping(4, 4)
    sink = Stored()
    svc.formats.publish_events(sink, all_salts=True)
    sid = svc.open_session("a", cache_salt=b"shared").session_id
    await svc.allocate(sid, Allocate(1, 8, list(range(8))))
    await svc.commit(sid, Commit([1]))
    await svc.free(sid, Free(1))  # blocks 0, 1 cached: 1 at the LRU's head
    await svc.allocate(sid, Allocate(2, 16, [100 + i for i in range(16)]))  # evicts 1, then 0
    snapshot = [(b.block_hash, b.parent_hash) for item in svc.formats.kv_snapshot()
                for b in item.blocks]
    assert len(snapshot) == 2
    (parent, root), (_child, of) = snapshot
    assert root is None and of == parent
    svc.check_invariants()


def state(svc: PoolService) -> object:
    """Everything a call may change in format 0's host tier, its records and its events."""
    fmt = svc.formats.models.formats[0]
    tier, hygiene, events = svc.host_tier, fmt.hygiene, fmt.hygiene.events
    assert tier is not None and hygiene.host is not None and events is not None
    host = hygiene.host
    return (dict(tier.slot_of), list(tier.key_of), list(tier.parent_of), tier.tokens_of.tolist(),
            list(tier.lru), list(tier.free), tier.stores, tier.restores, tier.protected,
            {n: dict(r) for n, r in host.private._of.items()}, dict(host.private._owner),
            dict(host.models._of), +host.models._count,
            {n: dict(r) for n, r in hygiene.private._of.items()}, dict(hygiene.private._owner),
            dict(hygiene.cached._of), +hygiene.cached._count,
            dict(events.published), dict(events.host_published), len(events._queued),
            fmt.pool.stats(), fmt.pool.cached_keys(),
            [(s.number, sorted(s.seq_ids), s.table_entries, s.prefix_cache_queries,
              s.prefix_cache_hits) for s in svc.calls.sessions])


BATCH = [Allocate(4, 8, list(range(50, 58))),  # restored from the host tier
         Allocate(6, 8, list(range(300, 308))), Commit([6]), Free(4), Free(6),
         Allocate(5, 16, [200 + i for i in range(16)])]  # a copy of 6 drops the private one


async def tiered_batch_service() -> tuple[PoolService, str, Stored]:
    """4 blocks, 3 slots: a shared prefix (2 blocks) then a private one cached, then evicted by
    another prompt: the shared copies and the private prefix's second block are in the tier."""
    svc = bookkeeping(4, 3)
    sink = Stored()
    svc.formats.publish_events(sink, all_salts=True)
    private = svc.open_session("private").session_id
    shared = svc.open_session("shared", cache_salt=b"shared").session_id
    for sid, seq, first in ((shared, 2, 50), (private, 1, 0)):
        await svc.allocate(sid, Allocate(seq, 8, list(range(first, first + 8))))
        await svc.commit(sid, Commit([seq]))
        await svc.free(sid, Free(seq))
    await svc.allocate(shared, Allocate(3, 16, [100 + i for i in range(16)]))  # offloads 3 of 4
    await svc.free(shared, Free(3))
    svc.check_invariants()
    return svc, shared, sink


async def test_the_batch_below_restores_and_drops_copies_for_room() -> None:
    svc, shared, _ = await tiered_batch_service()
    tier = svc.host_tier
    assert tier is not None and (tier.stores, tier.restores) == (3, 0)
    got = await svc.batch(shared, BATCH)
    assert got[0].num_cached_tokens == 8
    assert (tier.stores, tier.restores) == (4, 2)  # one of 6's: 2 slots were touched
    host = svc.formats.models.formats[0].hygiene.host
    assert host is not None and not host.private._of  # the private copy made room
    svc.check_invariants()


async def test_a_failed_batch_leaves_every_host_record_as_it_was() -> None:
    """The Batch above, failing at its end: the tier, the records of owners and models, the
    published maps and the sink are as before."""
    svc, shared, sink = await tiered_batch_service()
    before, sent = state(svc), len(sink.blocks)
    with pytest.raises(Exception, match="already exists"):
        await svc.batch(shared, [*BATCH, Allocate(5, 1, [7])])  # exists: the batch fails
    assert state(svc) == before and len(sink.blocks) == sent
    svc.check_invariants()
