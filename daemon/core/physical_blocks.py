"""The pool's physical blocks: refcounts, and which blocks are free, used or cached.

Every block is in exactly one of three states:
- free:   refcount 0, no cached content; on `free` (FIFO).
- used:   refcount > 0 = the number of block tables that reference it.
- cached: refcount 0 but holding a committed full block; evictable in LRU order (`PrefixCache`).
  With a host tier, an evicted block's content is first copied there (`host_tier.py`).
A block of a page the pool does not hold is *withdrawn* (`pages.py`): refcount 0, no key, on
neither the free list nor the LRU; it is in none of the three states until its page is restored.
A writer's block comes from `free` first, and only then evicts the least recently released
cached block, so cached content lives as long as memory allows. A used block may hold a pending
key (filled, K/V not yet certified); when its last reference goes, the key goes with it and the
block is free, never cached.

Every change records its undo in the pool's journal (see `journal.py`).

A block leaves or enters the cache on behalf of a call: `events`, when recording (the service
records around each call), gets an `Evicted` for the blocks `take` evicts (they hold an earlier
owner's K/V) and a `Parked` for every block `release` parks (its owner's K/V stays behind), so
the call can zero the one and remember the other; `BlockPool` queues there too the blocks a
commit made matchable and a committed block in use that loses its key (what KV events announce;
`cache_events.py`).
"""

from collections import deque
from collections.abc import Mapping

import numpy as np

from pagedkv.daemon.core import _rows
from pagedkv.daemon.core.cache_events import CacheEvent, Evicted, Offloaded, Parked
from pagedkv.daemon.core.content_keys import ContentKeys
from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.prefix_cache import PrefixCache
from pagedkv.daemon.core.seq_table import Int64Array


