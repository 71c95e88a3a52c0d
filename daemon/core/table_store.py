"""Block tables stored ragged: every table in a region of one flat array, sized to the table.

Entry i of a table whose region starts at `start` lives at `data[start + i]`, so a batch reads
or writes one entry of many tables with one gather or scatter (the decode path stays vectorized)
while memory follows the entries held, not rows x the longest table.

Regions hold a power of two of entries, at least MIN_REGION. A table that outgrows its region
moves to one twice as large, and the region it leaves goes on the free list of its size, where
the next region of that size is taken from; new regions are cut from the end of the array, which
doubles when full. An empty table needs no region. When the regions in use cover under a quarter
of the array, the owner packs the live tables into a fresh array sized for them (`pack`): the
array shrinks back as tables are freed, at a cost paid for by the frees since the last packing.

Regions are bookkeeping below the tables, never undone: a region taken inside a transaction that
fails stays with its table (wider is harmless) or goes back to a free list.
"""

from itertools import pairwise

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]

# Entries of a new store, and the least it shrinks to.
INITIAL_ENTRIES = 1024
# The smallest region: most tables (1,024 tokens at block size 16) then never move while they
# grow, for 512 bytes a sequence that holds a block. A move is a Python step on the decode path:
# with 16-entry regions, moves made a decode-only replay of 256 sequences 16% slower.
MIN_REGION = 64


def region_size(entries: int) -> int:
    """The capacity of a region for `entries` entries: 0 for none, else a power of two of at
    least MIN_REGION."""
    return 0 if entries <= 0 else max(MIN_REGION, 1 << (entries - 1).bit_length())


class TableStore:
    """One flat int64 array cut into power-of-two regions, with a free list per size."""

    def __init__(self) -> None:
        # The entries of every region; data[start + i] is entry i of the table at `start`.
        # INITIAL_ENTRIES is read now, not at import: tests shrink it to make regions move.
        self.data: Int64Array = np.zeros(INITIAL_ENTRIES, dtype=np.int64)
        # Entries covered by regions handed out and not released.
        self.in_use = 0
        # Start of the never-used tail of `data`.
        self._end = 0
        # Released regions by size exponent: free[k] holds starts of regions of 2**k entries.
        self._free: list[list[int]] = []

    @property
    def sparse(self) -> bool:
        """Whether packing would shrink the array: regions in use cover under a quarter."""
        return len(self.data) > INITIAL_ENTRIES and 4 * self.in_use < len(self.data)

    def take(self, capacity: int) -> int:
        """The start of a free region of `capacity` (a power of two, >= 1) entries."""
        k = capacity.bit_length() - 1
        self.in_use += capacity
        if k < len(self._free) and self._free[k]:
            return self._free[k].pop()
        if self._end + capacity > len(self.data):
            grown = np.zeros(max(2 * len(self.data), self._end + capacity), dtype=np.int64)
            grown[:self._end] = self.data[:self._end]
            self.data = grown
        start, self._end = self._end, self._end + capacity
        return start

    def release(self, start: int, capacity: int) -> None:
        """Give back the region of `capacity` entries at `start` (capacity 0: no region)."""
        if capacity:
            k = capacity.bit_length() - 1
            if k >= len(self._free):
                self._free.extend([] for _ in range(k + 1 - len(self._free)))
            self._free[k].append(start)
            self.in_use -= capacity

    def pack(self, starts: Int64Array, lengths: Int64Array) -> tuple[Int64Array, Int64Array]:
        """Copy the first lengths[i] entries of the region at starts[i], for every live table,
        into fresh regions of a fresh array sized for them, in order; the old regions are all
        forgotten. Returns the tables' new starts and capacities. O(entries kept)."""
        capacity = np.array([region_size(int(n)) for n in lengths.tolist()], dtype=np.int64)
        new_starts = np.cumsum(capacity) - capacity
        total = int(capacity.sum())
        data = np.zeros(max(INITIAL_ENTRIES, region_size(2 * total)), dtype=np.int64)
        within = ragged_arange(lengths)
        data[np.repeat(new_starts, lengths) + within] = self.data[np.repeat(starts, lengths)
                                                                  + within]
        self.data, self.in_use, self._end, self._free = data, total, total, []
        return new_starts, capacity

    def check(self, starts: Int64Array, capacity: Int64Array, lengths: Int64Array) -> None:
        """Assert that the live tables' regions (given by start, capacity and length) hold
        their tables, lie in the array, overlap neither each other nor a free region, and add
        up to `in_use`."""
        assert (lengths <= capacity).all(), "a table outgrew its region"
        assert all(c == region_size(int(c)) for c in capacity.tolist()), "a region is not 2**k"
        free = [(start, 1 << k) for k, starts_k in enumerate(self._free) for start in starts_k]
        regions = sorted([*zip(starts.tolist(), capacity.tolist(), strict=True), *free])
        regions = [(s, c) for s, c in regions if c]
        assert all(s + c <= t for (s, c), (t, _) in pairwise(regions)), \
            "two regions overlap"
        assert not regions or regions[-1][0] + regions[-1][1] <= self._end <= len(self.data), \
            "a region lies past the array's used part"
        assert int(capacity.sum()) == self.in_use, "in_use differs from the live regions"


def ragged_arange(counts: Int64Array) -> Int64Array:
    """0..c-1 for each c in `counts`, concatenated: the logical index of each table entry."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
