"""The contiguous baseline: max-length reservations, first fit, holes merged on free.

Pool: 14 blocks of 4 slots, max_model_len 16, so every sequence reserves 4 blocks. Three
reservations fit, at blocks 0, 4 and 8; the last 2 blocks are a run too short for any (external
fragmentation). The invariants are checked after every step.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.daemon.core import (
    BlockCopy,
    InvalidArgument,
    NoFit,
    SequenceExists,
    SequenceNotFound,
    SeqUpdate,
)
from pagedkv.demo.contiguous import ContiguousPool


def ok(result: object) -> SeqUpdate:
    assert isinstance(result, SeqUpdate), result
    return result


def state(pool: ContiguousPool) -> object:
    """Everything a rolled-back change must leave as it was."""
    rows = {seq: (pool.block_table(seq), pool.num_tokens(seq), pool.held_blocks(seq))
            for seq, _ in sorted(pool._row_of.items())}
    return pool.stats(), list(pool._runs.runs), list(pool._free_rows), rows


@pytest.fixture
def pool() -> ContiguousPool:
    return ContiguousPool(num_blocks=14, block_size=4, max_model_len=16)


def test_each_sequence_reserves_max_model_len_first_fit(pool: ContiguousPool) -> None:
    a = ok(pool.allocate("a", 5))
    assert (a.block_table, a.slot_mapping, a.num_cached_tokens) == ([0, 1], [0, 1, 2, 3, 4], 0)
    pool.check_invariants()
    b = ok(pool.allocate("b", 1, token_ids=[7]))                  # ids are checked, not kept
    assert (b.block_table, b.slot_mapping) == ([4], [16])
    assert pool.held_blocks("b") == [4, 5, 6, 7]
    stats = pool.stats()
    # Two reservations used; the free run 8..13 holds one more (4 blocks), its last 2 strand.
    assert (stats.used_blocks, stats.free_blocks, stats.allocated_slots) == (8, 4, 32)
    assert (stats.filled_slots, stats.num_sequences, stats.cached_blocks) == (6, 2, 0)
    assert stats.utilization == pytest.approx(6 / 32)            # over-reservation shows here
    pool.check_invariants()


def test_a_run_too_short_for_a_reservation_refuses(pool: ContiguousPool) -> None:
    for seq in "abc":
        ok(pool.allocate(seq, 1))
    pool.check_invariants()
    before = state(pool)
    # Blocks 12 and 13 are free, but a reservation needs 4 in one run.
    assert pool.allocate("d", 1) == NoFit(needed=4, available=2)
    assert pool.fork("a", "d") == NoFit(needed=4, available=2)
    assert state(pool) == before
    assert pool.num_free_blocks == 0
    assert pool.external_fragmentation() == pytest.approx(2 / 14)
    pool.check_invariants()


def test_free_merges_runs_and_first_fit_takes_the_lowest(pool: ContiguousPool) -> None:
    for seq in "abc":
        ok(pool.allocate(seq, 1))
    assert pool.free("b") == [4, 5, 6, 7]
    assert pool._runs.runs == [(4, 8), (12, 14)]
    pool.check_invariants()
    pool.free("a")
    assert (pool._runs.runs, pool.num_free_blocks) == ([(0, 8), (12, 14)], 8)
    pool.check_invariants()
    assert ok(pool.allocate("d", 2)).block_table == [0]            # first fit: the lowest
    pool.free("c")                                                 # merged both sides
    assert (pool._runs.runs, pool.num_free_blocks) == ([(4, 14)], 8)
    pool.check_invariants()
    assert [ok(pool.allocate(s, 1)).block_table for s in "ef"] == [[4], [8]]
    assert isinstance(pool.allocate("g", 1), NoFit)
    pool.check_invariants()


def test_appends_fill_the_reservation_and_stop_at_max_model_len(pool: ContiguousPool) -> None:
    ok(pool.allocate("a", 3))
    ok(pool.allocate("b", 4))
    # a: slots 3, 4 (block 1 enters its table); b: slots 20, 21 (block 5).
    step = pool.append_batch(["a", "b"], 2)
    assert not isinstance(step, NoFit)
    assert step.slot_mapping.tolist() == [3, 4, 20, 21]
    assert list(zip(step.changed_seq_index.tolist(), step.changed_logical_block.tolist(),
                    step.changed_block_id.tolist(), strict=True)) == [(0, 1, 1), (1, 1, 5)]
    assert (step.num_tokens.tolist(), step.copies, step.charged_blocks) == ([5, 6], [], 0)
    pool.check_invariants()
    assert ok(pool.append("a", 11)).block_table == [0, 1, 2, 3]    # 16 tokens: full
    before = state(pool)
    with pytest.raises(InvalidArgument, match="max_model_len=16"):
        pool.append("a", 1)
    with pytest.raises(InvalidArgument, match="max_model_len=16"):
        pool.append_batch(["b", "a"], 1)                           # all or nothing
    with pytest.raises(InvalidArgument, match="max_model_len=16"):
        pool.allocate("c", 17)
    assert state(pool) == before
    pool.check_invariants()


def test_fork_reserves_and_copies_the_filled_blocks(pool: ContiguousPool) -> None:
    ok(pool.allocate("a", 6))
    child = ok(pool.fork("a", "c"))
    assert (child.block_table, child.num_tokens) == ([4, 5], 6)
    assert child.copies == [BlockCopy(0, 4), BlockCopy(1, 5)]      # the partial block too
    assert pool.fork_copies(6) == 2
    assert ok(pool.append("c", 1)).slot_mapping == [22]            # in the child's own blocks
    assert pool.num_tokens("a") == 6
    pool.check_invariants()


def test_nothing_is_cached_or_shared(pool: ContiguousPool) -> None:
    ok(pool.allocate("a", 8, token_ids=list(range(8))))
    assert ok(pool.allocate("b", 8, token_ids=list(range(8)))).num_cached_tokens == 0
    assert pool.commit(["a", "b"]) == 0 and pool.commit(["a"], [4]) == 0
    assert pool.committed_tokens("a") == 0
    cow = ok(pool.copy_on_write("a", 1))
    assert (cow.block_table, cow.copies) == ([0, 1], [])
    assert (pool.quota_blocks(1), pool.quota_blocks(16)) == (4, 4)
    assert pool.stats().pending_blocks == 0
    pool.check_invariants()


def test_caller_mistakes_change_nothing(pool: ContiguousPool) -> None:
    ok(pool.allocate("a", 5))
    before = state(pool)
    for mistake, error in [
        (lambda: pool.allocate("a", 1), SequenceExists),
        (lambda: pool.allocate("b", 2, token_ids=[1]), InvalidArgument),
        (lambda: pool.fork("a", "a"), SequenceExists),
        (lambda: pool.fork("zz", "b"), SequenceNotFound),
        (lambda: pool.append_batch(["a", "a"]), InvalidArgument),
        (lambda: pool.commit(["a"], [6]), InvalidArgument),
        (lambda: pool.copy_on_write("a", 2), InvalidArgument),
        (lambda: pool.free("zz"), SequenceNotFound),
    ]:
        with pytest.raises(error):
            mistake()
        assert state(pool) == before
    with pytest.raises(InvalidArgument, match="does not fit"):
        ContiguousPool(num_blocks=3, block_size=4, max_model_len=16)


def test_a_failed_transaction_leaves_the_pool_exactly_as_it_was(pool: ContiguousPool) -> None:
    ok(pool.allocate("a", 5))
    ok(pool.allocate("b", 2))
    before = state(pool)
    with pytest.raises(RuntimeError), pool.transaction():
        pool.free("a")
        pool.free("b")
        # Rows are reused last freed first, blocks first fit: x gets b's row at a's blocks,
        # y a's row at b's blocks.
        assert ok(pool.allocate("x", 9)).block_table == [0, 1, 2]
        assert ok(pool.fork("x", "y")).block_table == [4, 5, 6]
        pool.append_batch(["x", "y"], 3)
        raise RuntimeError("a later op of the batch failed")
    assert state(pool) == before
    pool.check_invariants()
    assert ok(pool.append("a", 1)).slot_mapping == [5]


OPS = st.lists(st.tuples(st.sampled_from(["allocate", "append", "fork", "free", "fail"]),
                         st.integers(0, 5), st.integers(0, 5), st.integers(0, 9)),
               max_size=40)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_random_calls_keep_the_invariants_and_roll_back_exactly(
        ops: list[tuple[str, int, int, int]]) -> None:
    pool = ContiguousPool(num_blocks=14, block_size=4, max_model_len=16)
    for kind, seq, other, tokens in ops:
        before = state(pool)
        try:
            with pool.transaction():
                if kind == "allocate":
                    pool.allocate(seq, tokens)
                elif kind == "append":
                    pool.append(seq, tokens + 1)
                elif kind == "fork":
                    pool.fork(seq, other)
                elif kind == "free":
                    pool.free(seq)
                else:
                    for live in list(pool._row_of)[:2]:
                        pool.free(live)
                    pool.allocate(99, tokens)
                    raise RuntimeError("undo")
        except (InvalidArgument, SequenceExists, SequenceNotFound, RuntimeError):
            assert state(pool) == before
        pool.check_invariants()
