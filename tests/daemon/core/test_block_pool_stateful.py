"""Random operation sequences against a model of the pool's memory contents.

The machine keeps a simulated KV memory (one token id per slot) and writes each call's tokens
into the slots the pool returns, performing the reported copy-on-write copies first. After every
step, reading any live sequence through its block table must give back exactly its tokens: that
one check catches a write into a shared block, a missed or wrong copy, a prefix-cache hit on the
wrong content, and a block handed to two owners. `check_invariants()` runs after every step too.

Blocks are shareable only once committed: `commit` certifies a sequence's tokens written, and a
request whose prefill fails (garbage in its slots, then freed) must never be matched later. A
rolled-back transaction of random ops must leave the whole state exactly as it was. Appends may
reserve slots ahead (`reserve_tokens`): the reserved blocks are private and unkeyed
(`check_invariants`), and an append into them changes no table entry.

The pool counts the blocks held by two groupings of the sequences (as the service does by session
and by tenant), and keeps its figures as operations run: `check_invariants()` compares both with
a recount from every table entry.

Its block ids are pages of two blocks, and pages come and go (`withdraw_pages`, `restore_pages`)
as another format of a shared arena would take and give back their memory: a withdrawn page's
slots are overwritten, so a block of it handed out or matched later reads back wrong tokens. A
withdraw succeeds exactly for distinct idle pages, a restore exactly for distinct withdrawn
ones; anything else changes nothing.
"""

import contextlib
import itertools
from collections.abc import Hashable

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.daemon.core import (
    BatchAppend,
    BlockCopy,
    BlockPool,
    NoFit,
    PoolError,
    SequenceExists,
    SequenceNotFound,
    SeqUpdate,
)
from pagedkv.daemon.core.validation import TokenIds

from pool_state import pool_state

