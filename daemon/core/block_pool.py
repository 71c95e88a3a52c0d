"""The block pool: sequences' block tables over refcounted blocks, copy-on-write, prefix reuse.

Blocks are free, used or cached (`PhysicalBlocks`); a sequence's table grows lazily, one block
exactly when its last block is full (`SeqTable`); full blocks are keyed for prefix reuse
(`PrefixCache`), pending until the owner commits them (their K/V is then written).

Reservations: an append may also reserve slots ahead (`append_batch(..., reserve_tokens)`), as
vLLM's num_lookahead_tokens: the table then reaches past the tokens, over fresh blocks the
sequence alone holds, so the appends that later land there take no block and change no entry.
Reserved slots hold no token: they are not counted in num_tokens, never committed nor keyed
until tokens fill them; a fork shares only the blocks holding tokens; they go with the sequence.

Copy-on-write: a sequence never writes into a block another table references. Before a write
lands in a shared, partially filled last block, the writer gets a private copy and the call
reports the (src, dst) copy; the owner of the pool memory performs it before the new table is
used. A shared full block is never written again, so appending past it copies nothing.

Every operation checks first and changes state second: a caller mistake raises a `PoolError`,
and a request that does not fit returns `NoFit`, both before anything is touched. Several
operations (a Batch, or an op followed by memory work that may fail) are made all-or-nothing by
`transaction()`, an undo journal whose cost is the work done, never the size of the pool.

Pages: the block ids may span a memory arena that formats of several geometries share
(`pages.py`): page p is blocks [p * k, (p + 1) * k), k = blocks_per_page, and the pool holds
some of the pages. Blocks of the others are withdrawn: never allocated, matched or counted.
`withdraw_pages`, `restore_pages` and `idle_pages` move them; by default every page is held.
"""

import contextlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core import _rows
from pagedkv.daemon.core.appender import Appender
from pagedkv.daemon.core.cache_events import CacheEvent, Committed, Restored, Uncommitted
from pagedkv.daemon.core.content_keys import ContentKeys, PrefixHash
from pagedkv.daemon.core.errors import SequenceExists
from pagedkv.daemon.core.holders import HeldBlocks
from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.pages import Pages, page_count
from pagedkv.daemon.core.physical_blocks import PhysicalBlocks
from pagedkv.daemon.core.pool_checks import check_pool, recount_stats
from pagedkv.daemon.core.seq_table import Int64Array, SeqTable, row_of
from pagedkv.daemon.core.types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqUpdate
from pagedkv.daemon.core.validation import (
    TokenIds,
    batch_tokens,
    check_logical_block,
    commit_counts,
    count,
    seq_tokens,
)
from pagedkv.vocab.blocks import blocks_for


