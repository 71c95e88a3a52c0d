"""The thread that owns the ZMQ sockets: publishes batches, keeps the replay buffer, answers
replay and snapshot requests.

Sockets (vLLM's ZmqEventPublisher, and one request of ours):
- PUB, multipart `[topic, seq, payload]`. The endpoint is bound when it has "*" or "::" or is
  ipc:// or inproc://, else connected (vLLM's rule: llm-d's indexer binds its SUB and the
  engines connect to it).
- ROUTER on the replay endpoint (bound), for REQ (or DEALER with an empty delimiter frame)
  clients. A request is one frame:
  - a start seq (8 bytes big-endian): every buffered batch from there as `[seq, payload]`,
    then the end marker `[END_SEQ, b""]` (seq -1), exactly as vLLM answers. A start before
    the buffer gets what is left: the first seq answered then says how much was lost.
  - b"snapshot" (pagedkv's own): every committed block as BlockStored batches
    `[topic, seq, payload]`, each seq the one the live stream continues from (S), then the
    marker `[b"", S, b""]`: apply the snapshot, then the live batches from S on (replay from S
    if the PUB socket lost any). A failed snapshot ends with `[b"", END_SEQ, b""]`.
  Answers go out one request at a time, in order, at the pace the client reads (the ROUTER
  refuses rather than queues beyond its high-water mark); one that cannot move for STALL_S
  seconds, or whose client left, is dropped.
"""

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq

from pagedkv.daemon.events.sink import SnapshotItem, StoredBlock
from pagedkv.daemon.events.wire import (
    END_SEQ,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    Event,
    EventBatch,
    encode_batch,
    seq_bytes,
    seq_of,
    stored_events,
)
from pagedkv.process.log_setup import get_logger

# How long the thread waits for a batch before it looks at requests and answers again.
POLL_S = 0.02
# An answer that cannot move for this long (its client does not read) is dropped.
STALL_S = 10.0
# Messages the PUB socket queues per subscriber before it drops (vLLM's hwm).
PUB_HWM = 100_000
# The request frame asking for a snapshot.
SNAPSHOT_REQUEST = b"snapshot"
# How long closing waits for queued messages to leave.
LINGER_MS = 200

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EventSettings:
    """Where and how the events go (the daemon's kv_events_* settings)."""

    # PUB endpoint, bound or connected (module docstring).
    endpoint: str
    # ROUTER endpoint of replay and snapshot requests, bound; None: neither is served.
    replay_endpoint: str | None
    # Batches kept for replay.
    buffer: int
    # Batches queued for this thread before the sink drops (publisher.py).
    queue: int
    # A model's topic is this prefix and its name.
    topic_prefix: str
    # Tokens per block, as the events say.
    block_size: int


class Outgoing(NamedTuple):
    """One batch queued by the event loop."""

    # Its sequence number, given on the loop in queue order.
    seq: int
    # When the loop queued it (epoch seconds).
    ts: float
    # Its model (the topic).
    model: str
    # What happened: blocks stored, hashes removed, or None: every block cleared.
    stored: tuple[StoredBlock, ...] | None = None
    removed: tuple[int, ...] | None = None
    # The tier: MEDIUM_GPU (the pool) or MEDIUM_CPU (the host tier).
    medium: str = MEDIUM_GPU


@dataclass(eq=False)
class Answer:
    """One client's answer in progress."""

    # The client's ROUTER identity.
    identity: bytes
    # Messages built and not yet sent (without the envelope).
    ready: deque[list[bytes]] = field(default_factory=deque)
    # A snapshot's state, set on the event loop: the seq the live stream continues from, and
    # the blocks still to read (None before the first slice).
    snapshot: bool = False
    start_seq: int = 0
    items: Iterator[SnapshotItem] | None = None
    # A slice is asked of the loop and not yet here; the last item has come; dropped.
    asking: bool = False
    done: bool = True
    dropped: bool = False
    # When sending began to fail for want of room (monotonic seconds), None while it moves.
    stalled_since: float | None = None


class Slice(NamedTuple):
    """A snapshot item read on the event loop, for `answer`: None after the last one (or on a
    failure, `failed`)."""

    answer: Answer
    item: SnapshotItem | None
    failed: bool = False


# Put in the inbox to stop the thread once what is before it is sent.
STOP = object()


