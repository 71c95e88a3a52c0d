"""The host-memory tier's rules at the service: the snapshot and the KV events send a parent
before its children (across chunks, across the pool and the tier, with several formats); a
Batch restores and drops copies for room, and one that fails leaves every host record as it was;
a private session's end zeroes its copies only after their restores in flight, and does not drop
a record its rewritten block no longer names; random calls restore exactly what was computed; a
copy out of a CUDA pool holds the blocks' bytes; a host tier beside a contiguous pool is a config
error; a model sharing the daemon's format is served by its tier. Pools are bookkeeping-only
unless a test says otherwise; block size 4."""

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from pagedkv.client.engine.engine import _host_tier as engine_host_tier
from pagedkv.client.pool.types import PoolInfo
from pagedkv.daemon.core import BlockPool, PoolError
from pagedkv.daemon.edge.servicer import pool_info
from pagedkv.daemon.events.sink import MEDIUM_GPU, StoredBlock
from pagedkv.daemon.memory.host_memory import HostMemory
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.service import kv_events
from pagedkv.daemon.service.kv_events import hash64
from pagedkv.daemon.service.models import KvShape
from pagedkv.daemon.service.operations import Allocate, Commit, CopyOnWrite, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.sessions import Session
from pagedkv.daemon.service.tenants import Tenant, Tenants
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

from service_calls import committed, random_calls

BLOCK = 4
PREFIX = list(range(8))  # two full blocks


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


async def test_a_private_sessions_end_zeroes_its_copies_after_their_restore_in_flight(
        tmp_path: Path) -> None:
    """A private session's restore runs slowly; the session is closed meanwhile: the zeroing
    of its copies (and of the restored blocks) waits for the restore, which brings back the
    bytes the copies held."""
    with KVPoolMemory.create(TINY_CPU_GEOMETRY, 4, BLOCK, "float32",
                             shm_dir=str(tmp_path)) as memory:
        host = HostMemory.create(4, memory, shm_dir=str(tmp_path))
        svc = PoolService(BlockPool(4, BLOCK), memory, pool_id="p", geometry=TINY_CPU_GEOMETRY,
                          zero_freed_blocks=True)
        svc.attach_host_tier(host, copy_rate=1)
        private = svc.open_session("private").session_id
        table = (await svc.allocate(private, Allocate(1, 8, PREFIX))).block_table
        for i, block in enumerate(table):
            memory.kv[block].fill_(1.0 + i)
        await svc.commit(private, Commit([1]))
        await svc.free(private, Free(1))
        other = svc.open_session("other", cache_salt=b"shared").session_id
        await svc.allocate(other, Allocate(2, 16, [100 + i for i in range(16)]))  # offloads
        await svc.free(other, Free(2))
        seen: list[list[float]] = []
        slow_from_host = host.from_host

        def from_host(slots: Sequence[int], blocks: Sequence[int]) -> None:
            time.sleep(0.3)
            slow_from_host(slots, blocks)
            seen.append([float(memory.kv[b].flatten()[0]) for b in blocks])

        host.from_host = from_host  # type: ignore[method-assign]
        restoring = asyncio.ensure_future(svc.allocate(private, Allocate(3, 8, PREFIX)))
        await asyncio.sleep(0.05)  # applied: the restore is running
        assert not restoring.done()
        await svc.close_session(private)  # drops and zeroes the copies and the blocks
        assert (await restoring).num_cached_tokens == 8  # applied before the close
        assert seen == [[1.0, 2.0]]
        assert bool((host.slots == 0).all()) and bool((memory.kv == 0).all())
        svc.check_invariants()
        host.close()


def value(tokens: Sequence[int]) -> float:
    """The K/V a runner computes for a block ending a prompt's `tokens` (a stand-in)."""
    return float(hash(tuple(tokens)) % 9973 + 1)


