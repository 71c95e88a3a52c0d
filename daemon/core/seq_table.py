"""Per-sequence state of the block pool, stored as rows of numpy arrays.

Rows make the decode hot path vectorizable: a batched append reads and writes the lengths and
block tables of many sequences with a handful of numpy operations instead of a Python loop.

Invariants:
- `num_blocks[r] >= ceil(num_tokens[r] / block_size)`: blocks are handed out lazily, one exactly
  when the last is full, so a sequence wastes at most block_size - 1 slots, all in its last
  token's block, unless it reserved slots ahead (a Step's reserve_tokens): then its table
  reaches past its tokens, and the entries past its last token's block are reserved blocks,
  its own (refcount 1), holding no token and keyed by nothing.
- Row r's block table is `store.data[start[r] : start[r] + num_blocks[r]]`, inside a region of
  `capacity[r]` entries (`TableStore`); entries past num_blocks are meaningless.
- `partial[r, : num_tokens[r] % block_size]` holds the token ids of the unfilled last block
  while `chain_ok[r]` (every token so far came with its id), so the block can be keyed when full.
- `committed[r] <= num_tokens[r] // block_size`: the owner certified the K/V of the first
  `committed[r]` blocks as written; later full blocks may still be pending.

Memory follows what is held: tables take regions sized to them, and once a transaction that
freed sequences succeeds, rows and regions are packed when under a quarter of them are in use
(`_shrink`), so the arrays return near their initial size when the sequences are gone.

Changes record their undo in the pool's journal; the hot path records whole arrays of rows at
once (`save_rows`), not one entry per sequence.
"""

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core import _rows
from pagedkv.daemon.core.errors import InvalidArgument, SequenceNotFound
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.table_store import (
    Int64Array as Int64Array,  # the core's alias, re-exported
)
from pagedkv.daemon.core.table_store import TableStore, ragged_arange, region_size
from pagedkv.vocab.blocks import blocks_for

# Rows of a new table, and the least it shrinks to.
INITIAL_ROWS = 64
# The row arrays, all indexed by row (`_grow_rows` and `_shrink_rows` resize them together).
_ROW_ARRAYS = ("num_tokens", "num_blocks", "committed", "start", "capacity", "partial",
               "chain_ok", "groups")


