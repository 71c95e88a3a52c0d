"""The thread that owns the ZMQ sockets: publishes batches, keeps the replay buffer, answers
replay and snapshot requests.

Sockets (vLLM's ZmqEventPublisher, and one request of ours):
- XPUB (a PUB to subscribers, which also tells us of their subscriptions), multipart
  `[topic, seq, payload]`. The endpoint is bound when it has "*" or "::" or is ipc:// or
  inproc://, else connected (vLLM's rule: llm-d's indexer binds its SUB and the engines connect
  to it). Connected, the socket drops what it sends before the subscriber's subscription has
  arrived (ZMQ's slow joiner), so the thread holds the batches until the first subscription
  comes, CONNECT_WAIT_S at most (then it warns that a subscriber may have missed batches: a
  replay or a snapshot repairs it).
- ROUTER on the replay endpoint (bound), for REQ (or DEALER with an empty delimiter frame)
  clients. A request is one frame:
  - a start seq (8 bytes big-endian): every buffered batch from there as `[seq, payload]`,
    then the end marker `[END_SEQ, b""]` (seq -1), exactly as vLLM answers. A start before
    the buffer gets what is left: the first seq answered then says how much was lost.
  - b"snapshot" (pagedkv's own): every committed block as BlockStored batches
    `[topic, seq, payload]`, each seq the one the live stream continues from (S), then the
    marker `[b"", S, b""]`: apply the snapshot, then the live batches from S on (replay from S
    if the PUB socket lost any). A failed snapshot ends with `[b"", END_SEQ, b""]`.
  Answers go out at the pace each client reads, clients in turns, within bounds on what a
  client can make the daemon hold (replay.py).
"""

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import zmq

from pagedkv.daemon.events.replay import (
    ROUTER_HWM,
    Answers,
    ReplayAnswer,
    ReplayBuffer,
    SnapshotAnswer,
)
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
# Messages the PUB socket queues per subscriber before it drops (vLLM's hwm).
PUB_HWM = 100_000
# Connected PUB: how long batches wait for the subscriber's first subscription.
CONNECT_WAIT_S = 5.0
# Requests read per turn of the thread (the ROUTER's receive HWM bounds what waits).
MAX_REQUESTS_PER_TURN = 1024
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
    # The seq of the first batch: 0 cold, the previous run's next one after a restored restart
    # (subscribers see the sequence go on).
    first_seq: int = 0


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


class Slice(NamedTuple):
    """A snapshot item read on the event loop, for `answer`: None after the last one (or on a
    failure, `failed`)."""

    answer: SnapshotAnswer
    item: SnapshotItem | None
    failed: bool = False


# Put in the inbox to stop the thread once what is before it is sent.
STOP = object()


