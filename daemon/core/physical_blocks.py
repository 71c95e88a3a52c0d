"""The pool's physical blocks: refcounts, and which blocks are free, used or cached.

Every block is in exactly one of three states:
- free:   refcount 0, no cached content; on `free` (FIFO).
- used:   refcount > 0 = the number of block tables that reference it.
- cached: refcount 0 but holding a keyed full block; evictable in LRU order (`PrefixCache`).
A writer's block comes from `free` first, and only then evicts the least recently released
cached block, so cached content lives as long as memory allows.
"""

from collections import deque

import numpy as np

from .prefix_cache import PrefixCache
from .seq_table import Int64Array


class PhysicalBlocks:
    """Refcounts and free/cached bookkeeping of `num_blocks` blocks. No sequences here."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        # Refcount of each block: how many block tables reference it.
        self.ref: Int64Array = np.zeros(num_blocks, dtype=np.int64)
        # Free blocks without cached content, handed out oldest first.
        self.free: deque[int] = deque(range(num_blocks))
        # Content keys, and the LRU of cached blocks with refcount 0.
        self.cache = PrefixCache(num_blocks, block_size)

    def copy(self) -> "PhysicalBlocks":
        """An independent copy, for all-or-nothing snapshots."""
        other = PhysicalBlocks.__new__(PhysicalBlocks)
        other.num_blocks = self.num_blocks
        other.ref, other.free, other.cache = self.ref.copy(), deque(self.free), self.cache.copy()
        return other

    @property
    def num_available(self) -> int:
        """Blocks a writer can take now: free plus evictable cached blocks."""
        return len(self.free) + len(self.cache.evictable)

    def take(self, n: int) -> Int64Array:
        """`n` blocks for writers, each with refcount 1."""
        free = self.free
        blocks = [free.popleft() for _ in range(min(n, len(free)))]
        if len(blocks) < n:
            blocks += self.cache.evict(n - len(blocks))
        taken = np.array(blocks, dtype=np.int64)
        # Free and cached blocks have refcount 0 (`check` proves the states disjoint).
        self.ref[taken] = 1
        return taken

    def share(self, block: int) -> None:
        """One more table references `block`; revive it if it was cached and evictable."""
        if self.ref[block] == 0:
            self.cache.revive(block)
        self.ref[block] += 1

    def release(self, table: list[int]) -> list[int]:
        """A table that referenced these blocks is gone. Returns the blocks that went back to
        the free list with no content kept; keyed blocks whose count reaches 0 become cached.

        Blocks are released deepest first, so among blocks released together the cache evicts
        a sequence's tail before the prefix that other requests are likelier to share.
        """
        released = []
        for block in reversed(table):
            self.ref[block] -= 1
            if self.ref[block] > 0:
                continue
            if self.cache.key_of[block] is not None:
                self.cache.park(block)
            else:
                self.free.append(block)
                released.append(block)
        return released

    def check(self, referenced: Int64Array) -> None:
        """Assert the states above, given every block-table entry of the pool."""
        free, cached = set(self.free), set(self.cache.evictable)
        used = set(np.flatnonzero(self.ref).tolist())
        assert len(free) == len(self.free), "a block is on the free list twice"
        assert not (free & cached or free & used or cached & used), "a block is in two states"
        assert len(free) + len(cached) + len(used) == self.num_blocks, "a block is unaccounted"
        assert all(self.cache.key_of[b] is None for b in free), "a free block keeps a key"
        refs = np.bincount(referenced, minlength=self.num_blocks)
        assert (refs == self.ref).all(), "refcounts differ from table references"
        self.cache.check()
