"""K/V that outlives its owner in the prefix cache: dropped with a private session, zeroed on
eviction.

A committed block whose last reference goes stays cached, K/V included, so that a later prompt
under the same salt can reuse it. Two consequences for tenants, handled here:

- A session that gave no cache_salt has a salt of its own: once it ends (closed, or expired by
  its lease), no one can ever hit the blocks it left cached. They are dropped when it ends:
  back to the free list, zeroed first when `zero_freed_blocks` is on. The service learns which
  blocks a session parked from the pool's cache events during each of its calls.
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

from pagedkv.daemon.core import CacheEvents, PoolAllocator
from pagedkv.daemon.core.host_tier import Stored
from pagedkv.daemon.service.host_copies import HostCopies, Owners
from pagedkv.daemon.service.kv_events import FormatEvents
from pagedkv.daemon.service.memory_order import MemoryWork
from pagedkv.daemon.service.model_cache import ModelCache
from pagedkv.daemon.service.private_blocks import PrivateBlocks
from pagedkv.daemon.service.sessions import Session


class _CallEvents(CacheEvents):
    """The cache events of one call of one session."""

    def __init__(self, hygiene: "CacheHygiene", session: Session, work: MemoryWork) -> None:
        self._hygiene = hygiene
        self._session = session
        self._work = work

    def evicted(self, blocks: list[int]) -> None:
        self._hygiene.private.evicted(blocks)
        self._hygiene.cached.left(blocks)
        if self._hygiene.zero_blocks:
            self._work.zero(blocks)
        if self._hygiene.events is not None:
            self._hygiene.events.removed(blocks)

    def parked(self, block: int, key: bytes) -> None:
        self._hygiene.cached.parked(self._session.model_number, block, key)
        if self._session.private_salt:
            self._hygiene.private.parked(self._session.number, block, key)

    def committed(self, blocks: list[int]) -> None:
        if self._hygiene.events is not None:
            self._hygiene.events.committed(self._session, blocks)

    def uncommitted(self, block: int) -> None:
        # A private session's revived block rewritten in place: its record goes with the key,
        # or the block, freed and then cached by another session, would still count as the
        # private session's (its host copy dropped, and zeroed, when that session ends).
        self._hygiene.private.evicted([block])
        if self._hygiene.events is not None:
            self._hygiene.events.removed([block])

    def offloaded(self, blocks: list[int], stored: Stored) -> None:
        hygiene = self._hygiene
        assert hygiene.host is not None, "a pool with a host tier and a service without"
        hygiene.host.offloaded(blocks, stored, self._work,
                               Owners(hygiene.private, hygiene.cached), hygiene.events)

    def restored(self, slots: list[int], blocks: list[int]) -> None:
        assert self._hygiene.host is not None, "a pool with a host tier and a service without"
        self._hygiene.host.restored(slots, blocks, self._work)


class CacheHygiene:
    """The service's part in keeping one tenant's cached K/V from the next (module docstring)."""

    def __init__(self, pool: PoolAllocator, zero_blocks: bool) -> None:
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

    def watch(self, session: Session, work: MemoryWork) -> contextlib.AbstractContextManager[None]:
        """Around one call of `session`: hear its evictions and parked blocks."""
        return self._pool.cache_events(_CallEvents(self, session, work))

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