class PhysicalBlocks:
    """Refcounts and free/cached bookkeeping of `num_blocks` blocks. No sequences here."""

    def __init__(self, num_blocks: int, block_size: int, journal: Journal,
                 keys: ContentKeys) -> None:
        self.num_blocks = num_blocks
        self._journal = journal
        # Refcount of each block: how many block tables reference it.
        self.ref: Int64Array = np.zeros(num_blocks, dtype=np.int64)
        # Free blocks without cached content, handed out oldest first.
        self.free: deque[int] = deque(range(num_blocks))
        # Content keys, and the LRU of cached blocks with refcount 0.
        self.cache = PrefixCache(num_blocks, block_size, journal, keys)
        # The queue of cache events of the call recording (None: none records).
        self.events: list[CacheEvent] | None = None
        # Where evicted committed blocks are copied (`host_tier.py`); None: nowhere, they go.
        self.host: HostTier | None = None

    @property
    def num_available(self) -> int:
        """Blocks a writer can take now: free plus evictable cached blocks."""
        return len(self.free) + len(self.cache.evictable)

    def take(self, n: int) -> Int64Array:
        """`n` blocks for writers, each with refcount 1."""
        taken = np.empty(n, dtype=np.int64)
        from_free = _rows.pop_free(self.free, taken, self.ref)  # refcount 1 each
        if from_free < n:  # the free list ran out: evict cached blocks
            evicted, keys, parents = self.cache.evict(n - from_free)
            if self.host is not None:
                stored = self.host.store(keys, parents, self.cache.tokens_of[evicted])
                if self.events is not None:
                    self.events.append(Offloaded(evicted, stored))
            if self.events is not None:
                self.events.append(Evicted(evicted))
            # Cached blocks have refcount 0 (`check` proves the states disjoint).
            taken[from_free:] = evicted
            self.ref[taken[from_free:]] = 1
        self._journal.record(self._untake, taken, from_free)
        return taken

    def _untake(self, taken: Int64Array, from_free: int) -> None:
        self.ref[taken] = 0
        self.free.extendleft(reversed(taken[:from_free].tolist()))

    def share(self, blocks: list[int]) -> None:
        """One more table references each of `blocks` (distinct); cached ones are revived."""
        if not blocks:  # an allocation with no cache hit
            return
        shared = np.array(blocks, dtype=np.int64)
        revived = shared[self.ref[shared] == 0]
        if len(revived):
            self.cache.revive(revived.tolist())
        self.add_refs(shared, 1)

    def add_refs(self, blocks: Int64Array, delta: int) -> None:
        """Refcounts of distinct `blocks` change by `delta`; no state changes (fork, CoW)."""
        self.ref[blocks] += delta
        self._journal.record(self._add_refs, blocks, -delta)

    def _add_refs(self, blocks: Int64Array, delta: int) -> None:
        self.ref[blocks] += delta

    def release(self, table: Int64Array) -> list[int]:
        """A table that referenced these blocks is gone (`table` is the caller's copy: the
        undo keeps it). Returns the blocks that went back to the free list with no content
        kept; committed blocks whose count reaches 0 become cached, pending ones lose their key
        (their K/V was never certified).

        Blocks are released deepest first, so among blocks released together the cache evicts
        a sequence's tail before the prefix that other requests are likelier to share.
        """
        # Only the blocks no other table holds change state (a compiled loop: a table never
        # holds a block twice, so each loses one reference).
        unheld = _rows.release_refs(table, self.ref)
        released = self.cache.release(unheld)
        if self.events is not None and len(released) < len(unheld):
            freed, key_of = set(released), self.cache.key_of
            parked = [block for block in unheld if block not in freed]  # cached, with its key
            self.events.append(Parked(parked, [key_of[block] or b"" for block in parked]))
        self.free.extend(released)
        self._journal.record(self._unrelease, table, len(released))
        return released

    def _unrelease(self, table: Int64Array, num_freed: int) -> None:
        for _ in range(num_freed):
            self.free.pop()
        self.ref[table] += 1

    def uncache(self, candidates: Mapping[int, bytes]) -> list[int]:
        """Move every candidate block that is still cached under the given key to the free
        list, its key dropped (content no one can hit any more). Returns those blocks."""
        cache = self.cache
        dropped = [block for block, key in candidates.items()
                   if block in cache.evictable and cache.key_of[block] == key]
        for block in dropped:
            cache.unpark(block)
        self.free.extend(dropped)
        self._journal.record(self._unfree, len(dropped))
        return dropped

    def _unfree(self, count: int) -> None:
        for _ in range(count):
            self.free.pop()

    def withdraw(self, blocks: list[int]) -> list[int]:
        """Unreferenced `blocks` leave the pool (`Pages.withdraw` checked them): cached ones
        are evicted (told to `events`) and returned, free ones leave the free list, whose order
        is otherwise kept."""
        cache = self.cache
        evicted = [block for block in blocks if block in cache.evictable]
        for block in evicted:
            cache.unpark(block)
        if evicted and self.events is not None:
            self.events.append(Evicted(evicted))
        if len(evicted) < len(blocks):  # some were free: the list is rebuilt without them
            gone = set(blocks)
            if self._journal.active:
                self._journal.record(self._refill, list(self.free))
            kept = [block for block in self.free if block not in gone]
            self.free.clear()
            self.free.extend(kept)
        return evicted

    def _refill(self, free: list[int]) -> None:
        self.free.clear()
        self.free.extend(free)

    def restore(self, blocks: list[int]) -> None:
        """Withdrawn `blocks` come back free, with no content, at the tail of the free list."""
        self.free.extend(blocks)
        self._journal.record(self._unfree, len(blocks))

    def check(self, referenced: Int64Array, withdrawn: int = 0) -> None:
        """Assert the states above, given every block-table entry of the pool and the count
        of withdrawn blocks (`Pages.check` checks those)."""
        free, cached = set(self.free), set(self.cache.evictable)
        used = set(np.flatnonzero(self.ref).tolist())
        assert len(free) == len(self.free), "a block is on the free list twice"
        assert len(cached) == len(self.cache.evictable), "a block is in the LRU twice"
        assert not (free & cached or free & used or cached & used), "a block is in two states"
        assert len(free) + len(cached) + len(used) + withdrawn == self.num_blocks, \
            "a block is unaccounted"
        assert all(self.cache.key_of[b] is None for b in free), "a free block keeps a key"
        pending = set(self.cache.pending_blocks())
        assert pending <= used, "a pending block is not referenced by any table"
        refs = np.bincount(referenced, minlength=self.num_blocks)
        assert (refs == self.ref).all(), "refcounts differ from table references"
        self.cache.check()
