"""Random operations in lockstep on the block-pool core and on the benchmarks' reference block
manager (`benchmarks/reference_block_manager.py`), an independent per-sequence design in plain
Python, with the whole observable state compared after every operation.

Where the two apply alike (admissions with token ids, batched appends of one or several tokens,
frees, in one namespace) they must agree exactly: the cached tokens of each admission, every
block table, the slot of every appended token, refcounts, the free list and the LRU of cached
blocks in order, and which blocks hold cached content. The reference keys a block as soon as it
fills; the pool keys it pending until `commit`, so the pool commits after every change.

The pool also runs its calls inside transactions: some commit (the results must not change),
some roll back (the pool must come back exactly to its state, which the reference, never told
of them, still holds). The hypothesis state machine (`test_block_pool_stateful.py`) covers what
the reference leaves out: fork, copy-on-write, salts, pending keys and appends without ids.
"""

import contextlib
import itertools
import os

import numpy as np
import pytest

from pagedkv.daemon.core import BatchAppend, BlockPool, NoFit, SeqUpdate

from pool_state import pool_state
from reference_block_manager import ReferenceBlockManager

# More seeds locally:
# PAGEDKV_DIFF_SEEDS=500 pytest tests/daemon/core/test_block_pool_differential.py
SEEDS = int(os.environ.get("PAGEDKV_DIFF_SEEDS", "40"))
STEPS = 150


class _Abort(Exception):
    """Ends a transaction that must be rolled back."""


def same_state(pool: BlockPool, ref: ReferenceBlockManager) -> None:
    blocks = pool._blocks
    cache = blocks.cache
    assert {seq: pool.block_table(seq) for seq in ref.seqs} == \
        {seq: ref.block_table(seq) for seq in ref.seqs}
    assert len(pool) == len(ref.seqs)
    assert all(pool.num_tokens(seq) == s.num_tokens for seq, s in ref.seqs.items())
    assert blocks.ref.tolist() == ref.ref
    assert list(blocks.free) == list(ref.free_ids)
    assert list(cache.evictable) == list(ref.evictable)
    assert sorted(cache.block_of.values()) == \
        [block for block, key in enumerate(ref.key_of) if key is not None]
    assert pool.num_free_blocks == ref.num_free_blocks


class Lockstep:
    """One seeded run: a random mix of admissions, decode steps and frees."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = np.random.default_rng(seed)
        self.bs = bs = int(rng.choice([1, 2, 4, 16]))
        num_blocks = int(rng.integers(6, 60))
        self.pool = BlockPool(num_blocks, bs)
        self.ref = ReferenceBlockManager(num_blocks, bs)
        vocab = int(rng.choice([2, 5, 1000]))  # a tiny vocabulary repeats content often
        self.vocab = vocab
        # A few prompt heads, so admissions share prefixes and find them cached.
        self.heads = [rng.integers(0, vocab, int(rng.integers(0, 4 * bs + 2))) for _ in range(4)]
        self.names = itertools.count()

    def admit(self, in_txn: bool) -> None:
        rng, seq = self.rng, next(self.names)
        head = self.heads[int(rng.integers(len(self.heads)))]
        tail = rng.integers(0, self.vocab, int(rng.integers(0, 2 * self.bs + 2)))
        prompt = np.concatenate([head, tail]).astype(np.int64)
        result = self.run(in_txn, lambda: self.pool.allocate(seq, len(prompt), prompt))
        cached = self.ref.allocate(seq, prompt)
        if cached is None:
            assert isinstance(result, NoFit)
            return
        assert isinstance(result, SeqUpdate) and result.num_cached_tokens == cached
        table = result.block_table
        assert table == self.ref.block_table(seq)
        assert result.slot_mapping == [table[i // self.bs] * self.bs + i % self.bs
                                       for i in range(len(prompt))]
        self.run(in_txn, lambda: self.pool.commit([seq]))

    def step(self, in_txn: bool) -> None:
        rng, live, seqs = self.rng, list(self.ref.seqs), self.ref.seqs
        batch = [live[int(i)] for i in rng.choice(len(live), int(rng.integers(1, len(live) + 1)),
                                                    replace=False)]
        k = 1 if rng.random() < 0.7 else int(rng.integers(2, 2 * self.bs + 2))
        tokens = rng.integers(0, self.vocab, (len(batch), k))
        fresh = sum(-(-(seqs[s].num_tokens + k) // self.bs) - len(seqs[s].table) for s in batch)
        if fresh > len(self.ref.free_ids):
            # The pool takes a call's new blocks before it keys any; the reference takes and
            # keys token by token. When a step evicts, a block it fills may find its content
            # still cached in one and already evicted in the other, so such a step goes to
            # the pool one token at a time too.
            for seq, row in zip(batch, tokens.tolist(), strict=True):
                for token in row:
                    self.append(in_txn, [seq], 1, np.array([[token]]))
        else:
            self.append(in_txn, batch, k, tokens)

    def append(self, in_txn: bool, batch: list[int], k: int, tokens: np.ndarray) -> None:
        result = self.run(in_txn, lambda: self.pool.append_batch(batch, k, tokens))
        if isinstance(result, NoFit):  # all or nothing; the reference would go part way
            seqs = self.ref.seqs
            fresh = sum(-(-(seqs[s].num_tokens + k) // self.bs) - len(seqs[s].table)
                        for s in batch)
            assert (result.needed, result.available) == (fresh, self.ref.num_free_blocks)
            return
        assert isinstance(result, BatchAppend) and not result.copies
        slots = [self.ref.append(seq, token) for seq, row in zip(batch, tokens.tolist(),
                                                                 strict=True) for token in row]
        assert result.slot_mapping.tolist() == slots
        self.run(in_txn, lambda: self.pool.commit(batch))

    def free(self, in_txn: bool) -> None:
        live = list(self.ref.seqs)
        seq = live[int(self.rng.integers(len(live)))]
        self.run(in_txn, lambda: self.pool.free(seq))
        self.ref.free(seq)

    def run(self, in_txn: bool, call):  # type: ignore[no-untyped-def]
        if not in_txn:
            return call()
        with self.pool.transaction():
            return call()

    def rolled_back(self) -> None:
        """A few random calls in one transaction that fails: nothing may change."""
        before = pool_state(self.pool)
        pool, rng, live = self.pool, self.rng, list(self.ref.seqs)
        with contextlib.suppress(_Abort), pool.transaction():
            for _ in range(int(rng.integers(1, 6))):
                op = rng.random()
                if op < 0.3 or not live:
                    n = int(rng.integers(0, 3 * self.bs + 2))
                    pool.allocate(next(self.names), n, rng.integers(0, self.vocab, n))
                elif op < 0.7:
                    k = int(rng.integers(1, self.bs + 2))
                    pool.append_batch(live, k, rng.integers(0, self.vocab, (len(live), k)))
                elif op < 0.85:
                    pool.commit(live)
                else:
                    pool.free(live.pop(int(rng.integers(len(live)))))
            raise _Abort
        assert pool_state(pool) == before

    def play(self, steps: int) -> None:
        for i in range(steps):
            op, in_txn = self.rng.random(), self.rng.random() < 0.5
            if op < 0.1:
                self.rolled_back()
            elif op < 0.35 or not self.ref.seqs:
                self.admit(in_txn)
            elif op < 0.85:
                self.step(in_txn)
            else:
                self.free(in_txn)
            same_state(self.pool, self.ref)
            if i % 10 == 0:
                self.pool.check_invariants()
        self.pool.check_invariants()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_pool_matches_the_reference_step_by_step(seed: int) -> None:
    Lockstep(seed).play(STEPS)
