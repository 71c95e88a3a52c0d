"""The sink that publishes: `EventPublisher`, the event loop's side of the KV events.

Called on the daemon's event loop, a sink call only gives the batch its sequence number and
appends it to the queue of the sending thread (sender.py), which builds the events, encodes
them and owns every socket: the loop never waits for I/O, nor encodes.

Overflow. When `queue` batches are waiting (the thread cannot keep up), a call's batch is
dropped and counted (`pagedkv:kv_events_dropped_total`), and no seq is spent on it; the next
batch the queue takes is preceded by an AllBlocksCleared on the topic of every model that lost
one. A subscriber seeing it knows its index of that model is incomplete: it empties it (what
it rebuilds from later events is a subset of the truth) and asks for a snapshot.

Snapshots. The sending thread asks the loop for the blocks one item of the `snapshot`
callable at a time (`call_soon_threadsafe`), each item read in its own loop callback, so a
pool of any size never holds the loop longer than one bounded item (sink.py says what the
callable must tolerate). The first read also fixes S, the seq of the next batch: every change
announced below S is in the pool the snapshot reads, the later ones come live from S on. A
block stored after S may be in the snapshot and stored again live (an index adds it twice,
harmlessly); one removed after S is removed live after the snapshot put it in. So applying
the snapshot, then the batches from S in order, gives the pool's committed blocks exactly.
"""

import asyncio
import queue
import time
from collections.abc import Callable, Sequence

from pagedkv.daemon.events.replay import SnapshotAnswer
from pagedkv.daemon.events.sender import STOP, EventSettings, Outgoing, Sender, Slice
from pagedkv.daemon.events.sink import EventCounts, Snapshot, StoredBlock
from pagedkv.daemon.events.wire import MEDIUM_GPU
from pagedkv.process.log_setup import get_logger

# How long closing waits for the thread to send what is queued.
CLOSE_TIMEOUT_S = 5.0

log = get_logger(__name__)


class EventPublisher:
    """A KVEventSink (sink.py) that publishes vLLM's KV events over ZMQ (module docstring)."""

    def __init__(self, settings: EventSettings, snapshot: Snapshot,
                 numbered: Callable[[int, bool], None] | None = None) -> None:
        self._settings = settings
        self._snapshot = snapshot
        # Told the seq of the next batch, and whether an AllBlocksCleared is owed, as each
        # batch is numbered or dropped, before the thread may send it (the crash log's
        # `numbered`); None: nothing told.
        self._numbered = numbered
        # Batches for the thread, and the snapshot slices the loop reads for it.
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        # The seq of the next batch queued.
        self._next_seq = settings.first_seq
        # Batches dropped, and the models owed an AllBlocksCleared for one.
        self._dropped = 0
        self._lost: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: Sender | None = None
        # Taking batches: between start() and close().
        self._open = False

    def start(self) -> None:
        """Bind the sockets (zmq.ZMQError when an endpoint is unusable) and start the thread;
        on the running event loop, which every later call must come from."""
        self._loop = asyncio.get_running_loop()
        self._sender = Sender(self._settings, self._inbox, self._ask_slice)
        self._sender.start()
        self._open = True
        pub, replay = self._sender.addresses
        log.info("kv events publishing", endpoint=pub, replay_endpoint=replay,
                 topic_prefix=self._settings.topic_prefix)

    @property
    def next_seq(self) -> int:
        """The seq the next batch would get (what a restart image keeps)."""
        return self._next_seq

    async def close(self) -> None:
        """Stop taking batches, let the thread send what is queued (CLOSE_TIMEOUT_S at most),
        close the sockets."""
        if not self._open:
            return
        self._open = False
        self._inbox.put(STOP)
        assert self._sender is not None, "open means started"
        await asyncio.to_thread(self._sender.join, CLOSE_TIMEOUT_S)

    @property
    def addresses(self) -> tuple[str, str | None]:
        """The PUB and replay endpoints as bound (a "*" port resolved); after start()."""
        assert self._sender is not None, "start() first"
        return self._sender.addresses

    def counts(self) -> EventCounts:
        sender = self._sender
        if sender is None:
            return EventCounts(0, self._dropped, 0, 0)
        return EventCounts(sender.sent, self._dropped, sender.replayed, sender.snapshots)

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = MEDIUM_GPU) -> None:
        if blocks:
            self._put(model, stored=tuple(blocks), medium=medium)

    def removed(self, model: str, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        if hashes:
            self._put(model, removed=tuple(hashes), medium=medium)

    def cleared(self, model: str) -> None:
        self._put(model)

    def _put(self, model: str, stored: tuple[StoredBlock, ...] | None = None,
             removed: tuple[int, ...] | None = None, medium: str = MEDIUM_GPU) -> None:
        """Queue one batch, or drop it when the queue is full (module docstring); nothing
        before start() or after close()."""
        if not self._open:
            return
        if self._inbox.qsize() + len(self._lost) >= self._settings.queue:
            self._dropped += 1
            self._lost.add(model)
            self._tell()
            return
        self._clear_lost()
        self._queue(model, stored, removed, medium)

    def _clear_lost(self) -> None:
        for model in sorted(self._lost):
            self._queue(model, None, None)
        self._lost.clear()

    def _queue(self, model: str, stored: tuple[StoredBlock, ...] | None,
               removed: tuple[int, ...] | None, medium: str = MEDIUM_GPU) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._tell()  # before the thread may send it
        self._inbox.put(Outgoing(seq, time.time(), model, stored, removed, medium))

    def _tell(self) -> None:
        if self._numbered is not None:
            self._numbered(self._next_seq, bool(self._lost))

    def _ask_slice(self, answer: SnapshotAnswer) -> None:
        """From the sending thread: read the answer's next snapshot item on the loop."""
        assert self._loop is not None, "asked only once started"
        try:
            self._loop.call_soon_threadsafe(self._read_slice, answer)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            self._inbox.put(Slice(answer, None, failed=True))

    def _read_slice(self, answer: SnapshotAnswer) -> None:
        """On the loop: the first read fixes S (owed AllBlocksCleared go out below it, so
        they do not empty what the snapshot rebuilds); each read takes one item."""
        try:
            if answer.items is None:
                self._clear_lost()
                answer.start_seq = self._next_seq
                answer.items = iter(self._snapshot())
            item = next(answer.items, None)
        except Exception:
            log.exception("kv events: the snapshot failed")
            self._inbox.put(Slice(answer, None, failed=True))
            return
        self._inbox.put(Slice(answer, item))
