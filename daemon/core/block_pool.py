"""The block pool: N physical blocks of B token slots, block tables, refcounts, copy-on-write.

Every block is in exactly one of three states:
- free:      refcount 0, no cached content; in `_free` (FIFO).
- used:      refcount > 0 = the number of block tables that reference it.
- cached:    refcount 0 but holding a keyed full block; evictable in LRU order (`PrefixCache`).
Free and cached blocks can both be handed out: a new block comes from `_free` first, and only
then evicts the least recently released cached block.

Copy-on-write: a sequence never writes into a block another table references. Before a write
lands in a shared, partially filled last block, the writer gets a private copy and the call
reports the (src, dst) copy; the owner of the pool memory performs it before the new table is
used. A shared full block is never written again, so appending past it copies nothing.

Every operation checks first and changes state second: a caller mistake raises a `PoolError`,
and a request that does not fit returns `NoFit`, both before anything is touched.
"""

from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt

from .errors import InvalidArgument, SequenceExists, SequenceNotFound
from .prefix_cache import ROOT_KEY, KeyRecord, PrefixCache, block_key, salt_digest
from .seq_table import Int64Array, SeqTable
from .types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqUpdate

TokenIds = Sequence[int] | npt.NDArray[np.integer]


class BlockPool:
    """Owns the metadata of one pool of KV blocks. Knows nothing of tensors or processes."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise InvalidArgument(f"need num_blocks >= 1 and block_size >= 1, got "
                                  f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Refcount of each block: how many block tables reference it.
        self._ref: Int64Array = np.zeros(num_blocks, dtype=np.int64)
        # Free blocks without cached content, handed out oldest first.
        self._free: deque[int] = deque(range(num_blocks))
        self._cache = PrefixCache(num_blocks)
        self._seqs = SeqTable(block_size)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached blocks."""
        return len(self._free) + len(self._cache.evictable)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._seqs.row_of

    def __len__(self) -> int:
        return len(self._seqs.row_of)

    def block_table(self, seq: Hashable) -> list[int]:
        """Logical block i -> physical block, for every block of `seq`."""
        table: list[int] = self._seqs.table(self._row(seq)).tolist()
        return table

    def num_tokens(self, seq: Hashable) -> int:
        return int(self._seqs.num_tokens[self._row(seq)])

    def can_allocate(self, num_tokens: int, token_ids: TokenIds | None = None,
                     salt: bytes = b"") -> bool:
        tokens = self._tokens(token_ids, self._count(num_tokens, "num_tokens", 0))
        hits, _ = self._cache_hits(tokens, salt_digest(salt))
        return self._allocate_fit(num_tokens, hits) is None

    def can_append(self, seq: Hashable, num_tokens: int = 1) -> bool:
        row = self._row(seq)
        return self._append_need(row, self._count(num_tokens, "num_tokens", 1)) <= \
            self.num_free_blocks

    # --------------------------------------------------------------- operations

    def allocate(self, seq: Hashable, num_tokens: int, token_ids: TokenIds | None = None,
                 salt: bytes = b"") -> SeqUpdate | NoFit:
        """A new sequence of `num_tokens` tokens, reusing cached full blocks of its prefix.

        With token ids (and prefix caching on), the longest prefix of full blocks already in the
        pool under the same salt is shared instead of allocated; `num_cached_tokens` says how
        many leading tokens need no recomputation.
        """
        if seq in self._seqs.row_of:
            raise SequenceExists(f"sequence {seq!r} already exists")
        tokens = self._tokens(token_ids, self._count(num_tokens, "num_tokens", 0))
        salt_d = salt_digest(salt)
        hits, chain_key = self._cache_hits(tokens, salt_d)
        no_fit = self._allocate_fit(num_tokens, hits)
        if no_fit is not None:
            return no_fit
        row = self._seqs.add(seq, salt_d, self.enable_prefix_caching and tokens is not None)
        for block in hits:
            self._share(block)
        total = -(-num_tokens // self.block_size)
        table = hits + [self._take() for _ in range(total - len(hits))]
        self._seqs.ensure_cols(total)
        self._seqs.tables[row, :total] = table
        self._seqs.num_blocks[row] = total
        self._seqs.num_tokens[row] = num_tokens
        cached = len(hits) * self.block_size
        self._seqs.chain_key[row] = chain_key
        if tokens is not None and self.enable_prefix_caching:
            self._cache.queries += num_tokens
            self._cache.hits += cached
            self._record_tokens(row, cached, tokens[cached:])
        return SeqUpdate(table, num_tokens, cached, self._slots(row, 0, num_tokens), [])

    def append(self, seq: Hashable, num_tokens: int = 1,
               token_ids: TokenIds | None = None) -> SeqUpdate | NoFit:
        """Grow `seq` by `num_tokens`; a new block is taken exactly when the last one is full."""
        row = self._row(seq)
        tokens = self._tokens(token_ids, self._count(num_tokens, "num_tokens", 1))
        need = self._append_need(row, num_tokens)
        if need > self.num_free_blocks:
            return NoFit(need, self.num_free_blocks)
        old = int(self._seqs.num_tokens[row])
        old_blocks = int(self._seqs.num_blocks[row])
        copies = [self._cow(row, old_blocks - 1)] if self._needs_cow(row) else []
        self._grow(row, old_blocks, -(-(old + num_tokens) // self.block_size))
        self._seqs.num_tokens[row] = old + num_tokens
        self._record_tokens(row, old, tokens)
        table: list[int] = self._seqs.table(row).tolist()
        return SeqUpdate(table, old + num_tokens, 0, self._slots(row, old, num_tokens), copies)

    def append_batch(self, seqs: Sequence[Hashable], num_tokens: int = 1,
                     token_ids: npt.ArrayLike | None = None) -> BatchAppend | NoFit:
        """Append `num_tokens` tokens to each of many sequences: the decode hot path.

        All-or-nothing: either every sequence grows or nothing changes. The feasibility check and
        the slot computation are vectorized; only sequences that cross a block boundary or need a
        copy (about 1 in block_size per decode step) take a Python path.
        """
        k = self._count(num_tokens, "num_tokens", 1)
        rows = self._rows(seqs)
        tokens = self._batch_tokens(token_ids, len(rows), k)
        st, bs = self._seqs, self.block_size
        old, old_nb = st.num_tokens[rows], st.num_blocks[rows]
        new_nb = (old + k + bs - 1) // bs
        last = st.tables[rows, np.maximum(old_nb - 1, 0)]
        cow = (old % bs != 0) & (self._ref[last] > 1)
        need = int((new_nb - old_nb).sum()) + self._copies_needed(last[cow])
        if need > self.num_free_blocks:
            return NoFit(need, self.num_free_blocks)
        st.ensure_cols(int(new_nb.max()))
        changed: list[tuple[int, int]] = []
        copies: list[BlockCopy] = []
        for i in np.flatnonzero(cow).tolist():
            if self._needs_cow(int(rows[i])):  # the last sharer in the batch keeps the original
                copies.append(self._cow(int(rows[i]), int(old_nb[i]) - 1))
                changed.append((i, int(old_nb[i]) - 1))
        for i in np.flatnonzero(new_nb > old_nb).tolist():
            self._grow(int(rows[i]), int(old_nb[i]), int(new_nb[i]))
            changed.extend((i, lb) for lb in range(int(old_nb[i]), int(new_nb[i])))
        st.num_tokens[rows] = old + k
        self._record_tokens_batch(rows, old, tokens)
        positions = old[:, None] + np.arange(k)
        slots = st.tables[rows[:, None], positions // bs] * bs + positions % bs
        idx = np.array(changed, dtype=np.int64).reshape(-1, 2)
        return BatchAppend(slots.ravel(), idx[:, 0], idx[:, 1],
                           st.tables[rows[idx[:, 0]], idx[:, 1]], copies)

    def fork(self, parent: Hashable, child: Hashable) -> SeqUpdate:
        """`child` shares every block of `parent` (refcounts + 1); nothing is allocated."""
        src = self._row(parent)
        if child in self._seqs.row_of:
            raise SequenceExists(f"sequence {child!r} already exists")
        row = self._seqs.clone(src, child)
        table = self._seqs.table(row)
        self._ref[table] += 1  # a table never holds a block twice, so no repeated indices
        return SeqUpdate(table.tolist(), int(self._seqs.num_tokens[row]))

    def copy_on_write(self, seq: Hashable, logical_block: int) -> SeqUpdate | NoFit:
        """Make one block of `seq` private before the caller rewrites it.

        A shared block is copied; a private block is left in place but loses its cache key, since
        its content is about to change. Either way the sequence's later blocks are no longer keyed.
        """
        row = self._row(seq)
        nb = int(self._seqs.num_blocks[row])
        if not isinstance(logical_block, int) or not 0 <= logical_block < nb:
            raise InvalidArgument(f"logical_block {logical_block} is outside the {nb} blocks "
                                  f"of sequence {seq!r}")
        block = int(self._seqs.tables[row, logical_block])
        copies: list[BlockCopy] = []
        if self._ref[block] > 1:
            if self.num_free_blocks < 1:
                return NoFit(1, 0)
            copies.append(self._cow(row, logical_block))
        else:
            self._cache.forget(block)
        self._seqs.chain_ok[row] = False
        table: list[int] = self._seqs.table(row).tolist()
        return SeqUpdate(table, int(self._seqs.num_tokens[row]), copies=copies)

    def free(self, seq: Hashable) -> list[int]:
        """Drop `seq`. Returns the blocks that went back to the free list with no content kept.

        Blocks are released deepest first, so among blocks released together the cache evicts a
        sequence's tail before the prefix that other requests are likelier to share.
        """
        row = self._row(seq)
        table: list[int] = self._seqs.table(row).tolist()
        self._seqs.remove(seq)
        released = []
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if self._cache.key_of[block] is not None:
                self._cache.park(block)
            else:
                self._free.append(block)
                released.append(block)
        return released

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """Run several operations all-or-nothing: any exception restores the state before."""
        saved = (self._ref.copy(), deque(self._free), self._cache.copy(), self._seqs.copy())
        try:
            yield
        except BaseException:
            self._ref, self._free, self._cache, self._seqs = saved
            raise

    # ----------------------------------------------------------- block movement

    def _take(self) -> int:
        """One block for a writer: a free one, else the least recently released cached one."""
        block = self._free.popleft() if self._free else self._cache.evict()
        assert self._ref[block] == 0, f"block {block} handed out with refcount {self._ref[block]}"
        self._ref[block] = 1
        return block

    def _share(self, block: int) -> None:
        """One more table references `block` (a cache hit); revive it if it was evictable."""
        if self._ref[block] == 0:
            self._cache.revive(block)
        self._ref[block] += 1

    def _cow(self, row: int, logical_block: int) -> BlockCopy:
        """Give `row` a private copy of its shared block `logical_block`."""
        src = int(self._seqs.tables[row, logical_block])
        dst = self._take()
        self._ref[src] -= 1
        assert self._ref[src] > 0, f"copy-on-write of unshared block {src}"
        self._seqs.tables[row, logical_block] = dst
        return BlockCopy(src, dst)

    def _grow(self, row: int, old_blocks: int, new_blocks: int) -> None:
        self._seqs.ensure_cols(new_blocks)
        for lb in range(old_blocks, new_blocks):
            self._seqs.tables[row, lb] = self._take()
        self._seqs.num_blocks[row] = new_blocks

    # --------------------------------------------------------- prefix caching

    def _cache_hits(self, tokens: Int64Array | None, salt_d: bytes) -> tuple[list[int], bytes]:
        """Blocks holding the longest cached prefix of full blocks of `tokens`, and the key of
        the last of them (ROOT_KEY if none): the parent of the sequence's next block."""
        hits: list[int] = []
        parent, bs = ROOT_KEY, self.block_size
        if tokens is None or not self.enable_prefix_caching:
            return hits, parent
        for start in range(0, len(tokens) - bs + 1, bs):
            key = block_key(parent, salt_d, tokens[start:start + bs].tobytes())
            block = self._cache.lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = key
        return hits, parent

    def _record_tokens(self, row: int, start: int, tokens: Int64Array | None) -> None:
        """Remember the ids of tokens start.. of `row`, keying each block they fill."""
        if not (self.enable_prefix_caching and self._seqs.chain_ok[row]):
            return
        if tokens is None:
            self._seqs.chain_ok[row] = False
            return
        bs = self.block_size
        for pos, token in enumerate(tokens.tolist(), start):
            self._seqs.partial[row, pos % bs] = token
            if (pos + 1) % bs == 0:
                self._seal(row, pos // bs)

    def _record_tokens_batch(self, rows: Int64Array, old: Int64Array,
                             tokens: Int64Array | None) -> None:
        """`_record_tokens` for many rows at once; only rows that fill a block loop in Python."""
        if not self.enable_prefix_caching:
            return
        if tokens is None:
            self._seqs.chain_ok[rows] = False
            return
        bs, ok = self.block_size, self._seqs.chain_ok[rows]
        for j in range(tokens.shape[1]):
            pos = old + j
            self._seqs.partial[rows, pos % bs] = tokens[:, j]
            for i in np.flatnonzero(ok & ((pos + 1) % bs == 0)).tolist():
                self._seal(int(rows[i]), int(pos[i]) // bs)

    def _seal(self, row: int, logical_block: int) -> None:
        """The block just filled: key it by its prefix chain so later prompts can reuse it."""
        st = self._seqs
        record = KeyRecord(st.chain_key[row], st.salt[row], st.partial[row].tobytes())
        key = block_key(record.parent, record.salt, record.tokens)
        st.chain_key[row] = key
        self._cache.register(int(st.tables[row, logical_block]), record, key)

    # ------------------------------------------------------------ feasibility

    def _allocate_fit(self, num_tokens: int, hits: list[int]) -> NoFit | None:
        fresh = -(-num_tokens // self.block_size) - len(hits)
        revived = sum(1 for block in hits if self._ref[block] == 0)
        available = self.num_free_blocks - revived
        return NoFit(fresh, available) if fresh > available else None

    def _copies_needed(self, shared_last: Int64Array) -> int:
        """Copies for a batch whose rows write into these shared partial blocks (one entry per
        row): m writers of a block with refcount r need m copies, or m - 1 when m == r, since
        the last of them is then the only reference left."""
        blocks, writers = np.unique(shared_last, return_counts=True)
        return int(np.minimum(writers, self._ref[blocks] - 1).sum())

    def _needs_cow(self, row: int) -> bool:
        """Whether the next write to `row` lands in a shared, partially filled last block."""
        st = self._seqs
        nb = int(st.num_blocks[row])
        return bool(st.num_tokens[row] % self.block_size != 0
                    and self._ref[st.tables[row, nb - 1]] > 1)

    def _append_need(self, row: int, num_tokens: int) -> int:
        old = int(self._seqs.num_tokens[row])
        new_blocks = -(-(old + num_tokens) // self.block_size) - int(self._seqs.num_blocks[row])
        return new_blocks + int(self._needs_cow(row))

    def _slots(self, row: int, start: int, count: int) -> list[int]:
        pos = np.arange(start, start + count)
        slots: list[int] = (self._seqs.tables[row, pos // self.block_size] * self.block_size
                            + pos % self.block_size).tolist()
        return slots

    # --------------------------------------------------------------- validation

    def _row(self, seq: Hashable) -> int:
        try:
            return self._seqs.row_of[seq]
        except KeyError:
            raise SequenceNotFound(f"sequence {seq!r} does not exist") from None

    def _rows(self, seqs: Sequence[Hashable]) -> Int64Array:
        if len(seqs) == 0:
            raise InvalidArgument("no sequences given")
        row_of = self._seqs.row_of
        try:
            rows = np.fromiter((row_of[s] for s in seqs), dtype=np.int64, count=len(seqs))
        except KeyError as missing:
            raise SequenceNotFound(f"sequence {missing.args[0]!r} does not exist") from None
        if len(np.unique(rows)) != len(rows):
            raise InvalidArgument("a sequence appears twice in one batch")
        return rows

    @staticmethod
    def _count(value: int, name: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
            raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}")
        return int(value)

    @staticmethod
    def _tokens(token_ids: TokenIds | None, num_tokens: int) -> Int64Array | None:
        if token_ids is None:
            return None
        tokens = _as_int64(token_ids).ravel()
        if len(tokens) != num_tokens:
            raise InvalidArgument(f"{len(tokens)} token_ids given for num_tokens={num_tokens}")
        return tokens

    @staticmethod
    def _batch_tokens(token_ids: npt.ArrayLike | None, num_seqs: int,
                      num_tokens: int) -> Int64Array | None:
        if token_ids is None:
            return None
        tokens = _as_int64(token_ids)
        if tokens.size != num_seqs * num_tokens:
            raise InvalidArgument(f"{tokens.size} token_ids given for {num_seqs} sequences of "
                                  f"{num_tokens} tokens")
        return tokens.reshape(num_seqs, num_tokens)

    # -------------------------------------------------------- stats, invariants

    def stats(self) -> PoolStats:
        """Occupancy and prefix-cache counters (O(total table entries), not for the hot path)."""
        rows, blocks, fills = self._table_entries()
        per_block = np.zeros(self.num_blocks, dtype=np.int64)
        np.maximum.at(per_block, blocks, fills)  # a shared block counts once, at its fullest
        used = int(np.count_nonzero(self._ref))
        return PoolStats(
            num_blocks=self.num_blocks, block_size=self.block_size,
            free_blocks=self.num_free_blocks, used_blocks=used,
            cached_blocks=len(self._cache.evictable), filled_slots=int(per_block.sum()),
            allocated_slots=used * self.block_size,
            logical_tokens=int(self._seqs.num_tokens[rows].sum()), num_sequences=len(rows),
            prefix_cache_queries=self._cache.queries, prefix_cache_hits=self._cache.hits)

    def _table_entries(self) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Live rows, then every (block, filled slots of that entry) over all block tables."""
        st, bs = self._seqs, self.block_size
        rows = np.fromiter(st.row_of.values(), dtype=np.int64, count=len(st.row_of))
        counts = st.num_blocks[rows]
        entry_row = np.repeat(rows, counts)
        logical = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        fills = np.minimum(bs, st.num_tokens[entry_row] - logical * bs)
        return rows, st.tables[entry_row, logical], fills

    def check_invariants(self) -> None:
        """Assert the pool's invariants (module and `SeqTable` docstrings); for tests."""
        free, cached = set(self._free), set(self._cache.evictable)
        used = set(np.flatnonzero(self._ref).tolist())
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & cached or free & used or cached & used), "a block is in two states"
        assert len(free) + len(cached) + len(used) == self.num_blocks, "a block is unaccounted"
        assert (self._ref >= 0).all(), "negative refcount"
        assert all(self._cache.key_of[b] is None for b in free), "a free block keeps a key"
        rows, blocks, _ = self._table_entries()
        refs = np.bincount(blocks, minlength=self.num_blocks)
        assert (refs == self._ref).all(), "refcounts differ from table references"
        st = self._seqs
        expected = (st.num_tokens[rows] + self.block_size - 1) // self.block_size
        assert (st.num_blocks[rows] == expected).all(), "a table is not ceil(tokens / B) long"
        for row in rows.tolist():
            table = st.table(row)
            assert len(np.unique(table)) == len(table), f"row {row} holds a block twice"
        assert not set(st.free_rows) & set(rows.tolist()), "a live row is on the free list"
        self._cache.check()


def _as_int64(token_ids: npt.ArrayLike) -> Int64Array:
    try:
        return np.asarray(token_ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidArgument(f"token_ids must be integers: {err}") from None
