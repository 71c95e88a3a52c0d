"""The KV-event publisher on loopback (daemon/events/publisher.py, sender.py): a real PUB and
ROUTER on random ports, read by pyzmq SUB and REQ sockets as vLLM's subscriber reads them."""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from pagedkv.daemon.edge.metrics import EventCollector
from pagedkv.daemon.events.publisher import EventPublisher
from pagedkv.daemon.events.sender import SNAPSHOT_REQUEST, EventSettings
from pagedkv.daemon.events.sink import EventCounts, NullSink, Snapshot, SnapshotItem, StoredBlock
from pagedkv.daemon.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    seq_bytes,
    seq_of,
)
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.event_sink import make_event_sink, start_event_sink
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.process.grpc_server import StartupError

PREFIX = "kv@test@"
# How long a test waits for the thread before it fails (a guard, not a timing assertion).
WAIT_S = 10.0


def settings(buffer: int = 100, queue: int = 1000) -> EventSettings:
    return EventSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                         buffer=buffer, queue=queue, topic_prefix=PREFIX, block_size=2)


def block(h: int, parent: int | None = None) -> StoredBlock:
    return StoredBlock(h, parent, (h, h + 1), None)


def no_snapshot() -> Iterator[SnapshotItem]:
    return iter(())


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def started(snapshot: Snapshot = no_snapshot, **kwargs: int) -> EventPublisher:
    publisher = EventPublisher(settings(**kwargs), snapshot)
    publisher.start()
    return publisher


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.002)


async def request(ctx: zmq.asyncio.Context, publisher: EventPublisher,
                  body: bytes) -> list[list[bytes]]:
    """The answer to one request, up to its empty-payload end. A DEALER sends the empty
    delimiter a REQ would (a REQ takes only one reply per request)."""
    socket = ctx.socket(zmq.DEALER)
    address = publisher.addresses[1]
    assert address is not None
    socket.connect(address)
    await socket.send_multipart([b"", body])
    messages: list[list[bytes]] = []
    async with asyncio.timeout(WAIT_S):
        while not messages or messages[-1][-1]:
            delimiter, *frames = await socket.recv_multipart()
            assert delimiter == b""
            messages.append(frames)
    socket.close(linger=0)
    return messages


async def subscribe(ctx: zmq.asyncio.Context,
                    publisher: EventPublisher) -> tuple[zmq.asyncio.Socket, int]:
    """A SUB socket that receives everything, and the seq of the next batch: PUB drops what
    it sends before a subscription arrives, so probe batches go out until one is received."""
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    sub.connect(publisher.addresses[0])
    probes = 0
    async with asyncio.timeout(WAIT_S):
        while not await sub.poll(20):
            publisher.cleared("probe")
            probes += 1
        while seq_of((await sub.recv_multipart())[1]) != probes - 1:
            pass
    return sub, probes


async def receive(sub: zmq.asyncio.Socket) -> tuple[str, int, EventBatch]:
    async with asyncio.timeout(WAIT_S):
        topic, seq, payload = await sub.recv_multipart()
    return topic.decode(), seq_of(seq), decode_batch(payload)


async def test_seq_from_zero_and_replay_of_the_buffer(context: zmq.asyncio.Context) -> None:
    publisher = await started(buffer=4)
    try:
        # Nothing published yet: a replay is the end marker alone.
        assert await request(context, publisher, seq_bytes(0)) == [[END_SEQ, b""]]
        for h in range(6):
            publisher.stored("m", [block(h)])
        await until(lambda: publisher.counts().sent == 6)
        # vLLM's answer: [seq, payload] from the start, then [-1, b""]. The buffer keeps the
        # last 4 (seqs 2..5): a start before it gets what is left.
        answer = await request(context, publisher, seq_bytes(0))
        assert [seq_of(seq) for seq, _ in answer] == [2, 3, 4, 5, -1] and answer[-1][1] == b""
        assert [decode_batch(payload).events[0].block_hashes  # type: ignore[union-attr]
                for _, payload in answer[:-1]] == [(2,), (3,), (4,), (5,)]
        assert [seq_of(seq) for seq, _ in await request(context, publisher, seq_bytes(4))] \
            == [4, 5, -1]
        assert await request(context, publisher, seq_bytes(6)) == [[END_SEQ, b""]]
        assert publisher.counts().replayed == 6
    finally:
        await publisher.close()


