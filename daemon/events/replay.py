"""Replay and snapshot answers: the buffer replays read, and how answers share the ROUTER.

Runs on the sending thread (sender.py), which owns the ROUTER socket. Everything a client can
make the daemon hold is bounded, whatever it sends and however slowly it reads (issue 31: one
DEALER sending 3,000 replay requests and reading nothing grew a daemon by 1.2 GiB, each request
a copy of the buffer's list, and a legitimate replay queued behind them went unanswered):
- A replay is a cursor over the buffer, never a copy of it: the batches go out one message at
  a time from the buffer itself. Its end is fixed when it arrives (vLLM's answer: what was
  buffered then). A batch the buffer drops before the cursor reaches it is skipped: the seq
  gap says what was lost, as for a start before the buffer.
- A snapshot holds one slice of messages at a time (the next is read when it is sent).
- MAX_ANSWERS_PER_CLIENT answers queued per client and MAX_ANSWERS in all; a request beyond
  either is refused: not answered, counted, logged at most every HOSTILE_LOG_INTERVAL_S.
- Clients take turns, SLICE messages each per turn, so a slow reader never holds up another;
  a client's own answers go in the order it asked.
- What the ROUTER queues for a client is bounded by ROUTER_HWM messages: past it, with
  ROUTER_MANDATORY, a send is refused (zmq.Again) instead of queued. A client with no room for
  STALL_S seconds (it does not read), or gone, is dropped with every answer it had queued
  (logged, rate-limited).
"""

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq

from pagedkv.daemon.events.sink import SnapshotItem
from pagedkv.daemon.events.wire import END_SEQ, seq_bytes
from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S, RateLimitedLog, get_logger

# Answers queued per client (a REQ asks one at a time), and over all clients.
MAX_ANSWERS_PER_CLIENT = 4
MAX_ANSWERS = 256
# Messages a client is sent per turn, and per pump over all clients (then the thread looks at
# its batches again).
SLICE = 64
PUMP_BUDGET = 4096
# Messages the ROUTER queues per client before refusing more (zmq's default, made explicit).
ROUTER_HWM = 1000
# A client that has had no room for this long is dropped.
STALL_S = 10.0

log = get_logger(__name__)


class ReplayBuffer:
    """The payloads of the last `capacity` batches published; their seqs are consecutive."""

    def __init__(self, capacity: int, first_seq: int = 0) -> None:
        # A ring: seq s is at s % capacity while start <= s < end.
        self._ring: list[bytes] = [b""] * capacity
        # The seq of the first batch (a restored daemon's go on from the previous run's).
        self._first = first_seq
        # The seq of the next batch appended; the oldest kept is max(first, end - capacity).
        self.end = first_seq

    @property
    def start(self) -> int:
        return max(self._first, self.end - len(self._ring))

    def append(self, seq: int, payload: bytes) -> None:
        assert seq == self.end, f"batch {seq} after {self.end - 1}: seqs are consecutive"
        self._ring[seq % len(self._ring)] = payload
        self.end += 1

    def payload(self, seq: int) -> bytes:
        assert self.start <= seq < self.end, f"batch {seq} is not buffered"
        return self._ring[seq % len(self._ring)]


@dataclass(eq=False)
class ReplayAnswer:
    """A replay in progress: a cursor over the buffer (module docstring)."""

    # The next seq to send, and the end fixed at the request (the END marker then follows).
    next_seq: int
    end_seq: int
    # The END marker has left.
    done: bool = False

    def message(self, buffer: ReplayBuffer) -> list[bytes] | None:
        """The next message, `[seq, payload]` or the END marker; None once done."""
        self.next_seq = max(self.next_seq, buffer.start)  # skip what the buffer dropped
        if self.next_seq < self.end_seq:
            return [seq_bytes(self.next_seq), buffer.payload(self.next_seq)]
        return None if self.done else [END_SEQ, b""]

    def sent(self) -> None:
        if self.next_seq < self.end_seq:
            self.next_seq += 1
        else:
            self.done = True


@dataclass(eq=False)
class SnapshotAnswer:
    """A snapshot in progress: its slices are read on the event loop (publisher.py)."""

    # Asks the loop for the next slice (it comes back through Answers.add_slice).
    ask: Callable[["SnapshotAnswer"], None]
    # Messages built and not yet sent: one slice at most.
    ready: deque[list[bytes]] = field(default_factory=deque)
    # Set on the event loop: the seq the live stream continues from, and the blocks still to
    # read (None before the first slice).
    start_seq: int = 0
    items: Iterator[SnapshotItem] | None = None
    # A slice is asked and not yet here; the last marker is built; the client was dropped.
    asking: bool = False
    done: bool = False
    dropped: bool = False

    def message(self, buffer: ReplayBuffer) -> list[bytes] | None:
        """The next message built; None while the next slice is read (asked here)."""
        if self.ready:
            return self.ready[0]
        if not self.done and not self.asking:
            self.asking = True
            self.ask(self)
        return None

    def sent(self) -> None:
        self.ready.popleft()

    @property
    def finished(self) -> bool:
        return self.done and not self.ready