class Sender(threading.Thread):
    """Owns the sockets; fed through `inbox` by the event loop (see the module docstring)."""

    def __init__(self, settings: EventSettings, inbox: "queue.SimpleQueue[object]",
                 ask_slice: Callable[[Answer], None]) -> None:
        super().__init__(name="kv-events", daemon=True)
        self._settings = settings
        self._inbox = inbox
        # Reads the answer's next snapshot item on the event loop, which puts a Slice here.
        self._ask_slice = ask_slice
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._open_sockets()
        except zmq.ZMQError:
            self._close_sockets()
            raise
        # The endpoints as bound, read here: the sockets belong to the thread once it runs.
        self.addresses = self._bound_addresses()
        # (seq, topic, payload) of the last `buffer` batches sent.
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=settings.buffer)
        self._answers: deque[Answer] = deque()
        # Batches published, batches sent again by replays, snapshots answered in full.
        self.sent = 0
        self.replayed = 0
        self.snapshots = 0

    def _open_sockets(self) -> None:
        self._pub.set_hwm(PUB_HWM)
        endpoint = self._settings.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        if self._settings.replay_endpoint is not None:
            self._router = self._context.socket(zmq.ROUTER)
            # Refuse (zmq.Again) rather than drop what a slow client has no room for yet.
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.bind(self._settings.replay_endpoint)

    def _bound_addresses(self) -> tuple[str, str | None]:
        """The PUB and ROUTER endpoints as bound (a "*" port resolved)."""
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or self._settings.endpoint
        router = (None if self._router is None
                  else self._router.getsockopt_string(zmq.LAST_ENDPOINT))
        return pub, router

    def run(self) -> None:
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=POLL_S)
                except queue.Empty:
                    item = None
                if item is STOP:
                    return
                try:
                    self._take(item)
                    self._serve_requests()
                    self._pump()
                except Exception:  # a bad request or a bug: log it, keep publishing
                    log.exception("kv events: sending failed")
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=LINGER_MS)
        if self._router is not None:
            self._router.close(linger=0)
        self._context.term()

    def _take(self, item: object) -> None:
        if isinstance(item, Outgoing):
            self._publish(item)
        elif isinstance(item, Slice):
            self._add_slice(item)

    def _publish(self, item: Outgoing) -> None:
        topic = (self._settings.topic_prefix + item.model).encode()
        payload = encode_batch(EventBatch(item.ts, self._events(item)))
        self._pub.send_multipart([topic, seq_bytes(item.seq), payload])
        self._buffer.append((item.seq, topic, payload))
        self.sent += 1

    def _events(self, item: Outgoing) -> tuple[Event, ...]:
        medium = item.medium
        if item.stored is not None:
            return tuple(stored_events(item.stored, self._settings.block_size, medium))
        if item.removed is not None:
            return (BlockRemoved(item.removed, medium, 0),)
        return (AllBlocksCleared(),)

    def _serve_requests(self) -> None:
        while self._router is not None and self._router.poll(0):
            frames = self._router.recv_multipart()
            if len(frames) != 3 or frames[1]:
                log.warning("kv events: a request is one frame after the empty delimiter",
                            frames=len(frames))
                continue
            identity, _, body = frames
            if body == SNAPSHOT_REQUEST:
                self._answers.append(Answer(identity, snapshot=True, done=False))
            elif len(body) == 8:
                self._answers.append(self._replay(identity, seq_of(body)))
            else:
                log.warning("kv events: a request is a start seq or b'snapshot'",
                            request=body[:32])

    def _replay(self, identity: bytes, start: int) -> Answer:
        answer = Answer(identity)
        answer.ready.extend([seq_bytes(seq), payload]
                            for seq, _, payload in self._buffer if seq >= start)
        answer.ready.append([END_SEQ, b""])
        return answer

    def _add_slice(self, got: Slice) -> None:
        answer = got.answer
        answer.asking = False
        if answer.dropped:
            return
        if got.item is None:
            answer.done = True
            end = END_SEQ if got.failed else seq_bytes(answer.start_seq)
            answer.ready.append([b"", end, b""])
            return
        model, blocks, medium = got.item
        events = tuple(stored_events(blocks, self._settings.block_size, medium))
        if events:
            answer.ready.append([(self._settings.topic_prefix + model).encode(),
                                 seq_bytes(answer.start_seq),
                                 encode_batch(EventBatch(time.time(), events))])

    def _pump(self) -> None:
        """Send what the first answers have ready, as far as their clients take it."""
        while self._answers:
            answer = self._answers[0]
            if not self._send_ready(answer):
                return
            if not answer.done:
                if not answer.asking:
                    answer.asking = True
                    self._ask_slice(answer)
                return
            self._answers.popleft()

    def _send_ready(self, answer: Answer) -> bool:
        """Send the answer's ready messages; False when the client has no room for more yet."""
        assert self._router is not None, "answers exist only with a ROUTER socket"
        while answer.ready and not answer.dropped:
            message = answer.ready[0]
            try:
                self._router.send_multipart([answer.identity, b"", *message], zmq.NOBLOCK)
            except zmq.Again:
                now = time.monotonic()
                answer.stalled_since = answer.stalled_since or now
                if now - answer.stalled_since < STALL_S:
                    return False
                answer.dropped = True
            except zmq.ZMQError:  # EHOSTUNREACH: the client is gone
                answer.dropped = True
            else:
                answer.stalled_since = None
                answer.ready.popleft()
                self._count(answer, message)
        if answer.dropped:
            answer.ready.clear()
            answer.done = True
        return True

    def _count(self, answer: Answer, message: list[bytes]) -> None:
        if not answer.snapshot and message[1]:
            self.replayed += 1
        elif answer.snapshot and not message[2] and message[1] != END_SEQ:
            self.snapshots += 1
