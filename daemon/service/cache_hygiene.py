"""K/V that outlives its owner in the prefix cache: dropped with a private session, zeroed on
eviction.

A committed block whose last reference goes stays cached, K/V included, so that a later prompt
under the same salt can reuse it. Two consequences for tenants, handled here:

- A session that gave no cache_salt has a salt of its own: once it ends (closed, or expired by
  its lease), no one can ever hit the blocks it left cached. They are dropped when it ends:
  back to the free list, zeroed first when `zero_freed_blocks` is on. The service learns which
  blocks a session parked from the pool's cache events during each of its calls.
- A cached block evicted to make room is handed to a new owner, often another tenant, with
  the old K/V in it. With `zero_freed_blocks` on, the evicting call zeroes it: the zeroing is
  a step of that call's memory work, recorded when the eviction happens, so it runs before
  any copy the same call makes into the block and before the answer leaves.

Blocks cached under a shared salt stay when a session ends: other sessions of the salt may
hit them (that is what the salt is for). Every record here changes through the pool's
journal, so a call that fails leaves it as it was.
"""

import contextlib

from pagedkv.daemon.core import CacheEvents, Journal, PoolAllocator
from pagedkv.daemon.service.kv_events import FormatEvents
from pagedkv.daemon.service.model_cache import ModelCache
from pagedkv.daemon.service.session_ops import MemoryWork
from pagedkv.daemon.service.sessions import Session


class PrivateBlocks:
    """Which cached blocks each private-salt session left, so they go when it ends."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        # Session number -> {block: the committed key it was parked under}.
        self._of: dict[int, dict[int, bytes]] = {}
        # Block -> the session number whose record holds it (at most one: a block is parked
        # by one session at a time, and leaves the record when evicted).
        self._owner: dict[int, int] = {}

    def parked(self, number: int, block: int, key: bytes) -> None:
        """Session `number` left `block` cached under `key`."""
        self._journal.record(self._restore, block, *self._entry(block))
        self._forget(block)
        self._of.setdefault(number, {})[block] = key
        self._owner[block] = number

    def evicted(self, blocks: list[int]) -> None:
        """These blocks left the cache for a new owner: no session's record holds them now."""
        for block in blocks:
            if block in self._owner:
                self._journal.record(self._restore, block, *self._entry(block))
                self._forget(block)

    def _entry(self, block: int) -> tuple[int | None, bytes | None]:
        """The session whose record holds `block`, and the key there (None, None if none)."""
        owner = self._owner.get(block)
        return (None, None) if owner is None else (owner, self._of[owner][block])

    def release(self, number: int) -> dict[int, bytes]:
        """Session `number` has ended: its record, removed."""
        record = self._of.pop(number, {})
        for block in record:
            del self._owner[block]
        self._journal.record(self._unrelease, number, record)
        return record

    def _forget(self, block: int) -> None:
        owner = self._owner.pop(block, None)
        if owner is not None:
            record = self._of[owner]
            del record[block]
            if not record:
                del self._of[owner]

    def _restore(self, block: int, owner: int | None, key: bytes | None) -> None:
        self._forget(block)
        if owner is not None and key is not None:
            self._of.setdefault(owner, {})[block] = key
            self._owner[block] = owner

    def _unrelease(self, number: int, record: dict[int, bytes]) -> None:
        if record:
            self._of[number] = record
            self._owner.update(dict.fromkeys(record, number))

    def check(self, live: set[int], cached: dict[int, bytes]) -> None:
        """Assert that only live sessions have records, each of blocks cached under the
        recorded key or in use again (revived by their session), and that the two maps agree."""
        assert set(self._of) <= live, f"records of ended sessions {set(self._of) - live}"
        for number, record in self._of.items():
            assert record, f"an empty record for session {number}"
            for block, key in record.items():
                assert self._owner[block] == number, f"block {block}'s owner disagrees"
                assert cached.get(block, key) == key, f"block {block} is cached under another key"
        assert len(self._owner) == sum(map(len, self._of.values())), "a block recorded twice"


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
        if self._hygiene.events is not None:
            self._hygiene.events.removed([block])


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

    def watch(self, session: Session, work: MemoryWork) -> contextlib.AbstractContextManager[None]:
        """Around one call of `session`: hear its evictions and parked blocks."""
        return self._pool.cache_events(_CallEvents(self, session, work))

    def session_ended(self, session: Session, work: MemoryWork) -> int:
        """Drop what a private-salt session left cached (after its sequences were freed, under
        `watch`); returns how many blocks went back to the free list."""
        record = self.private.release(session.number)
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