Answer = ReplayAnswer | SnapshotAnswer


@dataclass(eq=False)
class Client:
    """One ROUTER peer's queued answers."""

    # Its ROUTER identity.
    identity: bytes
    # Its answers, in the order it asked.
    answers: deque[Answer] = field(default_factory=deque)
    # When sending to it began to fail for want of room (monotonic seconds); None: it reads.
    stalled_since: float | None = None


class Answers:
    """Every client's answers, sent on `router` as the clients take them (module docstring)."""

    def __init__(self, router: zmq.Socket[bytes], buffer: ReplayBuffer) -> None:
        self._router = router
        self._buffer = buffer
        self._clients: dict[bytes, Client] = {}
        # Answers queued over all clients (MAX_ANSWERS bounds it).
        self.queued = 0
        # Batches sent by replays, snapshots answered in full, requests refused, clients
        # dropped.
        self.replayed = 0
        self.snapshots = 0
        self.refused = 0
        self.dropped = 0
        self._refusal_log = RateLimitedLog(HOSTILE_LOG_INTERVAL_S)
        self._drop_log = RateLimitedLog(HOSTILE_LOG_INTERVAL_S)

    def add(self, identity: bytes, answer: Answer) -> None:
        """Queue `answer` for the client, or refuse it when a bound is reached."""
        client = self._clients.get(identity)
        if self.queued >= MAX_ANSWERS or (
                client is not None and len(client.answers) >= MAX_ANSWERS_PER_CLIENT):
            self.refused += 1
            count = self._refusal_log.event()
            if count is not None:
                log.warning("kv events: requests refused: too many answers queued",
                            refused=count, per_client=MAX_ANSWERS_PER_CLIENT, total=MAX_ANSWERS)
            return
        client = self._clients.setdefault(identity, Client(identity))
        client.answers.append(answer)
        self.queued += 1

    def pump(self) -> bool:
        """Send what the clients have room for, in turns; True when PUMP_BUDGET ran out (more
        may be sendable at once), False when every client is served, waiting or full."""
        budget = PUMP_BUDGET
        moved = True
        while moved and budget > 0:
            moved = False
            for client in list(self._clients.values()):
                sent = self._serve(client, min(SLICE, budget))
                budget -= sent
                moved = moved or sent > 0
        return budget <= 0

    def _serve(self, client: Client, limit: int) -> int:
        """Send up to `limit` messages of the client's first answers; how many left."""
        sent = 0
        while sent < limit and client.answers:
            answer = client.answers[0]
            message = answer.message(self._buffer)
            if message is None:
                if isinstance(answer, SnapshotAnswer) and not answer.finished:
                    break  # its next slice is being read
                self._pop(client)
                continue
            try:
                self._router.send_multipart([client.identity, b"", *message], zmq.NOBLOCK)
            except zmq.Again:
                self._stalled(client)
                break
            except zmq.ZMQError:  # EHOSTUNREACH: the client is gone
                self._drop(client, "gone")
                break
            client.stalled_since = None
            answer.sent()
            sent += 1
            self._count(answer, message)
        if not client.answers:
            self._clients.pop(client.identity, None)
        return sent

    def _pop(self, client: Client) -> None:
        client.answers.popleft()
        self.queued -= 1

    def _stalled(self, client: Client) -> None:
        now = time.monotonic()
        client.stalled_since = client.stalled_since or now
        if now - client.stalled_since >= STALL_S:
            self._drop(client, "does not read")

    def _drop(self, client: Client, why: str) -> None:
        """Forget the client and every answer it had queued."""
        for answer in client.answers:
            if isinstance(answer, SnapshotAnswer):
                answer.dropped = True
        self.queued -= len(client.answers)
        client.answers.clear()
        self._clients.pop(client.identity, None)
        self.dropped += 1
        count = self._drop_log.event()
        if count is not None:
            log.warning("kv events: replay clients dropped", why=why, dropped=count,
                        stall_s=STALL_S)

    def _count(self, answer: Answer, message: list[bytes]) -> None:
        if isinstance(answer, ReplayAnswer):
            self.replayed += bool(message[1])
        elif not message[0] and message[1] != END_SEQ:
            self.snapshots += 1
