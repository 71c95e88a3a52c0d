"""Free runs of blocks for fixed-size reservations, taken first fit and merged when given back.

The contiguous baseline gives every sequence one run of `size` consecutive blocks. A new run is
cut from the front of the first free run long enough for it (first fit); a run given back merges
with the free runs on either side. Free blocks in a run shorter than `size` cannot serve any
reservation: external fragmentation. With one reservation size every cut and every merge
happens at a multiple of `size` from block 0, so the only run that can be too short is the one
ending at the pool's last block (num_blocks mod size blocks); variable sizes would strand more.

Invariants (checked by `check`): the runs are sorted, non-empty, inside the pool and never
adjacent (adjacent runs are merged); `usable` is the sum over runs of the blocks whole
reservations can take from them. Every change records its undo in the pool's journal.
"""

import bisect

from pagedkv.daemon.core.journal import Journal

# A free run of blocks: [start, end).
Run = tuple[int, int]


class FirstFit:
    """The free runs of a pool of `num_blocks` blocks, handed out `size` blocks at a time."""

    def __init__(self, num_blocks: int, size: int, journal: Journal) -> None:
        assert 1 <= size <= num_blocks, f"a reservation of {size} blocks in {num_blocks}"
        self.num_blocks = num_blocks
        # Blocks per reservation.
        self.size = size
        self._journal = journal
        # Free runs, sorted by start, never adjacent.
        self.runs: list[Run] = [(0, num_blocks)]
        # Free blocks that reservations can take: sum of (length // size) * size over runs.
        self.usable = self._usable(self.runs)

    def take(self) -> int | None:
        """The first block of a new reservation cut from the first run that holds one; None
        (nothing changed) when no run does."""
        for i, (start, end) in enumerate(self.runs):
            if end - start >= self.size:
                rest = [(start + self.size, end)] if end - start > self.size else []
                self._splice(i, i + 1, rest)
                return start
        return None

    def give_back(self, start: int) -> None:
        """The reservation at `start` is free again: merged with its neighbouring runs."""
        end = start + self.size
        runs = self.runs
        lo = hi = bisect.bisect_left(runs, (start, end))
        if hi < len(runs) and runs[hi][0] == end:
            end = runs[hi][1]
            hi += 1
        if lo > 0 and runs[lo - 1][1] == start:
            lo -= 1
            start = runs[lo][0]
        self._splice(lo, hi, [(start, end)])

    def largest(self) -> int:
        """Blocks in the longest free run."""
        return max((end - start for start, end in self.runs), default=0)

    def free_blocks(self) -> int:
        """Blocks in free runs, usable or not (O(runs))."""
        return sum(end - start for start, end in self.runs)

    def _splice(self, lo: int, hi: int, new: list[Run]) -> None:
        """Replace runs[lo:hi] by `new`; the undo is the reverse splice (it records nothing:
        the journal replays with recording off)."""
        old = self.runs[lo:hi]
        self.runs[lo:hi] = new
        self.usable += self._usable(new) - self._usable(old)
        self._journal.record(self._splice, lo, lo + len(new), old)

    def _usable(self, runs: list[Run]) -> int:
        return sum((end - start) // self.size * self.size for start, end in runs)

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        previous_end = -1
        for start, end in self.runs:
            assert 0 <= start < end <= self.num_blocks, f"run [{start}, {end}) is empty or outside"
            assert start > previous_end, f"run [{start}, {end}) overlaps or touches the one before"
            previous_end = end
        assert self.usable == self._usable(self.runs), "the usable count disagrees with the runs"
