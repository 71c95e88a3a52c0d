"""KV events' sources at the service: random calls of three models (two geometries, two models
sharing one), refusals included, and the index a subscriber rebuilds from the events equals
the pool's committed blocks after every call.

The sink is a test double of `KVEventSink` that applies each event to an index
{(model, hash): (token ids, parent hash, extra key)}, strictly: a block stored twice or removed
unknown fails. The expected index is read from each format's prefix cache (the core's
committed keys), not from what the service recorded.
"""

import random
from collections.abc import Sequence

import pytest

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.events.sink import StoredBlock
from pagedkv.daemon.service import kv_events
from pagedkv.daemon.service.models import KvShape, ModelPolicy
from pagedkv.daemon.service.operations import Allocate, Commit, CopyOnWrite, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.tenants import Tenant, Tenants
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

from service_calls import SHARED_IDS, committed, random_calls

BLOCK = 4
# The default tenant's global salts: PUBLIC is marked public (its blocks are published by
# default), UNMARKED is not (listed by this one tenant alone, it is still not published).
PUBLIC = b"public"
UNMARKED = b"unmarked"

Entry = tuple[tuple[int, ...], int | None, bytes | None]


class IndexSink:
    """A subscriber's index, rebuilt from the events as they come."""

    def __init__(self) -> None:
        self.index: dict[tuple[str, int], Entry] = {}
        self.calls = 0

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = "GPU") -> None:
        assert medium == "GPU", "a host tier's event from a daemon without one"
        self.calls += 1
        assert blocks, "an empty stored event"
        for block in blocks:
            assert len(block.token_ids) == BLOCK
            assert (model, block.block_hash) not in self.index, "stored twice"
            self.index[model, block.block_hash] = (block.token_ids, block.parent_hash,
                                                   block.extra_key)

    def removed(self, model: str, hashes: Sequence[int], medium: str = "GPU") -> None:
        assert medium == "GPU", "a host tier's event from a daemon without one"
        self.calls += 1
        assert hashes, "an empty removed event"
        for block_hash in hashes:
            assert self.index.pop((model, block_hash), None) is not None, "removed unknown"

    def cleared(self, model: str) -> None:
        raise AssertionError("the sources never clear")


def service(all_salts: bool, sink: "IndexSink | EventLog | None" = None
            ) -> tuple[PoolService, "IndexSink | EventLog"]:
    pool = BlockPool(16, BLOCK, blocks_per_page=2)
    svc = PoolService(pool, None, pool_id="p", geometry=TINY_CPU_GEOMETRY, page_bytes=16384,
                      model_policies={"half": ModelPolicy(max_memory=20 * 4096)},
                      tenants=Tenants([Tenant("default", salts=frozenset({PUBLIC, UNMARKED}),
                                              public_salts=frozenset({PUBLIC}))]))
    sink = sink or IndexSink()
    svc.formats.publish_events(sink, all_salts, svc.tenants.public_salts)
    svc.register_model("tiny-ft", KvShape(2, 2, 64, "float32"))
    svc.register_model("half", KvShape(1, 2, 64, "float32"))
    return svc, sink


def published(svc: PoolService, sink: IndexSink) -> set[tuple[int, int, tuple[int, ...],
                                                                int | None]]:
    return {(svc.models.get(model).format.number, block_hash, ids, parent)
            for (model, block_hash), (ids, parent, _) in sink.index.items()}


@pytest.mark.parametrize("seed", range(4))
async def test_events_rebuild_every_committed_block_of_every_model(seed: int) -> None:
    """With every salt published, the index is exactly the pool's committed blocks after
    every call, refused calls (a failing op after a commit, a full pool) included; private
    sessions' blocks carry their namespace, global ones none; a closed private session and a
    model put to sleep take theirs away."""
    rng = random.Random(seed)
    svc, sink = service(all_salts=True)
    sessions = [svc.open_session(f"{model}-{i}", cache_salt=PUBLIC if i else b"", model=model)
                for model in ("", "tiny-ft", "half") for i in range(2)]
    roots = {svc.model_of(s).format.pool.root_key(s.salt_tag + s.salt) for s in sessions}

    def check() -> None:
        svc.check_invariants()
        assert published(svc, sink) == committed(svc, roots)

    refused = await random_calls(svc, sessions, rng, 300, check)
    assert refused and sink.calls > 20  # the workload did refuse, and did publish
    extras = {extra for _, _, extra in sink.index.values()}
    assert extras <= {None} | {b"session:%d" % s.number for s in sessions}
    await svc.close_session(sessions[0].session_id)  # private: its cached blocks go
    check()
    await svc.set_model_state("half", asleep=True)  # its cached blocks go
    check()
    assert not [key for key in sink.index if key[0] == "half"]