class Sender(threading.Thread):
    """Owns the sockets; fed through `inbox` by the event loop (see the module docstring)."""

    def __init__(self, settings: EventSettings, inbox: "queue.SimpleQueue[object]",
                 ask_slice: Callable[[SnapshotAnswer], None]) -> None:
        super().__init__(name="kv-events", daemon=True)
        self._settings = settings
        self._inbox = inbox
        # Reads the answer's next snapshot item on the event loop, which puts a Slice here.
        self._ask_slice = ask_slice
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.XPUB)
        self._router: zmq.Socket[bytes] | None = None
        # Connected: when holding batches for the first subscription ends (monotonic
        # seconds); None: not holding.
        self._join_deadline: float | None = None
        try:
            self._open_sockets()
        except zmq.ZMQError:
            self._close_sockets()
            raise
        # The endpoints as bound, read here: the sockets belong to the thread once it runs.
        self.addresses = self._bound_addresses()
        self._buffer = ReplayBuffer(settings.buffer, settings.first_seq)
        # Batches taken from the inbox and not yet published (held while joining).
        self._held: deque[Outgoing] = deque()
        # The answers to replay and snapshot requests, and their figures; None: no ROUTER.
        self.answers = None if self._router is None else Answers(self._router, self._buffer)
        # Batches published.
        self.sent = 0

    @property
    def replayed(self) -> int:
        """Batches sent again by replays."""
        return 0 if self.answers is None else self.answers.replayed

    @property
    def snapshots(self) -> int:
        """Snapshots answered in full."""
        return 0 if self.answers is None else self.answers.snapshots

    def _open_sockets(self) -> None:
        self._pub.set_hwm(PUB_HWM)
        endpoint = self._settings.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
            self._join_deadline = time.monotonic() + CONNECT_WAIT_S
        if self._settings.replay_endpoint is not None:
            self._router = self._context.socket(zmq.ROUTER)
            # Refuse (zmq.Again) rather than drop what a slow client has no room for yet.
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.set_hwm(ROUTER_HWM)
            self._router.bind(self._settings.replay_endpoint)

    def _bound_addresses(self) -> tuple[str, str | None]:
        """The PUB and ROUTER endpoints as bound (a "*" port resolved)."""
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or self._settings.endpoint
        router = (None if self._router is None
                  else self._router.getsockopt_string(zmq.LAST_ENDPOINT))
        return pub, router

    def run(self) -> None:
        busy = False
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=0 if busy else POLL_S)
                except queue.Empty:
                    item = None
                if item is STOP:
                    self._join_deadline = None
                    self._publish_held()
                    return
                try:
                    self._take(item)
                    self._publish_held()
                    busy = self._serve()
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
            self._held.append(item)
        elif isinstance(item, Slice):
            self._add_slice(item)

    def _publish_held(self) -> None:
        """Publish the batches taken, unless they wait for the first subscription."""
        if self._joining():
            return
        while self._held:
            self._publish(self._held.popleft())

    def _joining(self) -> bool:
        """Connected and no subscription yet: hold the batches (module docstring), until
        CONNECT_WAIT_S passes or `queue` batches are held."""
        if self._join_deadline is None:
            return False
        while self._pub.poll(0):
            if self._pub.recv()[:1] == b"\x01":  # a subscription: the subscriber is there
                log.info("kv events: the subscriber subscribed", endpoint=self.addresses[0])
                self._join_deadline = None
                return False
        if (time.monotonic() < self._join_deadline
                and len(self._held) < self._settings.queue):
            return True
        log.warning("kv events: no subscriber subscribed yet; it may miss the first batches "
                    "(a replay or a snapshot repairs that)", endpoint=self.addresses[0],
                    waited_s=CONNECT_WAIT_S)
        self._join_deadline = None
        return False

    def _publish(self, item: Outgoing) -> None:
        topic = (self._settings.topic_prefix + item.model).encode()
        payload = encode_batch(EventBatch(item.ts, self._events(item)))
        self._pub.send_multipart([topic, seq_bytes(item.seq), payload])
        self._buffer.append(item.seq, payload)
        self.sent += 1

    def _events(self, item: Outgoing) -> tuple[Event, ...]:
        medium = item.medium
        if item.stored is not None:
            return tuple(stored_events(item.stored, self._settings.block_size, medium))
        if item.removed is not None:
            return (BlockRemoved(item.removed, medium, 0),)
        return (AllBlocksCleared(),)

    def _serve(self) -> bool:
        """Read requests, drain the subscriptions the XPUB reports, send answers; True when
        answers could send more at once."""
        while self._join_deadline is None and self._pub.poll(0):
            self._pub.recv()  # subscriptions matter only while joining
        if self._router is None or self.answers is None:
            return False
        for _ in range(MAX_REQUESTS_PER_TURN):
            if not self._router.poll(0):
                break
            self._request(self._router.recv_multipart(), self.answers)
        return self.answers.pump()

    def _request(self, frames: list[bytes], answers: Answers) -> None:
        if len(frames) != 3 or frames[1]:
            log.warning("kv events: a request is one frame after the empty delimiter",
                        frames=len(frames))
            return
        identity, _, body = frames
        if body == SNAPSHOT_REQUEST:
            answers.add(identity, SnapshotAnswer(self._ask_slice))
        elif len(body) == 8:
            answers.add(identity, ReplayAnswer(seq_of(body), self._buffer.end))
        else:
            log.warning("kv events: a request is a start seq or b'snapshot'",
                        request=body[:32])

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
