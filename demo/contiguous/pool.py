"""The baseline PagedAttention replaced: one contiguous max-length reservation per sequence.

`ContiguousPool` answers every call the service makes of `BlockPool` over the same memory, the
way serving systems before paging managed a KV cache: a new sequence reserves `max_model_len`
token slots at once, as one run of `reservation = ceil(max_model_len / B)` consecutive blocks
chosen first fit (`FirstFit`), and keeps them until it is freed. It exists to be measured
against the paged pool on the same trace (`pagedkvd --allocator contiguous`).

- Appends fill the reservation in place and never need a block; a sequence may not grow past
  `max_model_len` (a caller mistake, `InvalidArgument`).
- Nothing is shared: no prefix cache (`num_cached_tokens` is 0, commit does nothing), and a
  fork reserves a run of its own and copies the parent's filled blocks into it (the copies are
  reported like copy-on-write copies, done in pool memory before the answer). Copy-on-write has
  nothing to copy.
- A block table lists the blocks that hold the sequence's tokens, ceil(num_tokens / B) of
  them, as in the paged pool: block i of the reservation at `start` is `start + i`, and token
  t's slot is `start * B + t`. Runners compute on it unchanged.
- Slots reserved ahead (`append_batch(..., reserve_tokens)`, a Step's reserve_tokens) need no
  block: the table just lists the reservation's blocks up to num_tokens + reserve_tokens slots
  (reported as new entries, as in the paged pool), and appends into them change no entry. Past
  `max_model_len` they are refused like tokens (`InvalidArgument`, naming max_model_len): the
  reservation ends there, and no token can be appended beyond it.
- `num_free_blocks` counts only the free blocks whole reservations can take, so a scheduler
  that admits by it never admits into a hole too small; a sequence costs `reservation` of them.

All-or-nothing as in `BlockPool`: every check runs before anything changes, and every change
records its undo in the pool's journal, so `transaction()` makes any run of calls atomic.
"""

from collections.abc import Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core.cache_events import CacheEvent
from pagedkv.daemon.core.errors import InvalidArgument, SequenceExists
from pagedkv.daemon.core.holders import HeldBlocks
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.seq_table import Int64Array, ragged_entries, row_of, rows_of
from pagedkv.daemon.core.types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqUpdate
from pagedkv.daemon.core.validation import (
    TokenIds,
    batch_tokens,
    check_logical_block,
    commit_counts,
    count,
    seq_tokens,
)
from pagedkv.demo.contiguous.first_fit import FirstFit
from pagedkv.vocab.blocks import blocks_for


