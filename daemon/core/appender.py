"""Appending tokens to many sequences at once: the decode hot path of `BlockPool`.

An append is planned, checked, then made. The plan reads where each row's next token lands
without changing anything; the check returns `NoFit` before anything is touched; the change
takes a new block exactly where a row's last block is full, gives a private copy to each row
that writes into a shared, partially filled last block (copy-on-write), and keys the blocks the
new tokens fill for prefix reuse. Everything is vectorized over the batch except the rare
events: copies, and keying the blocks that just filled.

A reservation (`reserve` slots past the appended tokens) is taken by the same change: a row's
table then reaches past its tokens, its entries beyond the last token's block are fresh blocks
of its own, and a later append that lands in them takes nothing and changes no entry.

The appender also keeps the empty slots that shared partial blocks count too many
(`shared_waste`): a copy changes it, and so do `BlockPool.fork` and `free`.
"""

from typing import NamedTuple

import numpy as np

from pagedkv.daemon.core import _rows
from pagedkv.daemon.core.holders import HeldBlocks
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.physical_blocks import PhysicalBlocks
from pagedkv.daemon.core.seq_table import Int64Array, SeqTable, ragged_entries
from pagedkv.daemon.core.types import BatchAppend, BlockCopy, NoFit
from pagedkv.vocab.blocks import blocks_for

# No rows (a read-only empty index array, shared).
_NONE: Int64Array = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False