@pytest.mark.parametrize("seed", range(24))
async def test_random_calls_restore_exactly_what_was_computed(tmp_path: Path, seed: int) -> None:
    """Random prompts of three sessions (two salts, one private, reopened when closed), frees,
    Batches (a restore then a prompt that may hit or evict it; and Batches that fail at their
    end) and closes, over real memory: every block a prompt finds
    cached (pool or host tier) holds what was computed for its tokens, a failed call changes
    neither the records nor the memory, and every invariant holds after each call.
    Pool: 6 blocks, a host tier of 4 slots."""
    rng = random.Random(seed)
    zero = seed % 2 == 1
    with KVPoolMemory.create(TINY_CPU_GEOMETRY, 6, BLOCK, "float32",
                             shm_dir=str(tmp_path)) as memory:
        host = HostMemory.create(4, memory, shm_dir=str(tmp_path))
        svc = PoolService(BlockPool(6, BLOCK), memory, pool_id="p", geometry=TINY_CPU_GEOMETRY,
                          zero_freed_blocks=zero, tenants=Tenants.single(None))
        svc.attach_host_tier(host, copy_rate=1)
        svc.formats.publish_events(Stored(), all_salts=True)
        sids = [svc.open_session("a1", cache_salt=b"a").session_id,
                svc.open_session("a2", cache_salt=b"a").session_id,
                svc.open_session("p").session_id]
        live: list[tuple[int, int]] = []  # (session index, seq id)
        families = [[f * 10 + i for i in range(16)] for f in range(3)]
        for n in range(60):
            who = rng.randrange(3)
            sid = sids[who]
            kind = rng.random()
            if kind < 0.55:
                family = rng.choice(families)
                cut = rng.randrange(1, 17)
                tokens = family[:cut] if rng.random() < 0.8 else [*family[:cut - 1], 999]
                skip = rng.random() < 0.2
                try:
                    got = await svc.allocate(sid, Allocate(n, cut, tokens, skip_host_tier=skip))
                except PoolError:
                    svc.check_invariants()
                    continue
                table, cached = got.block_table, got.num_cached_tokens // BLOCK
                found = [float(memory.kv[b].flatten()[0]) for b in table[:cached]]
                assert found == [value(tokens[:(i + 1) * BLOCK]) for i in range(cached)]
                for i in range(cached, len(table)):
                    memory.kv[table[i]].fill_(value(tokens[:(i + 1) * BLOCK]))
                if rng.random() < 0.8:
                    await svc.commit(sid, Commit([n]))
                if rng.random() < 0.7:
                    await svc.free(sid, Free(n))
                else:
                    live.append((who, n))
            elif kind < 0.75 and live:
                owner, seq = live.pop(rng.randrange(len(live)))
                await svc.free(sids[owner], Free(seq))
            elif kind < 0.82:  # a restore, then a prompt that may hit it or evict it
                first, then = (rng.choice(families)[:rng.randrange(4, 17)] for _ in range(2))
                try:
                    got = (await svc.batch(sid, [Allocate(n, len(first), first), Free(n),
                                                 Allocate(n + 500, len(then), then)]))[2]
                except PoolError:
                    svc.check_invariants()
                    continue
                cached = got.num_cached_tokens // BLOCK
                found = [float(memory.kv[b].flatten()[0]) for b in got.block_table[:cached]]
                assert found == [value(then[:(i + 1) * BLOCK]) for i in range(cached)]
                await svc.free(sid, Free(n + 500))
            elif kind < 0.9:
                before, kv, slots = state(svc), memory.kv.clone(), host.slots.clone()
                family = rng.choice(families)
                with pytest.raises(PoolError):
                    await svc.batch(sid, [Allocate(n, 16, family), Commit([n]), Free(n),
                                          Allocate(n + 1000, 16, [7] * 16),
                                          Free(n + 1000), Free(n + 1000)])  # freed twice
                assert state(svc) == before
                assert torch.equal(memory.kv, kv) and torch.equal(host.slots, slots)
            else:
                await svc.close_session(sid)
                live = [(o, s) for o, s in live if o != who]
                salt = b"a" if who < 2 else b""  # b"": a private salt again
                sids[who] = svc.open_session(f"s{n}", cache_salt=salt).session_id
            svc.check_invariants()
        host.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_out_of_a_cuda_pool_holds_the_blocks_bytes(tmp_path: Path) -> None:
    """to_host from device memory: the slots hold the blocks' bytes once it returns (a copy
    to the host left asynchronous would be read before the device wrote it). Large blocks, so
    that the device copy takes long enough to be caught."""
    with KVPoolMemory.create(TINY_CPU_GEOMETRY, 64, 256, "float32", device="cuda",
                             shm_dir=str(tmp_path)) as memory:
        host = HostMemory.create(64, memory, shm_dir=str(tmp_path))
        for block in range(64):
            memory.kv[block].fill_(block + 1.0)
        memory.synchronize()
        host.to_host(list(range(64)), list(range(64)))
        expected = memory.kv.reshape(64, -1).view(torch.uint8).cpu()
        assert torch.equal(host.slots, expected)
        host.close()


