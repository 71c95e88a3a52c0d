"""Per-sequence state of the block pool, stored as rows of numpy arrays.

Rows make the decode hot path vectorizable: a batched append reads and writes the lengths and
block tables of many sequences with a handful of numpy operations instead of a Python loop.

Invariants:
- `num_blocks[r] == ceil(num_tokens[r] / block_size)`: blocks are handed out lazily, so a
  sequence wastes at most block_size - 1 slots, all in its last block.
- `tables[r, :num_blocks[r]]` is the block table of row r; entries past it are meaningless.
- `partial[r, : num_tokens[r] % block_size]` holds the token ids of the unfilled last block
  while `chain_ok[r]` (every token so far came with its id), so the block can be keyed when full.
"""

from collections.abc import Hashable

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]


class SeqTable:
    """Rows of sequence state, grown by doubling; a dict maps sequence keys to rows."""

    def __init__(self, block_size: int, rows: int = 64, cols: int = 8) -> None:
        self.block_size = block_size
        # Sequence key -> row.
        self.row_of: dict[Hashable, int] = {}
        # Rows not in use, reused last-freed first.
        self.free_rows: list[int] = list(range(rows - 1, -1, -1))
        # Tokens held by each row's sequence.
        self.num_tokens: Int64Array = np.zeros(rows, dtype=np.int64)
        # Blocks in each row's table.
        self.num_blocks: Int64Array = np.zeros(rows, dtype=np.int64)
        # Block tables: tables[r, i] is the physical block of logical block i of row r.
        self.tables: Int64Array = np.zeros((rows, cols), dtype=np.int64)
        # Token ids of each row's unfilled last block (see the module docstring).
        self.partial: Int64Array = np.zeros((rows, block_size), dtype=np.int64)
        # Whether each row's token ids are all known, so its full blocks can be keyed.
        self.chain_ok: npt.NDArray[np.bool_] = np.zeros(rows, dtype=np.bool_)
        # Key of each row's last full block (its salt's root key before the first): the parent
        # of the next block's key.
        self.chain_key: list[bytes] = [b""] * rows

    def copy(self) -> "SeqTable":
        """An independent copy, for all-or-nothing snapshots."""
        other = SeqTable.__new__(SeqTable)
        other.block_size = self.block_size
        other.row_of = dict(self.row_of)
        other.free_rows = list(self.free_rows)
        other.num_tokens = self.num_tokens.copy()
        other.num_blocks = self.num_blocks.copy()
        other.tables = self.tables.copy()
        other.partial = self.partial.copy()
        other.chain_ok = self.chain_ok.copy()
        other.chain_key = list(self.chain_key)
        return other

    def add(self, seq: Hashable, chain_key: bytes, chain_ok: bool) -> int:
        """A row for a new, empty sequence whose next block's parent key is `chain_key`."""
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.row_of[seq] = row
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.chain_ok[row] = chain_ok
        self.chain_key[row] = chain_key
        return row

    def clone(self, src: int, seq: Hashable) -> int:
        """A row for `seq` that starts as an exact copy of row `src` (fork)."""
        row = self.add(seq, self.chain_key[src], bool(self.chain_ok[src]))
        nb = int(self.num_blocks[src])
        self.num_tokens[row] = self.num_tokens[src]
        self.num_blocks[row] = nb
        self.tables[row, :nb] = self.tables[src, :nb]
        self.partial[row] = self.partial[src]
        return row

    def remove(self, seq: Hashable) -> int:
        """Forget `seq`; its row is reused by a later sequence."""
        row = self.row_of.pop(seq)
        self.free_rows.append(row)
        return row

    def table(self, row: int) -> Int64Array:
        """The block table of a row (a view)."""
        return self.tables[row, : self.num_blocks[row]]

    def ensure_cols(self, cols: int) -> None:
        """Make room for block tables of `cols` entries."""
        have = self.tables.shape[1]
        if cols > have:
            grown = np.zeros((self.tables.shape[0], max(cols, 2 * have)), dtype=np.int64)
            grown[:, :have] = self.tables
            self.tables = grown

    def _grow_rows(self) -> None:
        have = len(self.num_tokens)
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros(have, dtype=np.int64)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(have, dtype=np.int64)])
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self.partial = np.concatenate([self.partial, np.zeros_like(self.partial)])
        self.chain_ok = np.concatenate([self.chain_ok, np.zeros(have, dtype=np.bool_)])
        self.chain_key.extend([b""] * have)
        self.free_rows.extend(range(2 * have - 1, have - 1, -1))


def ragged_arange(counts: Int64Array) -> Int64Array:
    """0..c-1 for each c in `counts`, concatenated: the logical index of each table entry."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