@pytest.mark.parametrize("seed", range(2))
async def test_by_default_only_blocks_under_a_global_salt_are_published(seed: int) -> None:
    """Private sessions' blocks never reach the sink; the global salt's all do, with no
    extra key."""
    rng = random.Random(seed)
    svc, sink = service(all_salts=False)
    sessions = [svc.open_session(f"s{i}", cache_salt=PUBLIC if i % 2 else b"")
                for i in range(4)]
    roots = {svc.models.own.format.pool.root_key(s.salt) for s in sessions}

    def check() -> None:
        shared = {entry for entry in committed(svc, roots) if entry[2][0] in SHARED_IDS}
        assert published(svc, sink) == shared

    await random_calls(svc, sessions, rng, 200, check)
    assert sink.index, "nothing was published"
    assert all(ids[0] in SHARED_IDS and extra is None
               for ids, _, extra in sink.index.values())


@pytest.mark.parametrize("all_salts", [False, True])
async def test_a_global_salt_not_marked_public_is_never_published_bare(all_salts: bool) -> None:
    """A salt one tenant alone lists is global, yet not public: by default its blocks never
    reach the sink (as a private session's); with kv_events_all_salts they go with their
    namespace, b"shared:SALT", as extra key. The public salt's blocks go bare either way."""
    svc, sink = service(all_salts=all_salts)
    assert isinstance(sink, IndexSink)
    for salt, first in ((UNMARKED, 50), (PUBLIC, 60)):
        session = svc.open_session(salt.decode(), cache_salt=salt)
        await svc.allocate(session.session_id, Allocate(1, 2 * BLOCK,
                                                        list(range(first, first + 2 * BLOCK))))
        await svc.batch(session.session_id, [Commit([1])])
    by_first = {ids[0]: extra for ids, _, extra in sink.index.values()}
    unmarked = {b"shared:" + UNMARKED} if all_salts else set()
    assert {by_first[first] for first in (50, 54) if first in by_first} == unmarked
    assert by_first[60] is None and by_first[64] is None
    assert len(by_first) == (4 if all_salts else 2)


async def test_a_snapshot_read_while_calls_change_the_pool_rebuilds_it_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher reads a snapshot one chunk per loop callback, calls between: applying
    the snapshot (parents before children in it) and then every event from its point gives the
    committed blocks exactly, blocks removed and stored meanwhile included."""
    monkeypatch.setattr(kv_events, "SNAPSHOT_CHUNK", 2)
    log = EventLog()
    svc, _ = service(all_salts=True, sink=log)
    session = svc.open_session("s", cache_salt=PUBLIC)
    roots = {svc.models.own.format.pool.root_key(session.salt)}
    sid = session.session_id
    await svc.allocate(sid, Allocate(0, 9, [0] * 9))  # blocks 0, 1 and 2
    await svc.commit(sid, Commit([0]))
    await svc.copy_on_write(sid, CopyOnWrite(0, 0))  # block 0 rewritten: removed
    await svc.allocate(sid, Allocate(1, 9, [0] * 9))  # 3 (0's content again), 4 (1's)
    await svc.commit(sid, Commit([1]))  # 3 committed after its child 1; 4 stays unkeyed
    for seq, first in ((2, 1), (3, 2)):
        await svc.allocate(sid, Allocate(seq, 9, [first] * 8 + [0]))
        await svc.commit(sid, Commit([seq]))
    await svc.free(sid, Free(3))  # cached: the first evicted, in the snapshot's last chunk
    chunks = svc.formats.kv_snapshot()
    point = len(log.events)  # what comes after the snapshot's point: its first step
    seen = [next(chunks)]
    await svc.allocate(sid, Allocate(9, 28, [7] * 28))  # evicts seq 3's
    await svc.commit(sid, Commit([9], [4]))  # its first block: not an evicted one
    seen.extend(chunks)
    index: dict[tuple[str, int], Entry] = {}
    for model, blocks, _ in seen:
        for block in blocks:
            assert block.parent_hash is None or (model, block.parent_hash) in index, \
                "a child before its parent"
            index[model, block.block_hash] = (block.token_ids, block.parent_hash,
                                              block.extra_key)
    later = log.events[point:]
    assert {kind for kind, _, _ in later} == {"stored", "removed"}  # the snapshot raced both
    apply(later, index)
    assert {("tiny", h) for _, h, _, _ in committed(svc, roots)} == set(index)
    assert {(0, h, ids, parent) for (_, h), (ids, parent, _) in index.items()} == \
        committed(svc, roots)


Event = tuple[str, str, Sequence[StoredBlock] | Sequence[int]]


class EventLog:
    """Events recorded as they come."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = "GPU") -> None:
        self.events.append(("stored", model, blocks))

    def removed(self, model: str, hashes: Sequence[int], medium: str = "GPU") -> None:
        self.events.append(("removed", model, hashes))

    def cleared(self, model: str) -> None:
        raise AssertionError("the sources never clear")



def apply(events: list["Event"], index: dict[tuple[str, int], Entry]) -> None:
    """Apply events after a snapshot: a store adds or replaces, a removal of an unknown hash
    is nothing."""
    for _, model, items in events:
        for item in items:
            if isinstance(item, StoredBlock):
                index[model, item.block_hash] = (item.token_ids, item.parent_hash,
                                                 item.extra_key)
            else:
                index.pop((model, item), None)
