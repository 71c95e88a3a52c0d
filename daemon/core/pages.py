"""Pages: a pool holds some pages of its block ids, and gives idle ones back.

Models of different K/V geometries share one memory arena of num_pages pages (kvpool.proto,
"Models and pages"). Each format's `BlockPool` spans the whole arena: block ids
0 .. num_pages * k - 1, page p = blocks [p * k, (p + 1) * k) with k = blocks_per_page, and it
holds only some of the pages at a time. The blocks of a page it does not hold are *withdrawn*,
a fourth state beside free, used and cached (`PhysicalBlocks`): refcount 0, no key, on neither
the free list nor the LRU, so no allocation, cache hit or figure ever sees them.

- `withdraw`: held pages whose blocks are all unreferenced leave the pool. Their free blocks
  leave the free list; their cached blocks are evicted (their keys dropped, the blocks returned
  and told to the cache events as evictions, so the service treats their K/V as it treats any
  evicted block's).
- `restore`: withdrawn pages come back as free blocks with no content, at the tail of the free
  list (as released blocks do), in the order the pages are named, each page's in id order.
- `idle`: the pages a withdraw would accept, coldest first, for whoever moves pages between
  formats (the page broker takes the memory least likely to be hit again).

Both verbs check every page before changing anything (a caller mistake is `InvalidArgument`,
naming the page and why) and record their undo in the journal, so a failed transaction gives
the pages back exactly: free-list and LRU order, keys, held pages.

Costs: pages move when a format runs out of blocks, far less often than calls. A withdraw that
takes free blocks rebuilds the free list, O(free blocks); `idle` reads every refcount and walks
the LRU, O(num_blocks). No other operation pays anything for pages.
"""

import operator
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core.errors import InvalidArgument
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.physical_blocks import PhysicalBlocks
from pagedkv.daemon.core.validation import count


def page_count(num_blocks: int, blocks_per_page: int) -> int:
    """Pages of `blocks_per_page` blocks in `num_blocks` blocks, which must be whole pages."""
    k = count(blocks_per_page, "blocks_per_page", 1)
    if num_blocks % k:
        raise InvalidArgument(f"num_blocks {num_blocks} is not a multiple of "
                              f"blocks_per_page {k}")
    return num_blocks // k


class Pages:
    """Which pages of its block ids a pool holds, and the verbs that move them (module doc)."""

    def __init__(self, blocks: PhysicalBlocks, blocks_per_page: int, withdrawn: bool,
                 journal: Journal) -> None:
        self._blocks = blocks
        self._journal = journal
        # Blocks per page: page p is blocks [p * k, (p + 1) * k).
        self.blocks_per_page = blocks_per_page
        self.num_pages = page_count(blocks.num_blocks, blocks_per_page)
        # Whether the pool holds each page (False: its blocks are withdrawn).
        self.held: npt.NDArray[np.bool_] = np.full(self.num_pages, not withdrawn, dtype=np.bool_)
        # Pages held: held.sum(), kept as pages move.
        self.num_held = 0 if withdrawn else self.num_pages
        if withdrawn:  # a format that starts with no memory
            blocks.free.clear()

    @property
    def held_blocks(self) -> int:
        """Blocks of the held pages: the pool's size for every figure."""
        return self.num_held * self.blocks_per_page

    def withdraw(self, pages: Sequence[int]) -> list[int]:
        """Held pages whose blocks are all unreferenced leave the pool; returns the cached
        blocks evicted to free them (told to the cache events)."""
        todo = self._distinct(pages)
        ref, k = self._blocks.ref, self.blocks_per_page
        for page in todo:
            if not self.held[page]:
                raise InvalidArgument(f"page {page} is already withdrawn")
            used = np.flatnonzero(ref[page * k:(page + 1) * k]) + page * k
            if len(used):
                raise InvalidArgument(f"page {page} has referenced blocks {used.tolist()}")
        evicted = self._blocks.withdraw(self._block_ids(todo))
        self._mark(todo, False)
        return evicted

    def restore(self, pages: Sequence[int]) -> None:
        """Withdrawn pages come back as free blocks with no content (free-list tail)."""
        todo = self._distinct(pages)
        for page in todo:
            if self.held[page]:
                raise InvalidArgument(f"page {page} is not withdrawn")
        self._blocks.restore(self._block_ids(todo))
        self._mark(todo, True)

    def idle(self) -> list[int]:
        """Held pages whose blocks are all unreferenced, coldest first: pages with no cached
        block (in page order), then by the LRU position of each page's most recently released
        cached block."""
        k, blocks = self.blocks_per_page, self._blocks
        idle = self.held & ~blocks.ref.reshape(self.num_pages, k).any(axis=1)
        # LRU position of each cached block, -1 for the others: a page is as warm as its
        # warmest block.
        position = np.full(blocks.num_blocks, -1, dtype=np.int64)
        lru = list(blocks.cache.evictable)
        position[lru] = np.arange(len(lru))
        warmth = position.reshape(self.num_pages, k).max(axis=1)
        pages = np.flatnonzero(idle)
        ordered: list[int] = pages[np.argsort(warmth[pages], kind="stable")].tolist()
        return ordered

    def check(self) -> None:
        """Assert that withdrawn blocks are unreferenced, unkeyed, neither free nor cached."""
        assert int(self.held.sum()) == self.num_held, "held pages miscounted"
        withdrawn = np.flatnonzero(~np.repeat(self.held, self.blocks_per_page))
        blocks = self._blocks
        assert not blocks.ref[withdrawn].any(), "a withdrawn block is referenced"
        free, cached = set(blocks.free), set(blocks.cache.evictable)
        for block in withdrawn.tolist():
            assert block not in free, f"withdrawn block {block} is on the free list"
            assert block not in cached, f"withdrawn block {block} is in the LRU"
            assert blocks.cache.key_of[block] is None, f"withdrawn block {block} keeps a key"

    # ------------------------------------------------------------------ helpers

    def _distinct(self, pages: Sequence[int]) -> list[int]:
        """`pages` as ints, each in range and named once, or InvalidArgument."""
        todo: list[int] = []
        for page in pages:
            try:
                if isinstance(page, bool):
                    raise TypeError
                number = operator.index(page)
            except TypeError:
                raise InvalidArgument(f"page {page!r} is not an integer") from None
            if not 0 <= number < self.num_pages:
                raise InvalidArgument(f"page {number} is out of range [0, {self.num_pages})")
            todo.append(number)
        if len(set(todo)) < len(todo):
            raise InvalidArgument(f"pages {todo} name a page twice")
        return todo

    def _block_ids(self, pages: list[int]) -> list[int]:
        k = self.blocks_per_page
        return [block for page in pages for block in range(page * k, (page + 1) * k)]

    def _mark(self, pages: list[int], held: bool) -> None:
        self.held[pages] = held
        self.num_held += len(pages) if held else -len(pages)
        self._journal.record(self._unmark, pages, held)

    def _unmark(self, pages: list[int], held: bool) -> None:
        self.held[pages] = not held
        self.num_held -= len(pages) if held else -len(pages)
