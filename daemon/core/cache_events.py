"""What the prefix cache gave up and took in during a call, as typed events on a queue.

The pool does not call out: while a call records (`BlockPool.recording_events`), every change
of a block's cache state appends one event to the pool's queue, in the order the pool made
them, and the service takes them (`BlockPool.take_events`) after each pool operation, before it
records any memory work of its own, and hands them to its listeners (private blocks, the model
cache, zeroing, KV events, host copies: daemon/service/cache_hygiene.py). Outside a recording
nothing is queued, so the queue is bounded by one operation's blocks.
"""

from dataclasses import dataclass

from pagedkv.daemon.core.host_tier import Stored


@dataclass(frozen=True, slots=True)
class Evicted:
    """Cached blocks evicted and handed to a writer (they hold an earlier owner's K/V)."""

    # The blocks, in eviction order.
    blocks: list[int]


@dataclass(frozen=True, slots=True)
class Parked:
    """Committed blocks lost their last reference and stay cached, each under its key (one
    event per release: a freed sequence parks every committed block of its table)."""

    # The blocks, in the order the cache took them (deepest of a table first).
    blocks: list[int]
    # Their content keys in the prefix cache, one per block.
    keys: list[bytes]


@dataclass(frozen=True, slots=True)
class Committed:
    """Pending blocks became committed (matchable), each sequence's in table order, so a
    block's parent comes before it."""

    # The blocks, in commit order.
    blocks: list[int]


@dataclass(frozen=True, slots=True)
class Uncommitted:
    """A committed block in use lost its key (its owner is about to rewrite it)."""

    # The block.
    block: int


@dataclass(frozen=True, slots=True)
class Offloaded:
    """Some of just-evicted `blocks` were copied to the host tier; queued before their
    `Evicted`, so the copies are made before anything writes the blocks."""

    # The evicted blocks.
    blocks: list[int]
    # Which were copied where (index into `blocks`, host slot), and the slots dropped for room.
    stored: Stored


@dataclass(frozen=True, slots=True)
class Restored:
    """An allocation fills fresh `blocks` from host `slots`, pairwise (then commits them)."""

    # The host slots read, and the pool blocks written, pairwise.
    slots: list[int]
    blocks: list[int]


CacheEvent = Evicted | Parked | Committed | Uncommitted | Offloaded | Restored