class BlockPool:
    """Owns the metadata of one pool of KV blocks. Knows nothing of tensors or processes."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 prefix_hash: PrefixHash = "sha256", *, blocks_per_page: int = 1,
                 withdrawn: bool = False):
        """`num_blocks` ids in pages of `blocks_per_page` blocks (a multiple of it); every page
        held, or with `withdrawn` none (a format that starts with no memory)."""
        count(num_blocks, "num_blocks", 1)
        count(block_size, "block_size", 1)
        page_count(num_blocks, blocks_per_page)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._journal = Journal()
        # Full blocks' content keys, hashed with `prefix_hash` (content_keys.py).
        self._keys = ContentKeys(prefix_hash)
        self._blocks = PhysicalBlocks(num_blocks, block_size, self._journal, self._keys)
        # The pages of the block ids the pool holds (all, unless some are withdrawn).
        self._pages = Pages(self._blocks, blocks_per_page, withdrawn, self._journal)
        self._seqs = SeqTable(block_size, self._journal)
        # Distinct blocks held per group of sequences (`track_holders`).
        self._held = HeldBlocks()
        # The batched append, copy-on-write, and the waste of shared partial blocks.
        self._appender = Appender(self._seqs, self._blocks, self._held, self._journal,
                                  enable_prefix_caching)

    @property
    def journal(self) -> Journal:
        """Where changes record their undo; callers add their own inside `transaction()`."""
        return self._journal

    def transaction(self) -> AbstractContextManager[Journal]:
        """Run several operations all-or-nothing: if the block raises, every change made inside
        is undone, exactly. The yielded journal takes the caller's own undo records too."""
        return self._journal.transaction()

    # ------------------------------------------------------------------ queries

    @property
    def reservation_blocks(self) -> int:
        return 0  # paged: blocks are taken as tokens need them

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached blocks."""
        return self._blocks.num_available

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

    def committed_tokens(self, seq: Hashable) -> int:
        """Leading tokens of `seq` in committed blocks (K/V certified written): for a sequence
        just allocated, the prefix-cache hit (`SeqUpdate.num_cached_tokens`)."""
        return int(self._seqs.committed[self._row(seq)]) * self.block_size

    def token_ids(self, seq: Hashable) -> list[int] | None:
        """Every token id of `seq` while its chain is whole (each token came with its id):
        its full blocks' ids as keyed (a block whose key a commit race dropped keeps them, and
        a held block is never keyed again), then its partial last block's. None otherwise."""
        row, st, bs = self._row(seq), self._seqs, self.block_size
        if not st.chain_ok[row]:
            return None
        n = int(st.num_tokens[row])
        full = st.table(row)[:n // bs]
        ids: list[int] = self._blocks.cache.tokens_of[full].reshape(-1).tolist()
        ids.extend(st.partial[row, :n % bs].tolist())
        return ids

    def held_blocks(self, seq: Hashable) -> list[int]:
        """The blocks `seq` keeps from new sequences: its table (others may share them)."""
        return self.block_table(seq)

    def table_length(self, seq: Hashable) -> int:
        """Entries of the table of `seq`: ceil(tokens / B), and its reserved blocks."""
        return int(self._seqs.num_blocks[self._row(seq)])

    def quota_of(self, seq: Hashable) -> int:
        """What `seq` counts against quotas now: its table entries, reserved ones included,
        and at least one (as `quota_blocks`)."""
        return max(1, self.table_length(seq))

    def quota_blocks(self, num_tokens: int) -> int:
        """What a sequence of `num_tokens` tokens counts against quotas: its table entries,
        and at least one, so that empty sequences (which cost the daemon a row each) are never
        free: a quota bounds the sequences as well as the blocks."""
        return max(1, blocks_for(num_tokens, self.block_size))

    def fork_copies(self, num_tokens: int) -> int:
        """Copies a fork of a sequence of `num_tokens` tokens makes: none, it shares."""
        return 0

    def track_holders(self, levels: int) -> None:
        """From now on, count the distinct blocks held by each group of sequences, for
        `levels` ways of grouping them (the service: by session, by tenant), so that
        `blocks_held` costs O(1). Call before any sequence exists; every sequence is then made
        inside `holding`."""
        assert not len(self), "track_holders on a pool that holds sequences"
        self._held.track(levels, self.num_blocks, self._journal)
        self._seqs.groups = np.zeros((len(self._seqs.num_tokens), levels), dtype=np.int64)

    def holding(self, groups: Sequence[int]) -> AbstractContextManager[None]:
        """Sequences allocated or forked inside belong to `groups`, one per level."""
        return self._held.holding(groups)

    def blocks_held(self, level: int, group: int) -> int:
        """Distinct blocks the sequences of `group` (at `level`) reference: O(1)."""
        return self._held.held(level, group)

    @property
    def blocks_per_page(self) -> int:
        """Blocks per page: page p is blocks [p * k, (p + 1) * k)."""
        return self._pages.blocks_per_page

    @property
    def held_pages(self) -> int:
        """Pages the pool holds; the blocks of the others are withdrawn."""
        return self._pages.num_held

    def idle_pages(self) -> list[int]:
        """Held pages whose blocks are all unreferenced (free or cached), coldest first: those
        with no cached block, then by the LRU position of their most recently released cached
        block. What `withdraw_pages` accepts. O(num_blocks)."""
        return self._pages.idle()

    # --------------------------------------------------------------- operations

    def withdraw_pages(self, pages: Sequence[int]) -> list[int]:
        """Held pages whose blocks are all unreferenced leave the pool: their blocks are then
        neither free, used nor cached, and no figure counts them. Cached blocks among them are
        evicted (queued as `Evicted`, cache_events.py) and returned. InvalidArgument, nothing
        changed: a page out of range, named twice, already withdrawn, or with a referenced
        block."""
        return self._pages.withdraw(pages)

    def restore_pages(self, pages: Sequence[int]) -> None:
        """Withdrawn pages come back as free blocks with no content, at the tail of the free
        list. InvalidArgument, nothing changed: a page out of range, named twice, or held."""
        self._pages.restore(pages)

    def allocate(self, seq: Hashable, num_tokens: int, token_ids: TokenIds | None = None,
                 salt: bytes = b"", use_host_tier: bool = True) -> SeqUpdate | NoFit:
        """A new sequence of `num_tokens` tokens, reusing cached full blocks of its prefix.

        With token ids (and prefix caching on), the longest prefix of committed full blocks
        under the same salt is shared instead of allocated; `num_cached_tokens` says how many
        leading tokens need no recomputation. Where that prefix goes on in the host tier (and
        `use_host_tier`), the next blocks are fresh ones restored from it: committed at once,
        queued as `Restored`, counted as cached. The prompt's other full blocks
        are keyed pending.
        """
        if seq in self._seqs.row_of:
            raise SequenceExists(f"sequence {seq!r} already exists")
        tokens = seq_tokens(token_ids, count(num_tokens, "num_tokens", 0))
        if not self.enable_prefix_caching:
            tokens = None  # nothing is keyed: the ids are not kept
        bs, root = self.block_size, self._keys.root(salt)
        full = num_tokens // bs
        # Every full block of the prompt hashed once: the keys find the cached prefix, and
        # the blocks past it are keyed with the same keys.
        keys = [] if tokens is None else self._keys.chain(root,
                                                          tokens[:full * bs].reshape(full, bs))
        hits = self._blocks.cache.lookup(keys)
        no_fit = self._allocate_fit(num_tokens, hits)
        if no_fit is not None:
            return no_fit
        host = self._blocks.host
        slots = host.lookup(keys[len(hits):]) if host is not None and use_host_tier else []
        st, cached = self._seqs, len(hits)
        row = st.add(seq, keys[-1] if keys else root, tokens is not None)
        before = self._blocks.ref[hits] if self._held.levels else None
        self._blocks.share(hits)
        taken = self._take_restoring(blocks_for(num_tokens, bs) - cached, slots)
        table = hits + taken.tolist()
        blocks = taken if not cached else np.asarray(table, dtype=np.int64)
        # Restored blocks count as committed with the cached ones (`_restore` commits them).
        st.fill(row, blocks, num_tokens, cached + len(slots),
                None if tokens is None else tokens[full * bs:])
        if before is not None:
            self._hold_new(row, blocks,
                           np.concatenate([before, np.zeros(len(taken), dtype=np.int64)]))
        if tokens is not None:
            self._blocks.cache.count(num_tokens, (cached + len(slots)) * bs)
            parents = [root, *keys][cached:full]
            if parents:  # the prompt's full blocks past the cached prefix: keyed pending
                self._blocks.cache.key_blocks(taken[:full - cached], parents, keys[cached:],
                                              tokens[cached * bs:full * bs].reshape(-1, bs))
        if slots:
            self._restore(taken[:len(slots)].tolist(), slots)
        return SeqUpdate(table, num_tokens, (cached + len(slots)) * bs,
                         self._slots(blocks, num_tokens), [])

    def append(self, seq: Hashable, num_tokens: int = 1,
               token_ids: TokenIds | None = None) -> SeqUpdate | NoFit:
        """Grow `seq` by `num_tokens`; a new block is taken exactly when the last one is full."""
        tokens = seq_tokens(token_ids, count(num_tokens, "num_tokens", 1))
        result = self.append_batch([seq], num_tokens, tokens)
        if isinstance(result, NoFit):
            return result
        return SeqUpdate(self.block_table(seq), self.num_tokens(seq), 0,
                         result.slot_mapping.tolist(), result.copies)

    def append_batch(self, seqs: Sequence[Hashable], num_tokens: int = 1,
                     token_ids: npt.ArrayLike | None = None,
                     reserve_tokens: int = 0) -> BatchAppend | NoFit:
        """Append `num_tokens` tokens to each of many sequences: the decode hot path. Each
        table then covers at least num_tokens + `reserve_tokens` slots (see "Reservations"):
        the blocks that takes are new entries of the answer, as those of the tokens.

        All-or-nothing: either every sequence grows or nothing changes. Everything is vectorized
        over the batch except the rare events: copies, and keying the blocks that just filled.
        """
        k = count(num_tokens, "num_tokens", 1)
        reserve = count(reserve_tokens, "reserve_tokens", 0)
        rows = self._rows(seqs)
        return self._appender.append(rows, k, batch_tokens(token_ids, len(rows), k), reserve)

    def commit(self, seqs: Sequence[Hashable], num_tokens: npt.ArrayLike | None = None) -> int:
        """The owner certifies that the K/V of the first `num_tokens[i]` tokens of `seqs[i]`
        (every token it holds, when None) is written: the pending full blocks among them become
        matchable by later prompts. Returns how many blocks became matchable."""
        rows, st = self._rows(seqs), self._seqs
        counts = None if num_tokens is None else commit_counts(num_tokens, st.num_tokens[rows])
        blocks = st.commit_runs(rows, counts)  # rows in order, each row's in table order
        if not blocks:
            return 0
        matchable = self._blocks.cache.commit(blocks)
        if matchable and self._blocks.events is not None:
            self._blocks.events.append(Committed(matchable))
        return len(matchable)

    def fork(self, parent: Hashable, child: Hashable) -> SeqUpdate:
        """`child` shares every block of `parent` (refcounts + 1); nothing is allocated."""
        src = self._row(parent)
        if child in self._seqs.row_of:
            raise SequenceExists(f"sequence {child!r} already exists")
        row = self._seqs.clone(src, child)
        table = self._seqs.table(row).copy()
        before = self._blocks.ref[table]
        self._blocks.add_refs(table, 1)  # a table never holds a block twice: distinct indices
        self._hold_new(row, table, before)
        # Its partial last block has one more sharer.
        self._appender.shift_waste(self._appender.last_waste(row))
        return SeqUpdate(table.tolist(), int(self._seqs.num_tokens[row]))

    def copy_on_write(self, seq: Hashable, logical_block: int) -> SeqUpdate | NoFit:
        """Make one block of `seq` private before the caller rewrites it.

        A shared block is copied; a private block stays in place but loses its cache key, since
        its content is about to change. Either way the sequence's later blocks are not keyed.
        """
        row = self._row(seq)
        check_logical_block(logical_block, int(self._seqs.num_blocks[row]), seq)
        block = self._seqs.entry(row, logical_block)
        copies: list[BlockCopy] = []
        if self._blocks.ref[block] > 1:
            if self.num_free_blocks < 1:
                return NoFit(1, 0)
            copies.append(self._appender.copy(row, logical_block))
        else:
            cache = self._blocks.cache
            if cache.is_committed(block) and self._blocks.events is not None:
                self._blocks.events.append(Uncommitted(block))
            cache.forget(block)
        self._seqs.set_chain_ok(row, False)
        return SeqUpdate(self.block_table(seq), int(self._seqs.num_tokens[row]), copies=copies)

    def free(self, seq: Hashable) -> list[int]:
        """Drop `seq`. Returns the blocks that went back to the free list with no content kept
        (committed blocks stay cached for later prompts; pending ones lose their key)."""
        row = self._row(seq)
        table = self._seqs.table(row).copy()
        groups = self._seqs.groups[row].tolist() if self._held.levels else []
        # Its last token's block: shared? (At shared_waste 0 no partial block is.)
        waste = self._appender.last_waste(row) if self._appender.shared_waste else 0
        if waste and self._blocks.ref[table[(int(self._seqs.num_tokens[row]) - 1)
                                            // self.block_size]] > 1:
            self._appender.shift_waste(-waste)  # one sharer fewer
        self._seqs.remove(seq)
        released = self._blocks.release(table)
        if groups:
            self._held.drop(np.array(groups), table, self._blocks.ref[table])
        return released

    @contextlib.contextmanager
    def recording_events(self) -> Iterator[None]:
        """Queue a typed event for every change of a block's cache state inside
        (`cache_events.py`); what is not taken by the end is dropped."""
        self._blocks.events = []
        try:
            yield
        finally:
            self._blocks.events = None

    def take_events(self) -> list[CacheEvent]:
        """The events queued since the last take, oldest first; the queue is left empty."""
        events = self._blocks.events
        if not events:
            return []
        self._blocks.events = []
        return events

    def uncache(self, candidates: Mapping[int, bytes]) -> list[int]:
        """Free the candidate blocks still cached under the given keys (content whose only
        possible users are gone, e.g. a session's private salt); returns them."""
        return self._blocks.uncache(candidates)

    def root_key(self, salt: bytes) -> bytes:
        """The parent key of the first block of every sequence allocated under `salt`."""
        return self._keys.root(salt)

    def block_content(self, blocks: Sequence[int]) -> tuple[list[bytes], list[bytes],
                                                            npt.NDArray[np.int64]]:
        """Keyed `blocks`' keys, parent keys and token ids ([len(blocks), block_size])."""
        cache, keys, parents = self._blocks.cache, [], []
        for block in blocks:
            key, parent = cache.key_of[block], cache.parent_of[block]
            assert key is not None and parent is not None, f"block {block} has no key"
            keys.append(key)
            parents.append(parent)
        return keys, parents, cache.tokens_of[list(blocks)]

    def parent_block(self, block: int) -> int | None:
        """The block holding the committed content of keyed `block`'s parent, if any."""
        cache = self._blocks.cache
        parent = cache.parent_of[block]
        return None if parent is None else cache.block_of.get(parent)

    def committed_block(self, key: bytes) -> int | None:
        """The block holding the committed content `key`, if any."""
        return self._blocks.cache.block_of.get(key)

    def cached_keys(self) -> dict[int, bytes]:
        """Every evictable cached block and its key (O(cached blocks): for checks)."""
        cache = self._blocks.cache
        return {block: cache.key_of[block] or b"" for block in cache.evictable}

    # ------------------------------------------------------------------ host tier

    def attach_host_tier(self, num_slots: int) -> HostTier:
        """From now on, copy committed blocks evicted from the pool into a host tier of
        `num_slots` slots and restore prompts' prefixes from it (`host_tier.py`)."""
        count(num_slots, "num_slots", 1)
        self._blocks.host = HostTier(num_slots, self.block_size, self._journal, self._keys)
        return self._blocks.host

    @property
    def host_tier(self) -> HostTier | None:
        return self._blocks.host

    def _take_restoring(self, n: int, slots: list[int]) -> Int64Array:
        """`n` blocks for a new sequence, of which the first len(`slots`) will be filled from
        those host slots: they are touched and protected first, so that the copies this take
        makes of the blocks it evicts never drop them."""
        host = self._blocks.host
        if not slots or host is None:
            return self._blocks.take(n)
        host.touch(slots)
        host.protected = len(slots)
        try:
            return self._blocks.take(n)
        finally:
            host.protected = 0

    def _restore(self, blocks: list[int], slots: list[int]) -> None:
        """The fresh `blocks` after a sequence's cached prefix (keyed pending by `allocate`,
        which counts them committed) hold the host copies in `slots`: committed now, since their
        K/V was certified when it was first computed and the copy is memory work its answer
        waits for."""
        host = self._blocks.host
        assert host is not None
        host.restored(slots)
        events = self._blocks.events
        if events is not None:
            events.append(Restored(slots, blocks))
        matchable = self._blocks.cache.commit(blocks)
        if matchable and events is not None:
            events.append(Committed(matchable))

    # ------------------------------------------------------------------ helpers

    def _hold_new(self, row: int, blocks: Int64Array, before: Int64Array) -> None:
        """A new row (of the groups `holding` names) references `blocks`, whose refcounts
        were `before`."""
        if self._held.levels:  # else nothing is counted: no cost
            self._seqs.groups[row] = self._held.current()
            self._held.add(self._seqs.groups[row], blocks, before)


    def _allocate_fit(self, num_tokens: int, hits: list[int]) -> NoFit | None:
        fresh = blocks_for(num_tokens, self.block_size) - len(hits)
        revived = sum(1 for block in hits if self._blocks.ref[block] == 0) if hits else 0
        available = self._blocks.num_available - revived
        return NoFit(fresh, available) if fresh > available else None

    def _slots(self, table: Int64Array, n: int) -> list[int]:
        """Slots of the first `n` tokens of a table of ceil(n / B) blocks: every slot of its
        blocks, cut at n."""
        return _rows.table_slots(table, n, self.block_size)

    def _row(self, seq: Hashable) -> int:
        return row_of(self._seqs.row_of, seq)

    def _rows(self, seqs: Sequence[Hashable]) -> Int64Array:
        return self._seqs.rows(seqs)

    # -------------------------------------------------------- stats, invariants

    def stats(self) -> PoolStats:
        """Occupancy and prefix-cache counters, from totals the operations keep: O(1).

        Every used block is filled except the empty slots of partially filled ones, and those
        are last blocks. Summing each table's empty slots (block_size x entries - tokens)
        counts a partial block once per table sharing it (forks), `shared_waste` too many."""
        st, bs, cache = self._seqs, self.block_size, self._blocks.cache
        held = self._pages.held_blocks
        used = held - len(self._blocks.free) - len(cache.evictable)
        empty = bs * st.total_entries - st.total_tokens - self._appender.shared_waste
        return PoolStats(
            num_blocks=held, block_size=bs,
            free_blocks=self.num_free_blocks, used_blocks=used,
            cached_blocks=len(cache.evictable), pending_blocks=cache.num_pending,
            filled_slots=used * bs - empty, allocated_slots=used * bs,
            logical_tokens=st.total_tokens, num_sequences=len(st.row_of),
            prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits)

    def _recount_stats(self) -> PoolStats:
        """`stats` recounted from every table entry (O(entries): for checks)."""
        return recount_stats(self._seqs, self._blocks, self._pages)

    def check_invariants(self) -> None:
        """Assert every invariant of the pool and that `stats` equals a recount (`pool_checks`)."""
        check_pool(self._seqs, self._blocks, self._pages, self._held, self.stats())
        if self._blocks.host is not None:
            self._blocks.host.check()