class TwoTiers:
    """A subscriber's index per medium, strict: a block stored twice in one medium, or removed
    unknown, fails."""

    def __init__(self) -> None:
        self.index: dict[str, dict[tuple[str, int], tuple[tuple[int, ...], int | None]]] = {
            "GPU": {}, "CPU": {}}

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = MEDIUM_GPU) -> None:
        index = self.index[medium]
        for block in blocks:
            assert (model, block.block_hash) not in index, f"stored twice ({medium})"
            index[model, block.block_hash] = (block.token_ids, block.parent_hash)

    def removed(self, model: str, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        for block_hash in hashes:
            assert self.index[medium].pop((model, block_hash), None) is not None, \
                f"removed unknown ({medium})"

    def cleared(self, model: str) -> None:
        raise AssertionError("never cleared")


def host_copies(svc: PoolService, roots: set[bytes]) -> set[tuple[str, int, tuple[int, ...],
                                                                    int | None]]:
    """Every copy the host tier holds: (model, hash, tokens, parent hash or None)."""
    tier, fmt = svc.host_tier, svc.formats.models.formats[0]
    assert tier is not None and fmt.hygiene.host is not None
    names = {model.number: model.name for model in svc.formats.models}
    found = set()
    for key, slot in tier.slot_of.items():
        _, parent, tokens = tier.content(slot)
        model = fmt.hygiene.host.models._of[slot][0]
        found.add((names[model], hash64(key), tuple(tokens.tolist()),
                   None if parent in roots else hash64(parent)))
    return found


async def prompts(svc: PoolService, sessions: list[Session], rng: random.Random, steps: int,
                  check: Callable[[], None]) -> None:
    """Random prompts from a few families (cut anywhere, most committed, all freed), so that
    prefixes come back after their eviction."""
    families = [[f + i % 3 for i in range(16)] for f in range(4)]
    for n in range(steps):
        session = rng.choice(sessions)
        seq = 5000 + n + rng.randrange(10**6) * 100
        tokens = rng.choice(families)[:rng.randrange(1, 17)]
        try:
            await svc.allocate(session.session_id, Allocate(seq, len(tokens), tokens))
        except PoolError:
            check()
            continue
        if rng.random() < 0.8:
            await svc.commit(session.session_id, Commit([seq]))
        await svc.free(session.session_id, Free(seq))
        check()


@pytest.mark.parametrize("seed", range(6))
async def test_events_rebuild_the_host_tier_of_a_daemon_with_several_formats(seed: int) -> None:
    """Three models (two share format 0, which has a host tier of 8 slots; one has a geometry
    of its own, so pages move), private and global sessions, random calls, closes and sleeps:
    after every call the CPU index a subscriber rebuilds from the events is exactly the tier's
    copies and the GPU index the pools' committed blocks; so is a snapshot's."""
    rng = random.Random(seed)
    pool = BlockPool(12, BLOCK, blocks_per_page=2)
    svc = PoolService(pool, None, pool_id="p", geometry=TINY_CPU_GEOMETRY, page_bytes=16384,
                      tenants=Tenants([Tenant("default", salts=frozenset({b"public"}))]))
    svc.attach_host_tier(None, num_slots=8)
    sink = TwoTiers()
    svc.formats.publish_events(sink, all_salts=True)
    svc.register_model("tiny-ft", KvShape(2, 2, 64, "float32"))
    svc.register_model("half", KvShape(1, 2, 64, "float32"))
    models = ("", "tiny-ft", "half")
    roots: set[bytes] = set()

    def opened(model: str, i: int) -> Session:
        session = svc.open_session(f"{model}-{i}", cache_salt=b"public" if i else b"",
                                   model=model)
        roots.add(svc.model_of(session).format.pool.root_key(session.salt_tag + session.salt))
        return session

    def check() -> None:
        svc.check_invariants()
        assert {(svc.formats.models.get(m).format.number, h, ids, parent)
                for (m, h), (ids, parent) in sink.index["GPU"].items()} == committed(svc, roots)
        assert {(m, h, ids, parent) for (m, h), (ids, parent) in sink.index["CPU"].items()} \
            == host_copies(svc, roots)

    sessions = [opened(model, i) for model in models for i in range(2)]
    for _ in range(6):
        await random_calls(svc, sessions, rng, 20, check)
        await prompts(svc, sessions, rng, 40, check)
        victim = rng.randrange(len(sessions))
        session = sessions[victim]
        if rng.random() < 0.5:
            await svc.close_session(session.session_id)
        else:
            await svc.set_model_state(session.model or "default", asleep=True)
            await svc.set_model_state(session.model or "default", asleep=False)
        check()
        sessions = [s if s.session_id in {x.session_id for x in svc.calls.sessions}
                    else opened(s.model, 0 if s.private_salt else 1) for s in sessions]
    tier = svc.host_tier
    assert tier is not None and tier.stores, "the workload offloaded nothing"
    rebuilt = TwoTiers()
    for item in svc.formats.kv_snapshot():
        rebuilt.stored(item.model, item.blocks, item.medium)
    assert rebuilt.index == sink.index


async def test_a_private_block_rewritten_in_place_leaves_its_sessions_record() -> None:
    """A private session revives its cached block, rewrites it in place (copy-on-write of a
    block it alone holds: the key goes) and frees it; a shared session's prompt then gets that
    block, caches it, and the pool offloads it. The private session's ending must not drop the
    shared session's copy: the block left the private record when it lost its key.
    Pool: 2 blocks, 4 slots."""
    svc = bookkeeping(2, 4)
    private = svc.open_session("private").session_id
    shared = svc.open_session("shared", cache_salt=b"shared").session_id
    await svc.allocate(private, Allocate(1, 4, [1, 2, 3, 4]))
    await svc.commit(private, Commit([1]))
    await svc.free(private, Free(1))  # block 0 cached, the private session's
    assert (await svc.allocate(private, Allocate(2, 4, [1, 2, 3, 4]))).block_table == [0]
    await svc.copy_on_write(private, CopyOnWrite(2, 0))  # alone: rewritten in place, unkeyed
    await svc.free(private, Free(2))  # block 0 free, no content
    prompt = list(range(10, 18))
    assert (await svc.allocate(shared, Allocate(3, 8, prompt))).block_table == [1, 0]
    await svc.commit(shared, Commit([3]))
    await svc.free(shared, Free(3))
    await svc.allocate(shared, Allocate(4, 8, [7] * 8))  # evicts both: offloaded
    await svc.free(shared, Free(4))
    tier = svc.host_tier
    assert tier is not None and tier.num_held == 2
    await svc.close_session(private)
    assert tier.num_held == 2  # the shared session's copies stay
    assert (await svc.allocate(shared, Allocate(5, 8, prompt))).num_cached_tokens == 8
    svc.check_invariants()


def test_a_host_tier_beside_a_contiguous_pool_is_a_config_error(tmp_path: Path) -> None:
    """pagedkvd --allocator contiguous --host-tier-memory ...: refused as a setting (what the
    command line reports as one), not an InvalidArgument traceback at start."""
    with pytest.raises(ConfigError, match="cannot honour host_tier_memory"):
        DaemonConfig(num_blocks=4, block_size=BLOCK, allocator="contiguous", max_model_len=8,
                     host_tier_memory=1 << 20, shm_dir=tmp_path)


async def test_a_model_sharing_the_daemons_format_is_served_by_its_host_tier() -> None:
    """The tier holds copies of format 0's blocks, whichever of its models left them (a
    fine-tune of the daemon's geometry too): the engine of such a model sees the tier (its swap
    rule applies: swap = "never" does skip it), one of another geometry does not."""
    svc = bookkeeping(4, 4)
    svc.register_model("tiny-ft", KvShape(2, 2, 64, "float32"))  # format 0's geometry
    svc.register_model("half", KvShape(1, 2, 64, "float32"))
    assert svc.formats.models.get("tiny-ft").format.number == 0
    ft = svc.open_session("ft", cache_salt=b"shared", model="tiny-ft").session_id
    await svc.allocate(ft, Allocate(1, 8, PREFIX))
    await svc.commit(ft, Commit([1]))
    await svc.free(ft, Free(1))
    await svc.allocate(ft, Allocate(2, 16, [100 + i for i in range(16)]))  # offloads PREFIX
    await svc.free(ft, Free(2))
    assert (await svc.allocate(ft, Allocate(3, 8, PREFIX))).num_cached_tokens == 8  # restored
    info = PoolInfo.from_proto(pool_info(svc, with_memory=False))
    assert engine_host_tier(info, "tiny-ft").num_blocks == 4
    assert engine_host_tier(info, info.model).num_blocks == 4
    assert engine_host_tier(info, "half").num_blocks == 0


async def test_a_snapshot_sends_a_pool_blocks_parent_held_only_by_the_host_tier_first() -> None:
    """A prefix's first block is evicted to the host tier while its second stays cached in the
    pool (a second prompt computed both, lost the first to the first prompt's commit, and
    was freed last): the snapshot sends the parent (CPU) before the child (GPU), as a
    subscriber that chains blocks to their parents needs. Pool: 4 blocks, 4 slots."""
    svc = bookkeeping(4, 4)
    sink = Stored()
    svc.formats.publish_events(sink, all_salts=True)
    sid = svc.open_session("a", cache_salt=b"shared").session_id
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    assert (await svc.allocate(sid, Allocate(1, 4, first))).block_table == [0]
    assert (await svc.allocate(sid, Allocate(2, 8, first + second))).block_table == [1, 2]
    await svc.commit(sid, Commit([1]))  # block 0 holds the first block's content
    await svc.commit(sid, Commit([2]))  # block 1 loses its key; block 2's parent is block 0
    await svc.free(sid, Free(1))  # block 0 cached first
    await svc.free(sid, Free(2))  # then block 2
    await svc.allocate(sid, Allocate(3, 12, [9] * 12))  # blocks 1, 3 free; evicts block 0
    tier = svc.host_tier
    assert tier is not None and tier.num_held == 1
    order = [(item.medium, b.block_hash, b.parent_hash) for item in svc.formats.kv_snapshot()
             for b in item.blocks]
    assert [medium for medium, _, _ in order] == ["CPU", "GPU"]
    (_, parent, root), (_, _, of) = order
    assert root is None and of == parent
    svc.check_invariants()
