"""KV events end to end: a daemon served by the production gRPC server publishes its committed
blocks; a subscriber PROCESS (tests/support/kv_events_subscriber.py: pyzmq and msgpack only)
rebuilds the index {(model, hash): tokens, parent} and it equals the daemon's committed blocks
exactly.

The workload is random (allocate, append, step with commit, commit, copy-on-write, free, close)
over clients of two models of two geometries ("tiny", the daemon's own, and "half"), with a
pool of 16 blocks, so evictions and page moves happen. The expected index is read from each
format's prefix cache (the core's committed keys), not from what the service published.
Three ways to follow: live over both models (a slow join, forced by discarding the first
batches, repaired by a SNAPSHOT: replayed batches carry no topic, so a replay cannot say which
model a lost batch was), a gap the subscriber makes on purpose on a one-model stream repaired
by REPLAY, a late start repaired by a snapshot (the replay buffer too short to help). Every
message passes the subscriber's decoder written from llm-d's and Dynamo's decoding rules. By
default private sessions' blocks never appear.
"""

import asyncio
import contextlib
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from pagedkv.client import PoolClient
from pagedkv.client.pool.errors import PagedKVError
from pagedkv.client.pool.session import Session
from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.events.sender import EventSettings
from pagedkv.daemon.service.kv_events import hash64
from pagedkv.daemon.service.models import KvShape
from pagedkv.daemon.service.tenants import Tenant, Tenants, bearer_of

import kv_events_subscriber  # run as a child process, from its file
from daemon_harness import TOKEN, Daemon, running_daemon
from pagedkvd_process import free_tcp_port, pagedkvd

BLOCK = 4
PREFIX = "pagedkv/"
PUBLIC = b"public"
SUBSCRIBER = Path(kv_events_subscriber.__file__)
# Private sessions' prompts use ids >= 100, so a published block's tokens tell which it was;
# each sync's sentinel block has first token 1000 + its number.
SHARED_IDS, PRIVATE_IDS = range(3), range(100, 103)

Row = tuple[int, int, tuple[int, ...], int | None]


def settings(buffer: int) -> EventSettings:
    return EventSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                         buffer=buffer, queue=100_000, topic_prefix=PREFIX, block_size=BLOCK)


@asynccontextmanager
async def daemon_with_events(buffer: int = 10_000,
                             all_salts: bool = False) -> AsyncIterator[Daemon]:
    tenants = Tenants([Tenant("default", bearer_of(TOKEN), salts=frozenset({PUBLIC}),
                              public_salts=frozenset({PUBLIC}))])
    async with running_daemon(num_blocks=16, block_size=BLOCK, blocks_per_page=2,
                              tenants=tenants, kv_events=settings(buffer),
                              kv_events_all_salts=all_salts) as daemon:
        daemon.service.register_model("half", KvShape(1, 2, 64, "float32"))
        yield daemon


class SubscriberProcess:
    """tests/support/kv_events_subscriber.py in a child process, driven by lines."""

    def __init__(self, daemon: Daemon, mode: str, model: str = "") -> None:
        assert daemon.events is not None
        pub, replay = daemon.events.addresses
        assert replay is not None
        self.process = subprocess.Popen(
            [sys.executable, str(SUBSCRIBER), pub, replay, PREFIX, mode, model],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        text = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), 60)
        assert text, "the subscriber died"
        answer: dict[str, Any] = json.loads(text)
        return answer

    async def sync(self, sentinel: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"sync {sentinel}\n")
        self.process.stdin.flush()
        return await self.line()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