class SeqTable:
    """Rows of sequence state, grown by doubling and packed when sparse; a dict maps sequence
    keys to rows."""

    def __init__(self, block_size: int, journal: Journal) -> None:
        rows = INITIAL_ROWS  # read now, not at import: tests shrink it to make rows move
        self.block_size = block_size
        self._journal = journal
        # Sequence key -> row.
        self.row_of: dict[Hashable, int] = {}
        # Rows not in use, reused last-freed first.
        self.free_rows: list[int] = list(range(rows - 1, -1, -1))
        # Tokens held by each row's sequence.
        self.num_tokens: Int64Array = np.zeros(rows, dtype=np.int64)
        # Blocks in each row's table.
        self.num_blocks: Int64Array = np.zeros(rows, dtype=np.int64)
        # Leading blocks of each row whose K/V the owner certified (`BlockPool.commit`).
        self.committed: Int64Array = np.zeros(rows, dtype=np.int64)
        # Where each row's table lies in `store`, and the entries its region holds (0: none).
        self.start: Int64Array = np.zeros(rows, dtype=np.int64)
        self.capacity: Int64Array = np.zeros(rows, dtype=np.int64)
        # The block tables: entry i of row r is store.data[start[r] + i].
        self.store = TableStore()
        # Token ids of each row's unfilled last block (see the module docstring).
        self.partial: Int64Array = np.zeros((rows, block_size), dtype=np.int64)
        # Whether each row's token ids are all known, so its full blocks can be keyed.
        self.chain_ok: npt.NDArray[np.bool_] = np.zeros(rows, dtype=np.bool_)
        # Key of each row's last full block (its salt's root key before the first): the parent
        # of the next block's key.
        self.chain_key: list[bytes] = [b""] * rows
        # The groups each row's sequence belongs to, one per level of `BlockPool.track_holders`
        # (none until it is called).
        self.groups: Int64Array = np.zeros((rows, 0), dtype=np.int64)
        # Tokens and table entries summed over the live rows, kept as rows change (figures).
        self.total_tokens = 0
        self.total_entries = 0
        # The last list of sequences `rows` looked up (a copy) and their rows: a Step with
        # commit looks the same list up twice, a decode loop the same list step after step.
        self._last_rows: tuple[list[Hashable], Int64Array] | None = None

    def rows(self, seqs: Sequence[Hashable]) -> Int64Array:
        """`rows_of` the live sequences (a read-only array), remembered for the last list
        asked until a sequence leaves or rows are renumbered: a new sequence moves no row."""
        last = self._last_rows
        if last is not None and type(seqs) is list and last[0] == seqs:
            return last[1]
        rows = rows_of(self.row_of, seqs)
        if type(seqs) is list:
            rows.flags.writeable = False
            self._last_rows = (list(seqs), rows)
        return rows

    def add(self, seq: Hashable, chain_key: bytes, chain_ok: bool) -> int:
        """A row for a new, empty sequence whose next block's parent key is `chain_key`."""
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.row_of[seq] = row
        self.num_tokens[row] = self.num_blocks[row] = self.committed[row] = 0
        self.chain_ok[row] = chain_ok
        self.chain_key[row] = chain_key
        self._journal.record(self._unadd, seq)
        return row

    def _unadd(self, seq: Hashable) -> None:
        row = self.row_of.pop(seq)
        self._last_rows = None
        self.grew(-int(self.num_tokens[row]), -int(self.num_blocks[row]))
        self._release_region(row)
        self.free_rows.append(row)

    def clone(self, src: int, seq: Hashable) -> int:
        """A row for `seq` that starts as a copy of row `src` (fork), but for its reserved
        blocks: the copy's table holds only the blocks holding tokens."""
        row = self.add(seq, self.chain_key[src], bool(self.chain_ok[src]))
        held = blocks_for(int(self.num_tokens[src]), self.block_size)
        self.put_table(row, self.table(src)[:held])
        self.num_tokens[row] = self.num_tokens[src]
        self.num_blocks[row] = held
        self.committed[row] = self.committed[src]
        self.partial[row] = self.partial[src]
        self.grew(int(self.num_tokens[row]), int(self.num_blocks[row]))
        return row

    def remove(self, seq: Hashable) -> int:
        """Forget `seq`; its row is reused by a later sequence (so the undo keeps its state)."""
        row = self.row_of.pop(seq)
        self._last_rows = None
        if self._journal.active:
            self._journal.record(self._unremove, seq, row, self._row_state(row))
        self.grew(-int(self.num_tokens[row]), -int(self.num_blocks[row]))
        self._release_region(row)
        self.free_rows.append(row)
        if 4 * len(self.row_of) < len(self.num_tokens) or self.store.sparse:
            self._journal.after(self._shrink)  # rows or regions may be packed
        return row

    def _row_state(self, row: int) -> "_RowState":
        return _RowState(int(self.num_tokens[row]), int(self.committed[row]),
                         self.table(row).copy(), self.partial[row].copy(),
                         bool(self.chain_ok[row]), self.chain_key[row], self.groups[row].copy())

    def _unremove(self, seq: Hashable, row: int, state: "_RowState") -> None:
        popped = self.free_rows.pop()
        assert popped == row, f"undo of remove found row {popped}, expected {row}"
        self.row_of[seq] = row
        self.num_tokens[row], self.committed[row] = state.num_tokens, state.committed
        self.num_blocks[row] = len(state.table)
        self.grew(state.num_tokens, len(state.table))
        self.put_table(row, state.table)
        self.partial[row] = state.partial
        self.chain_ok[row] = state.chain_ok
        self.chain_key[row] = state.chain_key
        self.groups[row] = state.groups

    def save_rows(self, rows: Int64Array, grown: Int64Array) -> None:
        """Record, in one undo record, the lengths and chain flags of `rows` before an append,
        and the partial-block ids of `grown`: those of them that start a new block. A call
        writes ids only past its rows' meaningful ones, except from offset 0 of a new block,
        where an earlier call of the same transaction may have left ids that become
        meaningful again once it is undone. Table entries past num_blocks are meaningless."""
        if self._journal.active:
            self._journal.record(self._restore_rows, rows, self.num_tokens[rows],
                                 self.num_blocks[rows], self.chain_ok[rows], grown,
                                 self.partial[grown])

    def _restore_rows(self, rows: Int64Array, num_tokens: Int64Array, num_blocks: Int64Array,
                      chain_ok: npt.NDArray[np.bool_], grown: Int64Array,
                      partial: Int64Array) -> None:
        self.grew(int((num_tokens - self.num_tokens[rows]).sum()),
                  int((num_blocks - self.num_blocks[rows]).sum()))
        self.num_tokens[rows], self.num_blocks[rows] = num_tokens, num_blocks
        self.chain_ok[rows] = chain_ok
        self.partial[grown] = partial

    def grew(self, tokens: int, entries: int) -> None:
        """The live rows gained `tokens` tokens and `entries` table entries (the totals). The
        undo of the change that grew them restores the totals too (`_restore_rows`, `_unadd`,
        `_unremove`)."""
        self.total_tokens += tokens
        self.total_entries += entries

    def set_entry(self, row: int, logical: int, block: int) -> None:
        """Replace one table entry (copy-on-write)."""
        self._journal.record(self._set_entry, row, logical, int(self.entry(row, logical)))
        self._set_entry(row, logical, block)

    def _set_entry(self, row: int, logical: int, block: int) -> None:
        # Through start at undo time: the row's table may have moved to a larger region since.
        self.store.data[self.start[row] + logical] = block

    def save_chains(self, rows: Int64Array) -> None:
        """Record, for undo, the chain keys of `rows` before a seal moves them on
        (`PrefixCache.key_sealed`)."""
        if self._journal.active:
            row_list = rows.tolist()
            self._journal.record(self._set_chain, row_list,
                                 [self.chain_key[row] for row in row_list])

    def _set_chain(self, rows: list[int], keys: list[bytes]) -> None:
        chain_key = self.chain_key
        for row, key in zip(rows, keys, strict=True):
            chain_key[row] = key

    def commit_runs(self, rows: Int64Array, counts: Int64Array | None) -> list[int]:
        """Rows[i] commits its first counts[i] tokens (None: every token it holds): raise its
        committed count to the full blocks among them, and return the blocks that newly
        counts, rows in order, each row's in table order (`_rows.commit_runs`)."""
        changed, before, blocks = _rows.commit_runs(rows, counts, self.num_tokens,
                                                    self.num_blocks, self.start, self.capacity,
                                                    self.store.data, self.committed,
                                                    self.block_size)
        if changed and self._journal.active:
            self._journal.record(self._set_committed, changed, before)
        return blocks

    def _set_committed(self, rows: list[int], values: list[int]) -> None:
        self.committed[rows] = values

    def set_chain_ok(self, row: int, value: bool) -> None:
        self._journal.record(self._set_chain_ok, row, bool(self.chain_ok[row]))
        self.chain_ok[row] = value

    def _set_chain_ok(self, row: int, value: bool) -> None:
        self.chain_ok[row] = value

    # ------------------------------------------------------------ table entries

    def table(self, row: int) -> Int64Array:
        """The block table of a row (a view, valid until the next change)."""
        start = int(self.start[row])
        return self.store.data[start : start + self.num_blocks[row]]

    def entry(self, row: int, logical: int) -> int:
        """Entry `logical` of row `row`'s table."""
        return int(self.store.data[self.start[row] + logical])

    def entries(self, rows: Int64Array, logical: Int64Array) -> Int64Array:
        """Entries logical[i] of rows[i] (broadcast like numpy indices), in one gather."""
        found: Int64Array = self.store.data[self.start[rows] + logical]
        return found

    def put_entries(self, rows: Int64Array, logical: Int64Array, blocks: Int64Array) -> None:
        """Write entries logical[i] of rows[i], moving tables whose region is too small to a
        larger one first (table writes are undone by the callers' own records)."""
        self.make_room(rows, logical)
        self.store.data[self.start[rows] + logical] = blocks

    def make_room(self, rows: Int64Array, logical: Int64Array) -> None:
        """Move the tables of rows[i] whose region has no entry logical[i] to larger ones."""
        short = (logical >= self.capacity[rows]).nonzero()[0]
        if len(short):
            need: dict[int, int] = {}
            for row, entry in zip(rows[short].tolist(), logical[short].tolist(), strict=True):
                need[row] = max(need.get(row, 0), entry + 1)
            for row, entries in need.items():
                self._move(row, entries)

    def fill(self, row: int, table: Int64Array, num_tokens: int, committed: int,
             tail: Int64Array | None) -> None:
        """Give a new row (no region yet) a region, its table (ceil(num_tokens / B) blocks),
        token count, committed blocks and the ids of its partial last block (`tail`, None when
        unknown): one compiled call (`_rows.fill_row`) after the region is taken."""
        size = region_size(len(table))
        start = self.store.take(size) if size else 0
        try:
            _rows.fill_row(row, table, num_tokens, committed, tail, start, size, self.num_tokens,
                           self.num_blocks, self.start, self.capacity, self.store.data,
                           self.committed, self.partial)
        except Exception:
            self.store.release(start, size)
            raise
        self.grew(num_tokens, len(table))

    def put_table(self, row: int, table: Sequence[int] | Int64Array) -> None:
        """Write a whole table into row `row` (new, or freshly restored), from entry 0."""
        n = len(table)
        start = self._move(row, n) if n > self.capacity[row] else int(self.start[row])
        self.store.data[start : start + n] = table

    def _move(self, row: int, entries: int) -> int:
        """Give `row` a region of at least `entries` entries, its current entries copied;
        returns where the region starts."""
        old, have = int(self.start[row]), int(self.capacity[row])
        capacity = region_size(entries)
        new = self.store.take(capacity)
        if have:
            data = self.store.data  # after take: it may have grown
            data[new : new + have] = data[old : old + have]
            self.store.release(old, have)
        self.start[row], self.capacity[row] = new, capacity
        return new

    def _release_region(self, row: int) -> None:
        self.store.release(int(self.start[row]), int(self.capacity[row]))
        self.start[row] = self.capacity[row] = 0

    # ------------------------------------------------------------------ sizing

    def _grow_rows(self) -> None:
        """Double the rows (never undone: more free rows are harmless)."""
        have = len(self.num_tokens)
        for name in _ROW_ARRAYS:
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
        self.chain_key.extend([b""] * have)
        self.free_rows.extend(range(2 * have - 1, have - 1, -1))

    def _shrink(self) -> None:
        """Pack rows and regions when under a quarter of them are in use (run once a
        transaction that freed sequences succeeded: it renumbers rows, which undo records
        name). Each packing costs O(what is kept), paid for by the frees since the last."""
        rows = len(self.num_tokens)
        if rows > INITIAL_ROWS and 4 * len(self.row_of) < rows:
            self._shrink_rows(max(INITIAL_ROWS, 1 << (2 * len(self.row_of)).bit_length()))
        if self.store.sparse:
            live = np.fromiter(self.row_of.values(), dtype=np.int64, count=len(self.row_of))
            self.start[live], self.capacity[live] = self.store.pack(self.start[live],
                                                                    self.num_blocks[live])

    def _shrink_rows(self, rows: int) -> None:
        """Renumber the live rows 0..n-1, in arrays of `rows` rows."""
        live = np.fromiter(self.row_of.values(), dtype=np.int64, count=len(self.row_of))
        n = len(live)
        for name in _ROW_ARRAYS:
            array = getattr(self, name)
            packed = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
            packed[:n] = array[live]
            setattr(self, name, packed)
        self.chain_key = [self.chain_key[row] for row in live.tolist()] + [b""] * (rows - n)
        self.row_of = dict(zip(self.row_of, range(n), strict=True))
        self._last_rows = None
        self.free_rows = list(range(rows - 1, n - 1, -1))

    def check(self) -> None:
        """Assert that the live rows' tables lie in their regions, which overlap nothing."""
        live = np.fromiter(self.row_of.values(), dtype=np.int64, count=len(self.row_of))
        self.store.check(self.start[live], self.capacity[live], self.num_blocks[live])
        free = np.array(self.free_rows, dtype=np.int64)
        assert not self.capacity[free].any(), "a free row keeps a region"
        assert len(self.free_rows) + len(live) == len(self.num_tokens), "a row is unaccounted"
        assert self.total_tokens == int(self.num_tokens[live].sum()), "total_tokens is off"
        assert self.total_entries == int(self.num_blocks[live].sum()), "total_entries is off"