class ContiguousPool:
    """Owns the metadata of one pool of KV blocks handed out as max-length reservations."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        count(num_blocks, "num_blocks", 1)
        count(block_size, "block_size", 1)
        count(max_model_len, "max_model_len", 1)
        if max_model_len > num_blocks * block_size:
            raise InvalidArgument(f"max_model_len {max_model_len} does not fit in a pool of "
                                  f"{num_blocks} blocks x {block_size} slots")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        # Never on: contiguous reservations share nothing.
        self.enable_prefix_caching = False
        # Blocks each sequence reserves.
        self.reservation = blocks_for(max_model_len, block_size)
        self._journal = Journal()
        self._runs = FirstFit(num_blocks, self.reservation, self._journal)
        capacity = num_blocks // self.reservation  # live sequences never exceed it
        # Sequence key -> row; rows not in use, reused last freed first.
        self._row_of: dict[Hashable, int] = {}
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))
        # First block of each row's reservation, and the tokens the row's sequence holds.
        self._start: Int64Array = np.zeros(capacity, dtype=np.int64)
        self._num_tokens: Int64Array = np.zeros(capacity, dtype=np.int64)
        # Entries of each row's table: ceil(tokens / B), or more where slots were reserved.
        self._table_blocks: Int64Array = np.zeros(capacity, dtype=np.int64)
        # Distinct blocks held per group of sequences, and each row's groups (`track_holders`).
        self._held = HeldBlocks()
        self._groups: Int64Array = np.zeros((capacity, 0), dtype=np.int64)

    @property
    def journal(self) -> Journal:
        """Where changes record their undo; callers add their own inside `transaction()`."""
        return self._journal

    def transaction(self) -> AbstractContextManager[Journal]:
        """Run several operations all-or-nothing (see `BlockPool.transaction`)."""
        return self._journal.transaction()

    # ------------------------------------------------------------------ queries

    @property
    def reservation_blocks(self) -> int:
        return self.reservation

    @property
    def blocks_per_page(self) -> int:
        """One: the pages the service counts are blocks, and this pool lends none of them."""
        return 1

    @property
    def held_pages(self) -> int:
        """Every page: none is ever withdrawn."""
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks that new reservations can take: those in runs of at least
        `reservation` blocks, rounded down to whole reservations."""
        return self._runs.usable

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    def block_table(self, seq: Hashable) -> list[int]:
        """The first ceil(n / B) blocks of the reservation of `seq`, which hold its n tokens,
        and those of the slots it reserved ahead."""
        row = row_of(self._row_of, seq)
        start = int(self._start[row])
        return list(range(start, start + int(self._table_blocks[row])))

    def num_tokens(self, seq: Hashable) -> int:
        return int(self._num_tokens[row_of(self._row_of, seq)])

    def committed_tokens(self, seq: Hashable) -> int:
        """Always 0: nothing is ever cached for reuse."""
        row_of(self._row_of, seq)
        return 0

    def token_ids(self, seq: Hashable) -> list[int] | None:
        """Always None: no token ids are kept (nothing is cached for reuse)."""
        row_of(self._row_of, seq)
        return None

    def held_blocks(self, seq: Hashable) -> list[int]:
        """The blocks `seq` keeps from new sequences: its whole reservation."""
        start = int(self._start[row_of(self._row_of, seq)])
        return list(range(start, start + self.reservation))

    def quota_blocks(self, num_tokens: int) -> int:
        """What any sequence counts against quotas: its whole reservation."""
        return self.reservation

    def table_length(self, seq: Hashable) -> int:
        """Entries of the table of `seq` (`block_table`)."""
        return int(self._table_blocks[row_of(self._row_of, seq)])

    def quota_of(self, seq: Hashable) -> int:
        """What `seq` counts against quotas: its whole reservation."""
        row_of(self._row_of, seq)
        return self.reservation

    def fork_copies(self, num_tokens: int) -> int:
        """Copies a fork of a sequence of `num_tokens` tokens makes: one per filled block."""
        return blocks_for(num_tokens, self.block_size)

    def external_fragmentation(self) -> float:
        """Fraction of the pool's blocks that are free but in runs too short to reserve."""
        return (self._runs.free_blocks() - self._runs.usable) / self.num_blocks

    def track_holders(self, levels: int) -> None:
        """Count the blocks held by each group of sequences (see `BlockPool.track_holders`):
        here each sequence holds its whole reservation."""
        assert not len(self), "track_holders on a pool that holds sequences"
        self._held.track(levels, self.num_blocks, self._journal)
        self._groups = np.zeros((len(self._start), levels), dtype=np.int64)

    def holding(self, groups: Sequence[int]) -> AbstractContextManager[None]:
        return self._held.holding(groups)

    def blocks_held(self, level: int, group: int) -> int:
        return self._held.held(level, group)

    # --------------------------------------------------------------- operations

    def allocate(self, seq: Hashable, num_tokens: int, token_ids: TokenIds | None = None,
                 salt: bytes = b"", use_host_tier: bool = True) -> SeqUpdate | NoFit:
        """A new sequence of `num_tokens` tokens in a reservation of its own, first fit.
        Token ids are checked, then dropped: nothing is cached (and there is no host tier)."""
        if seq in self._row_of:
            raise SequenceExists(f"sequence {seq!r} already exists")
        seq_tokens(token_ids, self._check_length(count(num_tokens, "num_tokens", 0)))
        start = self._reserve(seq, num_tokens)
        if start is None:
            return self._no_fit()
        return SeqUpdate(self._table(start, num_tokens), num_tokens, 0,
                         list(range(start * self.block_size, start * self.block_size
                                    + num_tokens)))

    def append(self, seq: Hashable, num_tokens: int = 1,
               token_ids: TokenIds | None = None) -> SeqUpdate:
        """Fill `num_tokens` more slots of the reservation of `seq`."""
        tokens = seq_tokens(token_ids, count(num_tokens, "num_tokens", 1))
        result = self.append_batch([seq], num_tokens, tokens)
        return SeqUpdate(self.block_table(seq), self.num_tokens(seq), 0,
                         result.slot_mapping.tolist())

    def append_batch(self, seqs: Sequence[Hashable], num_tokens: int = 1,
                     token_ids: npt.ArrayLike | None = None,
                     reserve_tokens: int = 0) -> BatchAppend:
        """Append `num_tokens` tokens to each of many sequences, all or none; a table entry
        is added where a sequence's tokens or `reserve_tokens` reserved slots past them enter
        the next block of its reservation."""
        k = count(num_tokens, "num_tokens", 1)
        reserve = count(reserve_tokens, "reserve_tokens", 0)
        rows = rows_of(self._row_of, seqs)
        batch_tokens(token_ids, len(rows), k)
        old = self._num_tokens[rows]
        longest = int(old.max()) + k
        self._check_length(longest)
        if longest + reserve > self.max_model_len:
            raise InvalidArgument(f"{longest} tokens and reserve_tokens={reserve} slots past "
                                  "them do not fit a contiguous reservation: the limit is "
                                  f"max_model_len={self.max_model_len}")
        have = self._table_blocks[rows]
        self._journal.record(self._set_tokens, rows, old, have)
        new = old + k
        bs, start = self.block_size, self._start[rows]
        grow_count = np.maximum(have, blocks_for(new + reserve, bs)) - have
        self._num_tokens[rows], self._table_blocks[rows] = new, have + grow_count
        slots = (start[:, None] * bs + old[:, None] + np.arange(k)).ravel()
        grow = grow_count.nonzero()[0]
        index, logical = ragged_entries(grow, have[grow], grow_count[grow])
        return BatchAppend(slots, index, logical, start[index] + logical, [], new, 0)

    def commit(self, seqs: Sequence[Hashable], num_tokens: npt.ArrayLike | None = None) -> int:
        """Checked like `BlockPool.commit`, then nothing: no block is ever shared."""
        commit_counts(num_tokens, self._num_tokens[rows_of(self._row_of, seqs)])
        return 0

    def fork(self, parent: Hashable, child: Hashable) -> SeqUpdate | NoFit:
        """`child` gets a reservation of its own, first fit, and a copy of every block that
        holds a token of `parent`."""
        src = row_of(self._row_of, parent)
        if child in self._row_of:
            raise SequenceExists(f"sequence {child!r} already exists")
        n, parent_start = int(self._num_tokens[src]), int(self._start[src])
        start = self._reserve(child, n)
        if start is None:
            return self._no_fit()
        copies = [BlockCopy(parent_start + i, start + i) for i in range(self.fork_copies(n))]
        return SeqUpdate(self._table(start, n), n, copies=copies)

    def copy_on_write(self, seq: Hashable, logical_block: int) -> SeqUpdate:
        """Nothing to copy: every block of a reservation is private already."""
        row = row_of(self._row_of, seq)
        n = int(self._num_tokens[row])
        check_logical_block(logical_block, blocks_for(n, self.block_size), seq)
        return SeqUpdate(self.block_table(seq), n)

    def free(self, seq: Hashable) -> list[int]:
        """Drop `seq`; its whole reservation goes back to the free runs and is returned."""
        row = row_of(self._row_of, seq)
        start = int(self._start[row])
        del self._row_of[seq]
        self._free_rows.append(row)
        self._journal.record(self._unfree, seq, row, start, int(self._num_tokens[row]),
                             int(self._table_blocks[row]), self._groups[row].copy())
        self._runs.give_back(start)
        blocks = np.arange(start, start + self.reservation)
        self._held.drop(self._groups[row], blocks, np.zeros_like(blocks))
        return blocks.tolist()

    @property
    def host_tier(self) -> None:
        return None  # nothing is cached, so nothing is offloaded

    def recording_events(self) -> AbstractContextManager[None]:
        """Nothing is ever cached, so no cache event is ever queued."""
        return nullcontext()

    def take_events(self) -> list[CacheEvent]:
        """Nothing is ever cached: no events."""
        return []

    def uncache(self, candidates: Mapping[int, bytes]) -> list[int]:
        """Nothing is ever cached: no candidate is freed."""
        return []

    def cached_keys(self) -> dict[int, bytes]:
        return {}

    def root_key(self, salt: bytes) -> bytes:
        """No block is ever keyed: no chain has a root."""
        return b""

    def parent_block(self, block: int) -> int | None:
        """No block is ever keyed: none has a parent."""
        return None

    def block_content(self, blocks: Sequence[int]) -> tuple[list[bytes], list[bytes],
                                                            npt.NDArray[np.int64]]:
        """No block is ever keyed."""
        if blocks:
            raise InvalidArgument("a contiguous pool keys no block")
        return [], [], np.zeros((0, self.block_size), dtype=np.int64)

    # ------------------------------------------------------------- internals

    def _reserve(self, seq: Hashable, num_tokens: int) -> int | None:
        """Cut a reservation for `seq`, a new sequence of `num_tokens` tokens; returns its
        first block, or None (nothing changed) if no free run holds one."""
        start = self._runs.take()
        if start is None:
            return None
        row = self._free_rows.pop()
        self._row_of[seq] = row
        self._start[row], self._num_tokens[row] = start, num_tokens
        self._table_blocks[row] = blocks_for(num_tokens, self.block_size)
        self._journal.record(self._unreserve, seq)
        if self._held.levels:
            self._groups[row] = self._held.current()
            blocks = np.arange(start, start + self.reservation)
            self._held.add(self._groups[row], blocks, np.zeros_like(blocks))
        return start

    def _unreserve(self, seq: Hashable) -> None:
        self._free_rows.append(self._row_of.pop(seq))

    def _unfree(self, seq: Hashable, row: int, start: int, num_tokens: int, table_blocks: int,
                groups: Int64Array) -> None:
        popped = self._free_rows.pop()
        assert popped == row, f"undo of free found row {popped}, expected {row}"
        self._row_of[seq] = row
        # A later reserve of the same transaction may have reused the row: set all again.
        self._start[row], self._num_tokens[row], self._groups[row] = start, num_tokens, groups
        self._table_blocks[row] = table_blocks

    def _set_tokens(self, rows: Int64Array, num_tokens: Int64Array,
                    table_blocks: Int64Array) -> None:
        self._num_tokens[rows], self._table_blocks[rows] = num_tokens, table_blocks

    def _no_fit(self) -> NoFit:
        return NoFit(self.reservation, self._runs.largest())

    def _table(self, start: int, num_tokens: int) -> list[int]:
        return list(range(start, start + blocks_for(num_tokens, self.block_size)))

    def _check_length(self, num_tokens: int) -> int:
        if num_tokens > self.max_model_len:
            raise InvalidArgument(f"a sequence of {num_tokens} tokens does not fit its "
                                  f"reservation: the limit is max_model_len={self.max_model_len}")
        return num_tokens

    # -------------------------------------------------------- stats, invariants

    def _live_rows(self) -> Int64Array:
        return np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))

    def stats(self) -> PoolStats:
        """Occupancy: every live sequence uses its whole reservation; free_blocks counts only
        what new reservations can take (`num_free_blocks`)."""
        rows = self._live_rows()
        filled = int(self._num_tokens[rows].sum())
        used = len(rows) * self.reservation
        return PoolStats(
            num_blocks=self.num_blocks, block_size=self.block_size,
            free_blocks=self.num_free_blocks, used_blocks=used, cached_blocks=0,
            pending_blocks=0, filled_slots=filled, allocated_slots=used * self.block_size,
            logical_tokens=filled, num_sequences=len(rows), prefix_cache_queries=0,
            prefix_cache_hits=0)

    def check_invariants(self) -> None:
        """Assert that the free runs and the reservations tile the pool exactly, and that every
        sequence fits its reservation."""
        self._runs.check()
        rows = self._live_rows()
        cover = np.zeros(self.num_blocks, dtype=np.int64)
        for start, end in self._runs.runs:
            cover[start:end] += 1
        for start in self._start[rows].tolist():
            assert 0 <= start <= self.num_blocks - self.reservation, f"reservation at {start}"
            cover[start:start + self.reservation] += 1
        assert (cover == 1).all(), "a block is in two reservations or runs, or in none"
        held = self._num_tokens[rows]
        assert ((held >= 0) & (held <= self.max_model_len)).all(), "a sequence overflows"
        table = self._table_blocks[rows]
        assert ((blocks_for(held, self.block_size) <= table)
                & (table <= self.reservation)).all(), "a table is shorter than its tokens' " \
            "blocks or longer than its reservation"
        assert not set(self._free_rows) & set(rows.tolist()), "a live row is on the free list"
        assert len(self._free_rows) + len(rows) == len(self._start), "a row is unaccounted"
        blocks = (self._start[rows][:, None] + np.arange(self.reservation)).ravel()
        for level, holders in enumerate(self._held.levels):
            holders.check(np.repeat(self._groups[rows, level], self.reservation), blocks)