class Workload:
    """Random calls of clients of both models, public and private salts."""

    def __init__(self, daemon: Daemon, seed: int) -> None:
        self.daemon = daemon
        self.rng = random.Random(seed)
        self.sessions: list[Session] = []
        # Each session's live sequences.
        self.live: list[list[int]] = []
        self.next_id = 1
        self.sentinels = 0

    async def open(self, client: PoolClient) -> None:
        for model in ("", "half"):
            for salt in (PUBLIC, b"", PUBLIC):
                self.add(await client.open_session(
                    f"{model or 'tiny'}-{len(self.sessions)}", cache_salt=salt, model=model))

    def add(self, session: Session) -> None:
        self.sessions.append(session)
        self.live.append([])

    def ids(self, session: Session, n: int) -> list[int]:
        vocab = SHARED_IDS if self._public(session) else PRIVATE_IDS
        return [self.rng.choice(vocab) for _ in range(n)]

    def _public(self, session: Session) -> bool:
        return self.sessions.index(session) % 3 != 1

    async def run(self, calls: int) -> None:
        for _ in range(calls):
            index = self.rng.randrange(len(self.sessions))
            session, seqs = self.sessions[index], self.live[index]
            kind = self.rng.choice(["allocate", "allocate", "append", "step", "commit",
                                    "free", "cow"]) if seqs else "allocate"
            with contextlib.suppress(PagedKVError):  # a full pool: nothing changed
                await self._call(session, seqs, kind)

    async def _call(self, session: Session, seqs: list[int], kind: str) -> None:
        rng = self.rng
        if kind == "allocate":
            prompt = self.ids(session, rng.randrange(1, 14))
            if rng.random() < 0.5:  # a common system prompt: prefix hits
                system = [0, 1, 2, 0, 1, 2, 0, 1] if self._public(session) else [100, 101]
                prompt = [*system, *prompt]
            await session.allocate(self.next_id, token_ids=prompt)
            seqs.append(self.next_id)
            self.next_id += 1
        elif kind == "append":
            k = rng.randrange(1, 6)
            await session.append(rng.choice(seqs), token_ids=self.ids(session, k))
        elif kind == "step":
            chosen = rng.sample(seqs, min(len(seqs), 2))
            await session.step(chosen, self.ids(session, len(chosen)), commit=True)
        elif kind == "commit":
            await session.commit(seqs)
        elif kind == "cow":
            await session.copy_on_write(rng.choice(seqs), 0)
        else:
            seq = seqs.pop(rng.randrange(len(seqs)))
            await session.free(seq)

    async def sentinel(self) -> int:
        """A committed public block whose first token is new: the last event of a phase
        (every sequence freed first, so that it fits)."""
        self.sentinels += 1
        token = 1000 + self.sentinels
        for session, seqs in zip(self.sessions, self.live, strict=True):
            for seq in seqs:
                await session.free(seq)
            seqs.clear()
        await self.sessions[0].allocate(self.next_id, token_ids=[token] * BLOCK)
        await self.sessions[0].commit([self.next_id])
        self.live[0].append(self.next_id)
        self.next_id += 1
        return token


def committed(daemon: Daemon) -> set[Row]:
    """The test-only enumeration: every committed block of every format, from the core:
    (format, hash, tokens, parent hash; None for a chain's first block)."""
    service = daemon.service
    roots = set()
    for session in service.sessions:
        pool = service.model_of(session).format.pool
        roots.add(pool.root_key(session.salt_tag + session.salt))
    rows = set()
    for fmt in service.models.formats:
        assert isinstance(fmt.pool, BlockPool)
        blocks = list(fmt.pool._blocks.cache.block_of.values())
        keys, parents, tokens = fmt.pool.block_content(blocks)
        for key, parent, ids in zip(keys, parents, tokens.tolist(), strict=True):
            rows.add((fmt.number, hash64(key), tuple(ids),
                      None if parent in roots else hash64(parent)))
    return rows


def indexed(daemon: Daemon, dump: dict[str, Any]) -> set[Row]:
    """The subscriber's index, its models as their formats."""
    assert not dump["refused"], dump["refused"][:3]
    return {(daemon.service.models.get(model).format.number, block_hash, tuple(tokens), parent)
            for model, block_hash, tokens, parent, _ in dump["blocks"]}


def public(rows: set[Row]) -> set[Row]:
    return {row for row in rows if row[2][0] not in PRIVATE_IDS}


async def phases(daemon: Daemon, workload: Workload, subscriber: SubscriberProcess,
                 count: int, calls: int, all_salts: bool = False) -> list[dict[str, Any]]:
    """`count` phases of `calls` random calls, each ended by a sentinel the subscriber syncs
    on; the index must then equal the published part of the committed blocks (all of them
    with `all_salts`)."""
    dumps = []
    for _ in range(count):
        await workload.run(calls)
        dump = await subscriber.sync(await workload.sentinel())
        daemon.service.check_invariants()
        expected = committed(daemon)
        assert indexed(daemon, dump) == (expected if all_salts else public(expected))
        dumps.append(dump)
    return dumps


@pytest.mark.parametrize("seed", range(2))
async def test_a_subscriber_process_rebuilds_the_committed_blocks_exactly(seed: int) -> None:
    """Live, over two models: a private session's blocks never appear; the stream carries
    stores and removals (evictions among them); the index is exact after every phase. The
    first batches, lost as by a slow join, are repaired by a snapshot (a replay's batches
    would be taken as one model's)."""
    async with daemon_with_events() as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        workload = Workload(daemon, seed)
        await workload.open(client)
        subscriber = SubscriberProcess(daemon, "live")
        try:
            assert (await subscriber.line())["ready"]
            dumps = await phases(daemon, workload, subscriber, 3, 120)
        finally:
            subscriber.close()
        models = {row[0] for dump in dumps for row in dump["blocks"]}
        assert models == {"tiny", "half"}
        assert dumps[0]["snapshots"] >= 1 and not dumps[-1]["replays"]
        assert all(tokens[0] not in PRIVATE_IDS
                   for dump in dumps for _, _, tokens, _, _ in dump["blocks"])
        assert all(extra is None for dump in dumps for *_, extra in dump["blocks"])
        assert committed(daemon) != public(committed(daemon))  # private blocks existed
        assert sum(fmt.pool.stats().prefix_cache_hits  # prefixes were shared
                   for fmt in daemon.service.models.formats)
        assert dumps[-1]["removed"]  # blocks left: evicted, rewritten, moved


