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