def row_of(rows: Mapping[Hashable, int], seq: Hashable) -> int:
    """The row of `seq`, or SequenceNotFound."""
    try:
        return rows[seq]
    except KeyError:
        raise SequenceNotFound(f"sequence {seq!r} does not exist") from None


def rows_of(rows: dict[Hashable, int], seqs: Sequence[Hashable]) -> Int64Array:
    """The rows of distinct `seqs` (at least one), in order: SequenceNotFound for an unknown
    one, InvalidArgument for none or a repeated one. One compiled lookup for all
    (`_rows.lookup_rows`)."""
    if len(seqs) == 0:
        raise InvalidArgument("no sequences given")
    found = np.empty(len(seqs), dtype=np.int64)
    looked = _rows.lookup_rows(rows, seqs, found)
    if looked < len(seqs):
        seq = seqs[looked]
        if seq in rows:
            raise InvalidArgument("a sequence appears twice in one batch")
        raise SequenceNotFound(f"sequence {seq!r} does not exist")
    return found


def ragged_entries(rows: Int64Array, first: Int64Array,
                   counts: Int64Array) -> tuple[Int64Array, Int64Array]:
    """Table entries first[i] .. first[i] + counts[i] - 1 of rows[i] (every count >= 1), in
    order, as (row, logical block) per entry."""
    if len(rows) == int(counts.sum()):  # one each (a decode step): no ragged ranges needed
        return rows, first
    return np.repeat(rows, counts), np.repeat(first, counts) + ragged_arange(counts)


class _RowState(NamedTuple):
    """A removed row's state, kept to undo the removal (see `SeqTable` for the fields)."""

    num_tokens: int
    committed: int
    table: Int64Array
    partial: Int64Array
    chain_ok: bool
    chain_key: bytes
    groups: Int64Array