async def test_a_gap_is_repaired_by_replay() -> None:
    """The subscriber drops the batches of seqs 40..47 as if lost and replays them."""
    async with daemon_with_events() as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        workload = Workload(daemon, 7)
        for name, salt in (("tiny-a", PUBLIC), ("tiny-b", b""), ("tiny-c", PUBLIC)):
            workload.add(await client.open_session(name, cache_salt=salt))
        subscriber = SubscriberProcess(daemon, "gap", model="tiny")
        try:
            assert (await subscriber.line())["ready"]
            dumps = await phases(daemon, workload, subscriber, 3, 250)
        finally:
            subscriber.close()
        # (the subscriber's slow join may have lost some of them before it got them)
        skipped = dumps[-1]["skipped"]
        assert skipped and dumps[-1]["replays"] and dumps[-1]["next_seq"] > 48
        assert daemon.events is not None and daemon.events.counts().replayed >= skipped


async def test_a_late_subscriber_catches_up_by_snapshot() -> None:
    """A subscriber started after tens of batches, with a replay buffer of 4, asks for a
    snapshot while calls go on, then follows live: its index is exact, every salt's blocks
    included."""
    async with daemon_with_events(buffer=4, all_salts=True) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        workload = Workload(daemon, 3)
        await workload.open(client)
        await workload.run(200)
        assert daemon.events is not None and daemon.events.counts().sent > 4
        subscriber = SubscriberProcess(daemon, "late")  # two models: no replay
        try:  # calls go on while the daemon reads the snapshot for it
            ready, _ = await asyncio.gather(subscriber.line(), workload.run(60))
            assert ready["ready"]
            dumps = await phases(daemon, workload, subscriber, 2, 100, all_salts=True)
        finally:
            subscriber.close()
        assert dumps[0]["snapshots"] >= 1  # more if the PUB stream lost a batch later
        # Every salt: the private sessions' blocks too, under their namespace.
        extras = {json.dumps(extra) for dump in dumps for *_, extra in dump["blocks"]}
        assert any("session:" in extra for extra in extras)




async def test_pagedkvd_publishes_what_its_settings_say() -> None:
    """The production bring-up (server.py): pagedkvd with kv_events_* flags publishes its
    model's committed blocks, a namespaced salt's with kv_events_all_salts, to a subscriber
    process; the stream's topic is the prefix and the model's name."""
    pub, replay = free_tcp_port(), free_tcp_port()
    # "*" binds (a host name or address is connected to, as vLLM does): the subscriber then
    # connects to the daemon's PUB on loopback.
    with pagedkvd("--num-blocks", "16", "--kv-events-endpoint", f"tcp://*:{pub}",
                  "--kv-events-replay-endpoint", f"tcp://*:{replay}",
                  "--kv-events-topic", PREFIX, "--kv-events-all-salts") as daemon:
        async with await PoolClient.connect(daemon.unix_target) as client:
            session = await client.open_session("c", cache_salt=b"team")
            model = (await client.pool_info()).models[0].name
            block_size = (await client.pool_info()).block_size
            subscriber = subprocess.Popen(
                [sys.executable, str(SUBSCRIBER), f"tcp://127.0.0.1:{pub}",
                 f"tcp://127.0.0.1:{replay}", PREFIX, "live", model],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert subscriber.stdout is not None and subscriber.stdin is not None
                assert json.loads(subscriber.stdout.readline())["ready"]
                await session.allocate(1, token_ids=[5] * (2 * block_size) + [6])
                await session.commit([1])
                subscriber.stdin.write("sync 5\n")
                subscriber.stdin.flush()
                dump = json.loads(await asyncio.wait_for(
                    asyncio.to_thread(subscriber.stdout.readline), 60))
            finally:
                subscriber.kill()
                subscriber.wait()
        assert daemon.stop() == 0
    assert not dump["refused"]
    blocks = sorted(dump["blocks"], key=lambda row: row[3] is not None)
    assert [(row[0], row[2]) for row in blocks] == [(model, [5] * block_size)] * 2
    assert blocks[0][3] is None and blocks[1][3] == blocks[0][1]  # a chain: parent, child
    assert blocks[0][4] == ["tenant:default\x00team"]
