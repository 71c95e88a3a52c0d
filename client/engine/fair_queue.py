"""The waiting line of one or more engines: a queue per key, the least recently served key first.

    queue = FairQueue(max_running_per_key=8)
    line_a, line_b = queue.line(), queue.line()      # one per engine (Scheduler.waiting)
    line_a.append(request)                              # request.key says whose it is
    head = line_a.head()                             # None: not this engine's turn
    line_a.popleft()                                 # admitted: its key's turn is used

A key is whoever the caller says a request is for (`pagedkv serve`: an API key); "" for every
request of a plain engine, where the line is first in, first out, as before keys existed.

Turns: the next request admitted, across every line of the queue, is the oldest waiting request
of the key served longest ago (a key new to the queue first) among keys with fewer than
`max_running_per_key` requests running. Every line sees the same next request, so an engine
whose key is not next admits nothing: its own requests wait until the engine whose turn it is
admits. That keeps one view of the pool's room for several engines sharing it: a key with a
flood waiting behind its running requests cannot take the room another key's engine is waiting
for. A key stays in one line.

Running: a request counts from its admission (`popleft`) until it goes back in line
(`appendleft`: preempted, or its step failed) or leaves (`left`: finished or dropped). A key
with nothing waiting and nothing running is forgotten, so the tables hold only keys in use. An
engine that stops clears its line (`clear`).
"""

import itertools
from collections import deque
from collections.abc import Iterator

from pagedkv.client.engine.requests import Request


class FairQueue:
    """The per-key queues of every line, and whose turn it is."""

    def __init__(self, max_running_per_key: int = 0) -> None:
        if max_running_per_key < 0:
            raise ValueError(f"max_running_per_key must be >= 0, got {max_running_per_key}")
        # Most requests of one key running at once (0: no cap).
        self.max_running_per_key = max_running_per_key
        # Each key's waiting requests, oldest first (only keys with some).
        self._waiting: dict[str, deque[Request]] = {}
        # Each key's requests admitted and not yet back in line or gone (only keys with some).
        self._running: dict[str, set[Request]] = {}
        # When each key in use was last admitted (a tick; a key new to the queue has none).
        self._served: dict[str, int] = {}
        # The line each key in use queues in.
        self._line_of: dict[str, Line] = {}
        self._ticks = itertools.count(1)

    def line(self) -> "Line":
        """A new line (one engine's scheduler) in this queue."""
        return Line(self)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def waiting_of(self, key: str) -> int:
        """How many requests of `key` wait."""
        return len(self._waiting.get(key, ()))

    def running_of(self, key: str) -> int:
        """How many requests of `key` run."""
        return len(self._running.get(key, ()))

    def next_key(self) -> str | None:
        """The key whose oldest waiting request is admitted next (None: no key may be)."""
        cap = self.max_running_per_key
        ready = [key for key in self._waiting if not cap or self.running_of(key) < cap]
        return min(ready, key=lambda key: self._served.get(key, 0), default=None)

    def _enter(self, line: "Line", request: Request, first: bool) -> None:
        owner = self._line_of.setdefault(request.key, line)
        assert owner is line, f"key {request.key!r} queues in another line"
        queue = self._waiting.setdefault(request.key, deque())
        queue.appendleft(request) if first else queue.append(request)

    def _pop(self, key: str) -> Request:
        queue = self._waiting[key]
        request = queue.popleft()
        if not queue:
            del self._waiting[key]
        self._running.setdefault(key, set()).add(request)
        self._served[key] = next(self._ticks)
        return request

    def _remove(self, request: Request) -> None:
        queue = self._waiting[request.key]
        queue.remove(request)
        if not queue:
            del self._waiting[request.key]
        self._forget_idle(request.key)

    def _stopped(self, request: Request) -> None:
        running = self._running.get(request.key, set())
        running.discard(request)
        if not running:
            self._running.pop(request.key, None)
        self._forget_idle(request.key)

    def _forget_idle(self, key: str) -> None:
        if key not in self._waiting and key not in self._running:
            self._served.pop(key, None)
            self._line_of.pop(key, None)

    def _clear(self, line: "Line") -> None:
        for key in [key for key, owner in self._line_of.items() if owner is line]:
            self._waiting.pop(key, None)
            self._running.pop(key, None)
            self._forget_idle(key)

    def _requests_of(self, line: "Line") -> Iterator[Request]:
        for key, queue in self._waiting.items():
            if self._line_of[key] is line:
                yield from queue


class Line:
    """One scheduler's waiting requests, in the turns of its queue (`Scheduler.waiting`)."""

    def __init__(self, queue: FairQueue) -> None:
        # The queue whose turns this line follows (shared with the other engines' lines).
        self.queue = queue
        # How many requests wait in this line.
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Request]:
        return self.queue._requests_of(self)

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and any(r is request for r in self)

    def append(self, request: Request) -> None:
        """Queue `request` last of its key."""
        self.queue._enter(self, request, first=False)
        self._count += 1

    def head(self) -> Request | None:
        """The request admitted next, if it is this line's; None when it is another line's
        turn or no key may be admitted (each at its running cap)."""
        key = self.queue.next_key()
        if key is None or self.queue._line_of[key] is not self:
            return None
        return self.queue._waiting[key][0]

    def popleft(self) -> Request:
        """Admit the head (`head()` must have named it): its key's turn is used."""
        head = self.head()
        assert head is not None, "popleft without a head of this line"
        self._count -= 1
        return self.queue._pop(head.key)

    def appendleft(self, request: Request) -> None:
        """An admitted request goes back first in its key's line (preempted, or its step
        failed): it no longer runs."""
        self.queue._enter(self, request, first=True)
        self.queue._stopped(request)
        self._count += 1

    def remove(self, request: Request) -> None:
        """A waiting request leaves (failed, or its caller went away)."""
        self.queue._remove(request)
        self._count -= 1

    def left(self, request: Request) -> None:
        """An admitted request leaves (finished, failed, or its caller went away); nothing
        for one that already left."""
        self.queue._stopped(request)

    def clear(self) -> None:
        """Forget every request of this line, waiting or running: its engine stopped (closed
        or failed), so they wait for nothing and must not hold the other lines' turns."""
        self.queue._clear(self)
        self._count = 0
