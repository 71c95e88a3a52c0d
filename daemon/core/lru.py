"""The LRU of evictable cached blocks: a doubly linked list threaded through two arrays.

Append at the tail (blocks released), pop at the head (evict the least recently released), and
remove from the middle (a cache hit revives a block) are all O(1) with no allocation, and each
is undone exactly by its inverse (the journal replays them newest first, so a removed block's
old neighbours are its neighbours again when it is put back).
"""

from array import array
from collections.abc import Iterator

from pagedkv.daemon.core import _rows


class LruList:
    """Blocks 0..n-1, each in the list at most once; index n is the sentinel."""

    __slots__ = ("_next", "_prev", "_sentinel", "_size")

    def __init__(self, num_blocks: int) -> None:
        self._sentinel = num_blocks
        # prev/next of each block in the list, -1 for a block not in it: int64 arrays, which
        # the compiled `extend` reads and writes in place.
        self._prev = array("q", [-1]) * (num_blocks + 1)
        self._next = array("q", [-1]) * (num_blocks + 1)
        self._prev[num_blocks] = self._next[num_blocks] = num_blocks
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: int) -> bool:
        return self._prev[block] != -1

    def __iter__(self) -> Iterator[int]:
        """Head (evicted first) to tail."""
        block = self._next[self._sentinel]
        while block != self._sentinel:
            yield block
            block = self._next[block]

    def extend(self, blocks: list[int]) -> None:
        """Append `blocks` (a list) at the tail in order: the most recently released. One
        compiled loop (`_rows.link_tail`): a free releases a whole table at once."""
        _rows.link_tail(self._prev, self._next, blocks)
        self._size += len(blocks)

    def drop_tail(self, n: int) -> None:
        """Undo of `extend` of `n` blocks: unlink the last `n`."""
        for _ in range(n):
            self.remove(self._prev[self._sentinel])

    def pop_head(self) -> int:
        """Remove and return the least recently released block."""
        block = self._next[self._sentinel]
        assert block != self._sentinel, "pop from an empty LRU"
        self.remove(block)
        return block

    def remove(self, block: int) -> tuple[int, int]:
        """Unlink `block`; returns its neighbours (prev, next) for `insert` to undo this."""
        prev, nxt = self._prev[block], self._next[block]
        assert prev != -1, f"block {block} is not in the LRU"
        self._next[prev], self._prev[nxt] = nxt, prev
        self._prev[block] = self._next[block] = -1
        self._size -= 1
        return prev, nxt

    def insert(self, block: int, prev: int, nxt: int) -> None:
        """Link `block` between two adjacent entries (or the sentinel)."""
        assert self._prev[block] == -1, f"block {block} is already in the LRU"
        self._next[prev] = self._prev[nxt] = block
        self._prev[block], self._next[block] = prev, nxt
        self._size += 1

    def put_back_head(self, block: int) -> None:
        """Undo of `pop_head`."""
        self.insert(block, self._sentinel, self._next[self._sentinel])