BLOCK_SIZE = 4
NUM_BLOCKS = 12
BLOCKS_PER_PAGE = 2
PAGES = st.lists(st.integers(0, NUM_BLOCKS // BLOCKS_PER_PAGE - 1), max_size=3)
NAMES = st.sampled_from("abcdefg")
# A few shared prompt heads make prefix-cache hits likely.
HEADS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


def groups_of(seq: str) -> tuple[int, int]:
    """Two groupings of the names that cut across salts and forks, so blocks are shared
    between groups."""
    return "abcdefg".index(seq) % 3, "abcdefg".index(seq) % 2


class GroupedPool(BlockPool):
    """A pool whose sequences belong to the groups of their names."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, blocks_per_page=BLOCKS_PER_PAGE)
        self.track_holders(2)

    def allocate(self, seq: Hashable, num_tokens: int, token_ids: TokenIds | None = None,
                 salt: bytes = b"") -> SeqUpdate | NoFit:
        with self.holding(groups_of(str(seq))):
            return super().allocate(seq, num_tokens, token_ids, salt)

    def fork(self, parent: Hashable, child: Hashable) -> SeqUpdate:
        with self.holding(groups_of(str(child))):
            return super().fork(parent, child)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = GroupedPool(NUM_BLOCKS, BLOCK_SIZE)
        self.memory = np.full(NUM_BLOCKS * BLOCK_SIZE, -1, dtype=np.int64)
        self.tokens: dict[str, list[int]] = {}
        self.salts: dict[str, bytes] = {}  # namespaces never share a block
        self.fresh = itertools.count(10_000)  # ids of tokens the pool is not told about
        self.withdrawn: set[int] = set()  # pages the pool gave back

    def _snapshot(self) -> object:
        return self.pool.stats(), {s: self.pool.block_table(s) for s in self.tokens}

    def _copy(self, copies: list[BlockCopy]) -> None:
        for copy in copies:
            src, dst = copy.src * BLOCK_SIZE, copy.dst * BLOCK_SIZE
            self.memory[dst:dst + BLOCK_SIZE] = self.memory[src:src + BLOCK_SIZE]

    def _write(self, seq: str, slots: list[int], tokens: list[int]) -> None:
        """Write tokens, checking that no other live sequence can see the written slots."""
        for slot in slots:
            block = slot // BLOCK_SIZE
            others = [s for s in self.tokens if s != seq and block in self.pool.block_table(s)]
            assert not others, f"{seq} writes block {block} shared with {others}"
        self.memory[slots] = tokens

    def _new_tokens(self, n: int, known: bool, data: st.DataObject) -> tuple[list[int], bool]:
        if not known:
            return [next(self.fresh) for _ in range(n)], False
        return data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), True

    @rule(seq=NAMES, n=st.integers(0, 14), known=st.booleans(), head=st.sampled_from(HEADS),
          salt=st.sampled_from([b"", b"x"]), data=st.data())
    def allocate(self, seq: str, n: int, known: bool, head: list[int], salt: bytes,
                 data: st.DataObject) -> None:
        tail, _ = self._new_tokens(max(0, n - len(head)), known, data)
        tokens = (head + tail)[:n] if known else self._new_tokens(n, False, data)[0]
        before = self._snapshot()
        try:
            result = self.pool.allocate(seq, n, tokens if known else None, salt=salt)
        except SequenceExists:
            assert seq in self.tokens and self._snapshot() == before
            return
        if isinstance(result, NoFit):
            assert self._snapshot() == before
            return
        cached = result.num_cached_tokens
        assert self.memory[result.slot_mapping[:cached]].tolist() == tokens[:cached]
        self._write(seq, result.slot_mapping[cached:], tokens[cached:])
        self.tokens[seq] = tokens
        self.salts[seq] = salt

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 6), known=st.booleans())
    def append(self, data: st.DataObject, k: int, known: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, known = self._new_tokens(k, known, data)
        before = self._snapshot()
        result = self.pool.append(seq, k, tokens if known else None)
        if isinstance(result, NoFit):
            assert self._snapshot() == before
            return
        assert isinstance(result, SeqUpdate)
        self._copy(result.copies)
        self._write(seq, result.slot_mapping, tokens)
        self.tokens[seq] += tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 3), known=st.booleans(),
          reserve=st.sampled_from([0, 0, 1, 4, 6]))
    def append_batch(self, data: st.DataObject, k: int, known: bool, reserve: int) -> None:
        """Appends, some reserving slots ahead: a table then covers its tokens and `reserve`
        slots, and an append changes no entry it had (a copy-on-write copy aside)."""
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        batch = [self._new_tokens(k, known, data)[0] for _ in seqs]
        before = self._snapshot()
        had = [len(self.pool.block_table(seq)) for seq in seqs]
        result = self.pool.append_batch(seqs, k, batch if known else None, reserve)
        if isinstance(result, NoFit):
            assert self._snapshot() == before
            return
        assert isinstance(result, BatchAppend)
        copied = {copy.dst for copy in result.copies}
        for i, logical, block in zip(result.changed_seq_index.tolist(),
                                     result.changed_logical_block.tolist(),
                                     result.changed_block_id.tolist(), strict=True):
            assert logical >= had[i] or block in copied, "an append changed a reserved entry"
        for seq in seqs:
            covered = len(self.pool.block_table(seq)) * BLOCK_SIZE
            assert covered >= self.pool.num_tokens(seq) + reserve, f"{seq} reserved too little"
        self._copy(result.copies)
        slots = result.slot_mapping.reshape(len(seqs), k).tolist()
        for seq, seq_slots, tokens in zip(seqs, slots, batch, strict=True):
            self._write(seq, seq_slots, tokens)
            self.tokens[seq] += tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), child=NAMES)
    def fork(self, data: st.DataObject, child: str) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._snapshot()
        try:
            self.pool.fork(parent, child)
        except SequenceExists:
            assert child in self.tokens and self._snapshot() == before
            return
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), logical=st.integers(-1, 4))
    def copy_on_write(self, data: st.DataObject, logical: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._snapshot()
        try:
            result = self.pool.copy_on_write(seq, logical)
        except PoolError:
            assert not 0 <= logical < len(self.pool.block_table(seq))
            assert self._snapshot() == before
            return
        if isinstance(result, NoFit):
            assert self._snapshot() == before
            return
        self._copy(result.copies)
        table = self.pool.block_table(seq)
        others = [s for s in self.tokens if s != seq and table[logical] in self.pool.block_table(s)]
        assert not others, "a block made private is still shared"

    @rule(seq=NAMES, head=st.sampled_from(HEADS), salt=st.sampled_from([b"", b"x"]))
    def failed_prefill(self, seq: str, head: list[int], salt: bytes) -> None:
        """A request allocated, half-computed into garbage, then freed: never shareable."""
        if seq in self.tokens:
            return
        result = self.pool.allocate(seq, len(head), head, salt=salt)
        if isinstance(result, NoFit):
            return
        cached = result.num_cached_tokens
        self._write(seq, result.slot_mapping[cached:], [-7] * (len(head) - cached))
        self.pool.free(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Every modelled sequence is fully written, so committing any of them is truthful."""
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1,
                                  unique=True))
        self.pool.commit(seqs)

    @rule(pages=PAGES)
    def withdraw_pages(self, pages: list[int]) -> None:
        """Pages leave the pool, and another format overwrites their memory."""
        idle = set(self.pool.idle_pages())
        assert not idle & self.withdrawn, "a withdrawn page is idle"
        cached = self.pool.cached_keys()
        before = pool_state(self.pool)
        try:
            evicted = self.pool.withdraw_pages(pages)
        except PoolError:
            assert len(set(pages)) < len(pages) or not set(pages) <= idle
            assert pool_state(self.pool) == before
            return
        assert len(set(pages)) == len(pages) and set(pages) <= idle
        assert evicted == [block for page in pages for block in self._blocks_of(page)
                           if block in cached]
        assert not set(evicted) & set(self.pool.cached_keys())
        span = BLOCKS_PER_PAGE * BLOCK_SIZE
        for page in pages:
            self.memory[page * span:(page + 1) * span] = -2
        self.withdrawn |= set(pages)

    @precondition(lambda self: self.pool.cached_keys())
    @rule(data=st.data())
    def withdraw_a_cached_page(self, data: st.DataObject) -> None:
        """An idle page holding cached blocks, when there is one: they are evicted."""
        cached = self.pool.cached_keys()
        warm = [page for page in self.pool.idle_pages()
                if set(self._blocks_of(page)) & set(cached)]
        if warm:
            self.withdraw_pages([data.draw(st.sampled_from(warm))])

    def _blocks_of(self, page: int) -> range:
        return range(page * BLOCKS_PER_PAGE, (page + 1) * BLOCKS_PER_PAGE)

    @rule(pages=PAGES)
    def restore_pages(self, pages: list[int]) -> None:
        before = pool_state(self.pool)
        try:
            self.pool.restore_pages(pages)
        except PoolError:
            assert len(set(pages)) < len(pages) or not set(pages) <= self.withdrawn
            assert pool_state(self.pool) == before
            return
        assert len(set(pages)) == len(pages) and set(pages) <= self.withdrawn
        self.withdrawn -= set(pages)

    @rule(data=st.data(), ops=st.lists(st.sampled_from(
        ["allocate", "append", "fork", "cow", "commit", "free", "withdraw", "restore"]),
        min_size=1, max_size=4))
    def rolled_back_transaction(self, data: st.DataObject, ops: list[str]) -> None:
        before = pool_state(self.pool)
        with contextlib.suppress(_Abort, PoolError), self.pool.transaction():
            for op in ops:
                self._random_op(op, data)
            raise _Abort
        assert pool_state(self.pool) == before

    def _random_op(self, op: str, data: st.DataObject) -> None:
        live = sorted(self.tokens) or ["a"]
        seq = data.draw(st.sampled_from(live))
        match op:
            case "allocate":
                n = data.draw(st.integers(0, 10))
                self.pool.allocate(data.draw(NAMES), n, data.draw(st.sampled_from(HEADS))[:n]
                                   if n <= 4 else None)
            case "append":  # with ids, so that the partial-block ids must come back too
                k = data.draw(st.integers(1, 5))
                ids = data.draw(st.none() | st.lists(st.integers(0, 3), min_size=k, max_size=k))
                self.pool.append_batch([seq], k, ids, data.draw(st.sampled_from([0, 5])))
            case "fork":
                self.pool.fork(seq, data.draw(NAMES))
            case "cow":
                self.pool.copy_on_write(seq, data.draw(st.integers(0, 2)))
            case "commit":
                self.pool.commit([seq])
            case "withdraw":
                self.pool.withdraw_pages(self.pool.idle_pages()[:data.draw(st.integers(1, 3))])
            case "restore":
                self.pool.restore_pages(sorted(self.withdrawn)[:data.draw(st.integers(1, 3))])
            case _:
                self.pool.free(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A request done: its K/V certified written, then freed, its full blocks cached (what
        a withdraw must evict)."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.commit([seq])
        self.free(seq)

    @rule(seq=NAMES)
    def free(self, seq: str) -> None:
        try:
            self.pool.free(seq)
        except SequenceNotFound:
            assert seq not in self.tokens
            return
        del self.tokens[seq]
        del self.salts[seq]

    @invariant()
    def contents_isolation_and_invariants_hold(self) -> None:
        self.pool.check_invariants()
        for seq, tokens in self.tokens.items():
            table = self.pool.block_table(seq)
            slots = [table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE
                     for i in range(len(tokens))]
            assert self.memory[slots].tolist() == tokens, f"{seq} reads back wrong tokens"
            assert self.pool.num_tokens(seq) == len(tokens)
            for other, salt in self.salts.items():
                if salt != self.salts[seq]:
                    assert not set(table) & set(self.pool.block_table(other)), "salts share"
        stats = self.pool.stats()
        assert stats.num_blocks == NUM_BLOCKS - BLOCKS_PER_PAGE * len(self.withdrawn)
        assert self.pool.held_pages == NUM_BLOCKS // BLOCKS_PER_PAGE - len(self.withdrawn)
        assert stats.num_sequences == len(self.tokens)
        assert stats.logical_tokens == sum(map(len, self.tokens.values()))


class _Abort(Exception):
    """Ends a transaction that must be rolled back."""


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
