"""The baseline PagedAttention replaced: one contiguous max-length reservation per sequence.

`ContiguousAllocator` answers the calls a serving trace makes of `BlockPool` (allocate, append,
free, stats) over the same memory, but reserves `max_model_len` slots per sequence in one range
chosen first fit. It has no fork or copy-on-write: two sequences cannot share the middle of one
slab, so a contiguous fork is a full copy into a new reservation.
It exists only to measure, on the same trace, the three kinds of waste paging removes:
over-reservation and internal fragmentation (reserved but never filled slots) and external
fragmentation (free slots that no new reservation can use because no hole is large enough).
"""

import bisect
from collections.abc import Hashable

from .errors import InvalidArgument, SequenceExists, SequenceNotFound
from .types import NoFit, PoolStats, SeqUpdate


class ContiguousAllocator:
    """First-fit allocator of fixed `max_model_len`-slot reservations."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if max_model_len < 1 or max_model_len > num_blocks * block_size:
            raise InvalidArgument(f"max_model_len {max_model_len} does not fit in the pool")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_slots = num_blocks * block_size
        # Free ranges as sorted, non-adjacent [start, end) pairs.
        self._holes: list[tuple[int, int]] = [(0, self.num_slots)]
        # Sequence -> (first slot of its reservation, tokens filled).
        self._seqs: dict[Hashable, tuple[int, int]] = {}

    def allocate(self, seq: Hashable, num_tokens: int, token_ids: object = None,
                 salt: bytes = b"") -> SeqUpdate | NoFit:
        """Reserve `max_model_len` slots for `seq` and fill the first `num_tokens`."""
        del token_ids, salt  # no sharing without block tables
        if seq in self._seqs:
            raise SequenceExists(f"sequence {seq!r} already exists")
        self._check_length(num_tokens)
        for i, (start, end) in enumerate(self._holes):
            if end - start >= self.max_model_len:
                self._take(i, start, end)
                self._seqs[seq] = (start, num_tokens)
                return SeqUpdate([], num_tokens, 0, list(range(start, start + num_tokens)))
        return NoFit(self.max_model_len // self.block_size, self.largest_hole() // self.block_size)

    def append(self, seq: Hashable, num_tokens: int = 1, token_ids: object = None) -> SeqUpdate:
        """Fill `num_tokens` more slots of the reservation; it never grows."""
        del token_ids
        start, filled = self._entry(seq)
        self._check_length(filled + num_tokens)
        self._seqs[seq] = (start, filled + num_tokens)
        slots = list(range(start + filled, start + filled + num_tokens))
        return SeqUpdate([], filled + num_tokens, 0, slots)

    def free(self, seq: Hashable) -> list[int]:
        """Return the reservation to the free ranges, merging with its neighbours."""
        start, _ = self._entry(seq)
        del self._seqs[seq]
        end = start + self.max_model_len
        i = bisect.bisect_left(self._holes, (start, end))
        if i < len(self._holes) and self._holes[i][0] == end:
            end = self._holes.pop(i)[1]
        if i > 0 and self._holes[i - 1][1] == start:
            i -= 1
            start = self._holes.pop(i)[0]
        self._holes.insert(i, (start, end))
        return []

    def largest_hole(self) -> int:
        """Slots in the largest free range."""
        return max((end - start for start, end in self._holes), default=0)

    def external_fragmentation(self) -> float:
        """Fraction of all slots that are free but in holes too small for a reservation."""
        stranded = sum(end - start for start, end in self._holes
                       if end - start < self.max_model_len)
        return stranded / self.num_slots

    def stats(self) -> PoolStats:
        """The same figures as `BlockPool.stats`, counting reservations as allocated slots."""
        filled = sum(tokens for _, tokens in self._seqs.values())
        reserved = len(self._seqs) * self.max_model_len
        return PoolStats(
            num_blocks=self.num_blocks, block_size=self.block_size,
            free_blocks=(self.num_slots - reserved) // self.block_size,
            used_blocks=reserved // self.block_size, cached_blocks=0, pending_blocks=0,
            filled_slots=filled,
            allocated_slots=reserved, logical_tokens=filled, num_sequences=len(self._seqs),
            prefix_cache_queries=0, prefix_cache_hits=0)

    def _take(self, i: int, start: int, end: int) -> None:
        if end - start == self.max_model_len:
            del self._holes[i]
        else:
            self._holes[i] = (start + self.max_model_len, end)

    def _entry(self, seq: Hashable) -> tuple[int, int]:
        try:
            return self._seqs[seq]
        except KeyError:
            raise SequenceNotFound(f"sequence {seq!r} does not exist") from None

    def _check_length(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.max_model_len:
            raise InvalidArgument(f"{num_tokens} tokens do not fit a reservation of "
                                  f"max_model_len={self.max_model_len}")
