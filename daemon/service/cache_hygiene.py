"""K/V that outlives its owner in the prefix cache: dropped with a private session, zeroed on
eviction.

A committed block whose last reference goes stays cached, K/V included, so that a later prompt
under the same salt can reuse it. Two consequences for tenants, handled here:

- A session that gave no cache_salt has a salt of its own: once it ends (closed, or expired by
  its lease), no one can ever hit the blocks it left cached. They are dropped when it ends:
  back to the free list, zeroed first when `zero_freed_blocks` is on. The service learns which
  blocks a session parked from the pool's cache events during each of its calls.

The pool does not call out: it queues typed events (daemon/core/cache_events.py: Evicted,
Parked, Committed, Uncommitted, Offloaded, Restored) while a call `watch`es, and `drain` takes
them after each pool operation and hands each to its listeners (`_hear`): the private blocks,
the model cache, zeroing, KV events and host copies.
- A cached block evicted to make room is handed to a new owner, often another tenant, with
  the old K/V in it (copied first to the host tier, where the format has one: host_copies.py).
  With `zero_freed_blocks` on, the evicting call zeroes it: the zeroing is
  a step of that call's memory work, recorded when the eviction happens, so it runs before
  any copy the same call makes into the block and before the answer leaves.

Blocks cached under a shared salt stay when a session ends: other sessions of the salt may
hit them (that is what the salt is for). Every record here changes through the pool's
journal, so a call that fails leaves it as it was.
"""

import contextlib
from collections.abc import Iterator

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.core.cache_events import (
    CacheEvent,
    Committed,
    Evicted,
    Offloaded,
    Parked,
    Restored,
    Uncommitted,
)
from pagedkv.daemon.service.host_copies import HostCopies, Owners
from pagedkv.daemon.service.kv_events import FormatEvents
from pagedkv.daemon.service.memory_order import MemoryWork
from pagedkv.daemon.service.model_cache import ModelCache
from pagedkv.daemon.service.private_blocks import PrivateBlocks
from pagedkv.daemon.service.sessions import Session


class CacheHygiene:
    """The service's part in keeping one tenant's cached K/V from the next (module docstring)."""

    def __init__(self, pool: BlockPool, zero_blocks: bool) -> None:
        self._pool = pool
        # Zero evicted blocks, and the blocks dropped when a private session ends.
        self.zero_blocks = zero_blocks
        # The cached blocks of live private-salt sessions.
        self.private = PrivateBlocks(pool.journal)
        # Every committed cached block's model (its memory, its sleep: model_cache.py).
        self.cached = ModelCache(pool.journal)
        # The format's KV events (kv_events.py); None: events are off, nothing is recorded.
        self.events: FormatEvents | None = None
        # The format's host tier (host_copies.py); None: it has none.
        self.host: HostCopies | None = None
        # The call whose cache events the pool queues: its session and memory work (None:
        # none).
        self._call: tuple[Session, MemoryWork] | None = None

    @contextlib.contextmanager
    def watch(self, session: Session, work: MemoryWork) -> Iterator[None]:
        """Around one call of `session`: the pool queues its cache events, which `drain`
        hands to the listeners (and the end of the call, for any left)."""
        self._call = (session, work)
        try:
            with self._pool.recording_events():
                yield
                self.drain()
        finally:
            self._call = None

    def drain(self) -> None:
        """Hand the cache events the pool queued since the last drain to the listeners, oldest
        first: after each pool operation of a call, before the call records memory work of its
        own (a copy into an evicted block runs after its zeroing and its copy to the host)."""
        if self._call is None:
            return
        session, work = self._call
        for event in self._pool.take_events():
            self._hear(event, session, work)

    def _hear(self, event: CacheEvent, session: Session, work: MemoryWork) -> None:
        """One event to every listener it concerns: private blocks, the model cache, zeroing,
        KV events, host copies."""
        match event:
            case Evicted(blocks):
                self.private.evicted(blocks)
                self.cached.left(blocks)
                if self.zero_blocks:
                    work.zero(blocks)
                if self.events is not None:
                    self.events.removed(blocks)
            case Parked(blocks, keys):
                model = session.model_number
                self.cached.park([(block, model, key)
                                  for block, key in zip(blocks, keys, strict=True)])
                if session.private_salt:
                    self.private.park(session.number, blocks, keys)
            case Committed(blocks):
                if self.events is not None:
                    self.events.committed(session, blocks)
            case Uncommitted(block):
                # A private session's revived block rewritten in place: its record goes with
                # the key, or the block, freed and then cached by another session, would still
                # count as the private session's (its host copy dropped, and zeroed, when that
                # session ends).
                self.private.evicted([block])
                if self.events is not None:
                    self.events.removed([block])
            case Offloaded(blocks, stored):
                assert self.host is not None, "a pool with a host tier and a service without"
                self.host.offloaded(blocks, stored, work, Owners(self.private, self.cached),
                                    self.events)
            case Restored(slots, blocks):
                assert self.host is not None, "a pool with a host tier and a service without"
                self.host.restored(slots, blocks, work)

    def session_ended(self, session: Session, work: MemoryWork) -> int:
        """Drop what a private-salt session left cached (after its sequences were freed, under
        `watch`); returns how many blocks went back to the free list."""
        record = self.private.release(session.number)
        if self.host is not None:
            self.host.session_ended(session.number, session.private_salt, work, self.events)
        if not session.private_salt:
            return 0
        return len(self.drop(record, work))

    def drop(self, candidates: dict[int, bytes], work: MemoryWork) -> list[int]:
        """Free the candidate blocks still cached under their keys (zeroed when zeroing is
        on); returns them."""
        dropped = self._pool.uncache(candidates)
        self.cached.left(dropped)
        self.private.evicted(dropped)
        if self.events is not None:
            self.events.removed(dropped)
        if self.zero_blocks:
            work.zero(dropped)
        return dropped

    def withdrawn(self, blocks: list[int]) -> None:
        """Cached blocks left the cache with their page (given to another format)."""
        self.private.evicted(blocks)
        self.cached.left(blocks)
        if self.events is not None:
            self.events.removed(blocks)

    def check(self, live: set[int]) -> None:
        """Assert the records' invariants (see PrivateBlocks.check); for tests."""
        cached = self._pool.cached_keys()
        self.private.check(live, cached)
        self.cached.check(cached)
        if self.host is not None:
            self.host.check(live)