class Appender:
    """Grows the tables of `SeqTable` rows over `PhysicalBlocks`; rows in, block ids out."""

    def __init__(self, seqs: SeqTable, blocks: PhysicalBlocks, held: HeldBlocks,
                 journal: Journal, prefix_caching: bool) -> None:
        # The pool's rows, blocks, holder counts and undo journal, shared with `BlockPool`.
        self._seqs = seqs
        self._blocks = blocks
        self._held = held
        self._journal = journal
        # Tokens per block, and whether it is a power of two (then x % B is x & (B - 1), which
        # numpy computes in a third of the time).
        self.block_size = seqs.block_size
        self._pow2 = self.block_size & (self.block_size - 1) == 0
        # Whether blocks are keyed as they fill (`BlockPool.enable_prefix_caching`).
        self.prefix_caching = prefix_caching
        # Sum over shared partially filled blocks of (refcount - 1) x their empty slots: what
        # summing each table's empty slots counts too many (`BlockPool.stats`).
        self.shared_waste = 0

    def append(self, rows: Int64Array, k: int, tokens: Int64Array | None,
               reserve: int = 0) -> BatchAppend | NoFit:
        """Append `k` tokens (ids `tokens` [len(rows), k], or None) to each row, all or none,
        each row's table then covering at least `reserve` slots more."""
        step = self._plan_step(rows) if k == 1 and not reserve else None
        if step is not None:
            return self._append_one(rows, tokens, step)
        return self._append_many(rows, k, tokens, self._plan(rows), reserve)

    def copy(self, row: int, logical_block: int) -> BlockCopy:
        """Give `row` a private copy of its shared block `logical_block`."""
        src = self._seqs.entry(row, logical_block)
        taken = self._blocks.take(1)
        dst = int(taken[0])
        self._blocks.add_refs(np.array([src]), -1)
        assert self._blocks.ref[src] > 0, f"copy-on-write of unshared block {src}"
        if logical_block == (self._seqs.num_tokens[row] - 1) // self.block_size:
            self.shift_waste(-self.last_waste(row))  # its last token's block: one sharer fewer
        self._seqs.set_entry(row, logical_block, dst)
        if self._held.levels:
            groups, replaced = self._seqs.groups[row], np.array([src])
            self._held.add(groups, taken, np.zeros(1, dtype=np.int64))
            self._held.drop(groups, replaced, self._blocks.ref[replaced])
        return BlockCopy(src, dst)

    def last_waste(self, row: int) -> int:
        """Empty slots in the last block of `row` (0 when it is full or the table empty)."""
        return int(-self._seqs.num_tokens[row] % self.block_size)

    def shift_waste(self, delta: int) -> None:
        """A shared partial block gained (delta > 0) or lost sharers: undone on rollback."""
        if delta:
            self.shared_waste += delta
            self._journal.record(self.shift_waste, -delta)

    # ------------------------------------------------------------------ changes

    def _append_one(self, rows: Int64Array, tokens: Int64Array | None,
                    plan: "_StepPlan") -> BatchAppend | NoFit:
        """The decode step: one token each, no row writing into a shared block. Each token
        lands in its row's last block, or where that is full in the next: its reserved entry,
        else a new block. The per-row work is `_rows.apply_step`."""
        st, n, need = self._seqs, len(rows), len(plan.grow)
        if need > len(self._blocks.free) and need > self._blocks.num_available:  # free first
            return NoFit(need, self._blocks.num_available)
        grown = rows[plan.grow]
        st.save_rows(rows, grown)
        if plan.shorts:  # tables whose region is full move to larger ones first
            st.make_room(grown, plan.logical)
        taken = self._blocks.take(len(grown))
        slots, new, sealed = _scratch(n), _scratch(n), _scratch(n)
        ids = None if tokens is None else np.ascontiguousarray(tokens)  # [n, 1]: n ids
        num_sealed = _rows.apply_step(rows, plan.written, plan.grow, taken, ids, st.num_tokens,
                                      st.num_blocks, st.start, st.capacity, st.store.data,
                                      st.partial, st.chain_ok, self.block_size,
                                      self.prefix_caching, slots, new, sealed)
        st.grew(n, len(grown))
        if self._held.levels:
            self._hold(grown, taken)
        if num_sealed:
            filled = sealed[:num_sealed]
            self._seal(rows[filled], plan.written[filled])
        # An empty row's first block adds no charge: it was charged one while empty.
        return BatchAppend(slots, plan.grow, plan.logical, taken, [], new, need - plan.firsts)

    def _append_many(self, rows: Int64Array, k: int, tokens: Int64Array | None,
                     plan: "_AppendPlan", reserve: int) -> BatchAppend | NoFit:
        """Any append: several tokens each (they may fill several blocks), rows writing into
        shared blocks, which first get private copies, or a reservation. New entries go past
        each table's end (reserved entries included) up to num_tokens + reserve slots."""
        st, bs, old = self._seqs, self.block_size, plan.old
        old_nb = blocks_for(old, bs)  # the blocks holding tokens
        have = st.num_blocks[rows]  # the table: those, then any reserved
        new_nb = np.maximum(have, blocks_for(old + k + reserve, bs))
        grow_count = new_nb - have
        grown = int(grow_count.sum())
        need = grown + self._copies_needed(plan.last[plan.cow])
        available = self._blocks.num_available
        if need > available:
            return NoFit(need, available)
        grow = grow_count.nonzero()[0]
        st.save_rows(rows, rows[grow])
        copies, copied = [], []
        for i in plan.cow.tolist():
            if self._needs_cow(int(rows[i])):  # the last sharer in the batch keeps the original
                copies.append(self.copy(int(rows[i]), int(old_nb[i]) - 1))
                copied.append(i)
        index, logical = ragged_entries(grow, have[grow], grow_count[grow])
        taken = self._take_entries(rows[index], logical)
        st.num_blocks[rows] = new_nb
        st.num_tokens[rows] = old + k
        st.grew(len(rows) * k, grown)
        self._record_tokens(rows, old, plan.offset, tokens)
        pos = old[:, None] + np.arange(k)
        slots = st.entries(rows[:, None], pos // bs) * bs + pos % bs
        if copied:
            index = np.concatenate([copied, index])
            logical = np.concatenate([old_nb[copied] - 1, logical])
            taken = np.concatenate([[copy.dst for copy in copies], taken])
        charged = grown - int(np.count_nonzero(have == 0))  # as in _append_one
        return BatchAppend(slots.ravel(), index, logical, taken, copies, old + k, charged)

    def _take_entries(self, rows: Int64Array, logical: Int64Array) -> Int64Array:
        """Fresh blocks for the table entries (rows[i], logical[i]); returns them in order."""
        taken = self._blocks.take(len(rows))
        if len(rows):
            self._seqs.put_entries(rows, logical, taken)
            self._hold(rows, taken)
        return taken

    def _hold(self, rows: Int64Array, taken: Int64Array) -> None:
        """Rows[i] took fresh block taken[i]: their groups hold it (`track_holders`)."""
        for level, holders in enumerate(self._held.levels):
            if len(rows):
                holders.add(self._seqs.groups[rows, level], taken, np.zeros_like(taken))

    # --------------------------------------------------------- prefix caching

    def _record_tokens(self, rows: Int64Array, old: Int64Array, offset: Int64Array,
                       tokens: Int64Array | None) -> None:
        """Remember the ids `tokens` [len(rows), k] appended to `rows` (which held `old`
        tokens, `offset` = old % block_size) and key each block they fill. An append without
        ids breaks the rows' chains: their later blocks are never keyed. One step per token
        column, not per token."""
        st, bs = self._seqs, self.block_size
        if tokens is None:
            st.chain_ok[rows] = False
            return
        if not self.prefix_caching:
            return
        for j in range(tokens.shape[1]):
            if j:
                offset = (old + j) % bs
            st.partial[rows, offset] = tokens[:, j]  # junk, harmless, in rows not chain_ok
            filled = (offset == bs - 1).nonzero()[0]
            if not len(filled):
                continue
            sealed = rows[filled]
            known = st.chain_ok[sealed]  # rows whose ids are all known: usually every one
            if np.count_nonzero(known) < len(filled):
                filled, sealed = filled[known], sealed[known]
            if len(filled):
                self._seal(sealed, st.entries(sealed, (old[filled] + j) // bs))

    def _seal(self, rows: Int64Array, blocks: Int64Array) -> None:
        """These rows just filled these blocks: key each (pending) by its prefix chain."""
        st = self._seqs
        st.save_chains(rows)
        self._blocks.cache.key_sealed(rows, blocks, st.partial, st.chain_key)

    # ------------------------------------------------------------------- checks

    def _copies_needed(self, shared_last: Int64Array) -> int:
        """Copies for a batch whose rows write into these shared partial blocks (one entry per
        row): m writers of a block with refcount r need m copies, or m - 1 when m == r, since
        the last of them is then the only reference left."""
        if not len(shared_last):
            return 0
        blocks, writers = np.unique(shared_last, return_counts=True)
        return int(np.minimum(writers, self._blocks.ref[blocks] - 1).sum())

    def _needs_cow(self, row: int) -> bool:
        """Whether the next write to `row` lands in a shared, partially filled last block."""
        st, n = self._seqs, int(self._seqs.num_tokens[row])
        return bool(n % self.block_size != 0
                    and self._blocks.ref[st.entry(row, (n - 1) // self.block_size)] > 1)

    def _plan_step(self, rows: Int64Array) -> "_StepPlan | None":
        """Where the next token of each row lands, computed without changing anything
        (`_rows.plan_step`); None when a row writes into a shared partial block (a copy)."""
        st, n = self._seqs, len(rows)
        written, grow, logical = _scratch(n), _scratch(n), _scratch(n)
        # Each shared, partially filled block adds (refcount - 1) x its empty slots > 0 to
        # shared_waste (`check_pool` recounts it): at 0 no write lands in a shared block.
        ref = self._blocks.ref if self.shared_waste else None
        planned = _rows.plan_step(rows, st.num_tokens, st.num_blocks, st.start, st.capacity,
                                  st.store.data, ref, self.block_size, written, grow, logical)
        if planned is None:
            return None
        grows, shorts, firsts = planned
        return _StepPlan(written, grow[:grows], logical[:grows], shorts, firsts)

    def _plan(self, rows: Int64Array) -> "_AppendPlan":
        """Where the next tokens of each row land, computed without changing anything (any
        append: `_append_many`)."""
        st, bs = self._seqs, self.block_size
        old = st.num_tokens[rows]
        offset = old & (bs - 1) if self._pow2 else old % bs
        # Each row's last block, entry (old - 1) // B (tables are ceil(old / B) long): for an
        # empty table, entry -1 reads a junk entry (of the store), masked by offset == 0.
        last = st.entries(rows, (old - 1) // bs)
        # Each shared, partially filled block adds (refcount - 1) x its empty slots > 0 to
        # shared_waste (`check_pool` recounts it): at 0 no write lands in a shared block.
        if not self.shared_waste:
            return _AppendPlan(old, offset, last, _NONE)
        shared = (self._blocks.ref[last] > 1).nonzero()[0]  # few: filter these, not the batch
        cow = shared[offset[shared] != 0] if len(shared) else shared
        return _AppendPlan(old, offset, last, cow)


def _scratch(n: int) -> Int64Array:
    """An uninitialized int64 array of n items, for a compiled step to fill (three
    np.empty calls cost less than unpacking one 2-d array; a positional dtype, less than a
    keyword)."""
    return np.empty(n, np.int64)


class _AppendPlan(NamedTuple):
    """Where an append over rows writes, kept for the change that follows the check."""

    # Tokens of each row before the append, and old % block_size.
    old: Int64Array
    offset: Int64Array
    # Each row's last block (junk for empty tables, where offset == 0).
    last: Int64Array
    # Indices of rows whose next write lands in a shared, partially filled last block.
    cow: Int64Array


class _StepPlan(NamedTuple):
    """Where a decode step over rows writes (`_rows.plan_step`), kept for the change."""

    # The block each row's token lands in (-1 where it needs a new block): [len(rows)].
    written: Int64Array
    # Indices of the rows needing a new block, and that block's logical index in each table.
    grow: Int64Array
    logical: Int64Array
    # Growing rows whose table region is full (moved before the change), and growing rows
    # that were empty (their first block adds no quota charge).
    shorts: int
    firsts: int