async def test_live_batches_in_order_on_the_model_topic(context: zmq.asyncio.Context) -> None:
    publisher = await started()
    try:
        sub, seq = await subscribe(context, publisher)
        # Two chains in one call: a BlockStored each.
        publisher.stored("tiny", [block(1), block(2, 1), block(7, 1)])
        publisher.removed("tiny", [2, 7])
        publisher.cleared("other")
        topic, got, batch = await receive(sub)
        assert (topic, got) == (f"{PREFIX}tiny", seq) and batch.data_parallel_rank == 0
        assert batch.events == (
            BlockStored((1, 2), None, (1, 2, 2, 3), 2, medium="GPU", extra_keys=(None, None),
                        group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockStored((7,), 1, (7, 8), 2, medium="GPU", extra_keys=(None,), group_idx=0,
                        kv_cache_spec_kind="full_attention"))
        topic, got, batch = await receive(sub)
        assert (topic, got, batch.events) == (f"{PREFIX}tiny", seq + 1,
                                              (BlockRemoved((2, 7), "GPU", 0),))
        topic, got, batch = await receive(sub)
        assert (topic, got, batch.events) == (f"{PREFIX}other", seq + 2, (AllBlocksCleared(),))
    finally:
        await publisher.close()


async def test_snapshot_then_live_rebuilds_the_index_exactly(
        context: zmq.asyncio.Context) -> None:
    # The pool as the service would hold it: model -> hash -> block. The snapshot yields it in
    # slices; between two slices (other loop work) one block is removed and one stored, and
    # told to the sink as the service would.
    pool = {"m": {h: block(h) for h in range(1, 6)}}
    publisher: EventPublisher

    def snapshot() -> Iterator[SnapshotItem]:
        yield SnapshotItem("m", [pool["m"][h] for h in (1, 2, 3)])
        del pool["m"][2]
        publisher.removed("m", [2])
        pool["m"][9] = block(9)
        publisher.stored("m", [block(9)])
        yield SnapshotItem("m", [b for h, b in pool["m"].items() if h not in (1, 3)])

    publisher = await started(snapshot)
    try:
        sub, _ = await subscribe(context, publisher)
        publisher.stored("m", [block(1)])  # before the snapshot: seq below S
        answer = await request(context, publisher, SNAPSHOT_REQUEST)
        *batches, (marker_topic, marker_seq, marker_payload) = answer
        start = seq_of(marker_seq)
        assert marker_topic == b"" and marker_payload == b""
        index: set[int] = set()
        for topic, seq, payload in batches:
            assert (topic, seq_of(seq)) == (f"{PREFIX}m".encode(), start)
            for event in decode_batch(payload).events:
                assert isinstance(event, BlockStored)
                index.update(event.block_hashes)
        # The live stream from S on: the removal, then the store, no gap, nothing before S.
        live = [await receive(sub) for _ in range(3)]
        after = [(seq, batch) for _, seq, batch in live if seq >= start]
        assert [seq for seq, _ in after] == [start, start + 1]
        for _, batch in after:
            for event in batch.events:
                if isinstance(event, BlockRemoved):
                    index.difference_update(event.block_hashes)
                elif isinstance(event, BlockStored):
                    index.update(event.block_hashes)
        assert index == set(pool["m"]) == {1, 3, 4, 5, 9}
        # The sending thread counts an answer once its last frame is sent, which the client
        # may read first: the count is eventually 1.
        await until(lambda: publisher.counts().snapshots == 1)
    finally:
        await publisher.close()


async def test_a_failed_snapshot_ends_with_the_end_marker(
        context: zmq.asyncio.Context) -> None:
    def broken() -> Iterator[SnapshotItem]:
        yield SnapshotItem("m", [block(1)])
        raise RuntimeError("the pool changed under the iterator")

    publisher = await started(broken)
    try:
        answer = await request(context, publisher, SNAPSHOT_REQUEST)
        assert answer[-1] == [b"", END_SEQ, b""] and len(answer) == 2
        assert publisher.counts().snapshots == 0
    finally:
        await publisher.close()


class Gate(tuple[int, ...]):
    """Token ids whose reading (by the sending thread, encoding them) waits for `opened`."""

    opened = threading.Event()

    def __iter__(self) -> Iterator[int]:
        assert self.opened.wait(WAIT_S)
        return super().__iter__()


async def test_a_full_queue_drops_and_announces_all_blocks_cleared(
        context: zmq.asyncio.Context) -> None:
    publisher = await started(queue=2)
    Gate.opened.clear()
    try:
        # The thread is stuck encoding seq 0: every call still returns at once (the loop
        # never waits for it); two batches wait, the next two are dropped.
        publisher.stored("m", [StoredBlock(1, None, Gate((1, 2)), None)])
        await until(lambda: publisher.counts().dropped == 0 and not publisher._inbox.qsize())
        for h in range(2, 6):
            publisher.stored("m", [block(h)])
        assert publisher.counts().dropped == 2
        Gate.opened.set()
        await until(lambda: publisher.counts().sent == 3)
        publisher.stored("m", [block(6)])  # preceded by AllBlocksCleared: the model lost some
        await until(lambda: publisher.counts().sent == 5)
        answer = await request(context, publisher, seq_bytes(0))
        events = [decode_batch(payload).events for _, payload in answer[:-1]]
        assert [seq_of(seq) for seq, _ in answer] == [0, 1, 2, 3, 4, -1]
        assert [type(e[0]).__name__ for e in events] == [
            "BlockStored", "BlockStored", "BlockStored", "AllBlocksCleared", "BlockStored"]
        assert [e[0].block_hashes for e in events if isinstance(e[0], BlockStored)] == [
            (1,), (2,), (3,), (6,)]
        assert publisher.counts().dropped == 2
    finally:
        Gate.opened.set()
        await publisher.close()


async def test_the_daemon_settings_make_the_sink(context: zmq.asyncio.Context) -> None:
    # Off by default: the null sink binds nothing and counts nothing.
    assert isinstance(make_event_sink(DaemonConfig(), no_snapshot), NullSink)
    config = DaemonConfig(kv_events_endpoint="tcp://127.0.0.1:*",
                          kv_events_replay_endpoint="tcp://127.0.0.1:*",
                          kv_events_topic="kv@pod@", kv_events_buffer=3, block_size=4)
    sink = make_event_sink(config, no_snapshot)
    assert isinstance(sink, EventPublisher)
    start_event_sink(sink)
    try:
        sink.stored("tiny", [StoredBlock(1, None, (1, 2, 3, 4), None)])
        await until(lambda: sink.counts().sent == 1)
        (seq, payload), _ = await request(context, sink, seq_bytes(0))
        assert seq_of(seq) == 0
        # The pool's blocks are the tier runners compute into: medium "GPU", even on a CPU
        # daemon (its host tier's copies are "CPU"); the pool's block size.
        event = decode_batch(payload).events[0]
        assert isinstance(event, BlockStored) and (event.medium, event.block_size) == ("GPU", 4)
    finally:
        await sink.close()


async def test_an_endpoint_in_use_stops_the_start(context: zmq.asyncio.Context) -> None:
    taken = context.socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:*")
    address = taken.getsockopt_string(zmq.LAST_ENDPOINT).replace("127.0.0.1", "*")
    sink = make_event_sink(DaemonConfig(kv_events_endpoint=address), no_snapshot)
    with pytest.raises(StartupError, match="kv_events_endpoint"):
        start_event_sink(sink)
    taken.close(linger=0)


@pytest.mark.parametrize(("settings", "message"), [
    ({"kv_events_endpoint": "http://x:1"}, "kv_events_endpoint must start with"),
    ({"kv_events_replay_endpoint": "tcp://*:5558"}, "needs kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://*:5557", "kv_events_buffer": 0}, "kv_events_buffer"),
    ({"kv_events_endpoint": "tcp://*:5557", "kv_events_queue": 0}, "kv_events_queue"),
])
def test_bad_event_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DaemonConfig(**settings)  # type: ignore[arg-type]


def test_event_metrics() -> None:
    registry = CollectorRegistry()
    registry.register(EventCollector(lambda: EventCounts(5, 2, 3, 1)))
    text = generate_latest(registry).decode()
    for line in ("pagedkv:kv_events_sent_total 5.0", "pagedkv:kv_events_dropped_total 2.0",
                 "pagedkv:kv_event_batches_replayed_total 3.0",
                 "pagedkv:kv_event_snapshots_total 1.0"):
        assert line in text
    assert NullSink().counts() == EventCounts(0, 0, 0, 0)
