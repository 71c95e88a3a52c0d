"""Exact-block-id scenarios on tiny pools. Blocks come off the free list in id order (FIFO)."""

import contextlib

import numpy as np
import pytest

from pagedkv.daemon.core import (
    BlockCopy,
    BlockPool,
    InvalidArgument,
    NoFit,
    SequenceExists,
    SequenceNotFound,
    SeqUpdate,
    seq_table,
)
from pagedkv.daemon.core.cache_events import Committed, Evicted, Parked, Uncommitted

from pool_state import pool_state


def ok(result: object) -> SeqUpdate:
    assert isinstance(result, SeqUpdate), result
    return result


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_blocks=8, block_size=4)


def test_append_takes_a_new_block_exactly_at_the_boundary(pool: BlockPool) -> None:
    a = ok(pool.allocate("a", 3))
    assert a.block_table == [0] and a.slot_mapping == [0, 1, 2]
    a = ok(pool.append("a", 1))  # fills slot 3 of block 0: no new block
    assert a.block_table == [0] and a.slot_mapping == [3]
    a = ok(pool.append("a", 1))  # the 5th token opens block 1
    assert a.block_table == [0, 1] and a.slot_mapping == [4]
    a = ok(pool.append("a", 4))  # tokens 5..8 span the rest of block 1 and block 2
    assert a.block_table == [0, 1, 2] and a.slot_mapping == [5, 6, 7, 8]
    assert pool.stats().free_blocks == 5
    pool.check_invariants()


def test_fork_then_append_copies_only_the_shared_partial_last_block(pool: BlockPool) -> None:
    ok(pool.allocate("p", 6))                     # p: [0, 1], block 1 half full
    child = ok(pool.fork("p", "c"))
    assert child.block_table == [0, 1] and pool.stats().free_blocks == 6  # fork allocates nothing
    c = ok(pool.append("c", 1))
    assert c.copies == [BlockCopy(src=1, dst=2)]  # only the partial block is copied
    assert c.block_table == [0, 2] and c.slot_mapping == [2 * 4 + 2]
    assert pool.block_table("p") == [0, 1]        # the other sharer keeps the original
    p = ok(pool.append("p", 1))                   # block 1 is now private to p: no copy
    assert p.copies == [] and p.block_table == [0, 1] and p.slot_mapping == [6]
    pool.check_invariants()


def test_parent_side_append_after_fork_copies_for_the_parent(pool: BlockPool) -> None:
    ok(pool.allocate("p", 5))                     # p: [0, 1]
    ok(pool.fork("p", "c"))
    p = ok(pool.append("p", 1))
    assert p.copies == [BlockCopy(src=1, dst=2)] and p.block_table == [0, 2]
    assert pool.block_table("c") == [0, 1]
    pool.check_invariants()


def test_no_copy_when_the_shared_last_block_is_full(pool: BlockPool) -> None:
    ok(pool.allocate("p", 8))                     # p: [0, 1], both full
    ok(pool.fork("p", "c"))
    c = ok(pool.append("c", 1))
    assert c.copies == [] and c.block_table == [0, 1, 2]
    assert pool.block_table("p") == [0, 1]
    pool.check_invariants()


def test_freeing_a_forked_parent_leaves_the_child_intact(pool: BlockPool) -> None:
    ok(pool.allocate("p", 7))
    ok(pool.fork("p", "c"))
    free_before = pool.stats().free_blocks
    assert pool.free("p") == []                   # every block still referenced by c
    assert pool.block_table("c") == [0, 1] and pool.num_tokens("c") == 7
    assert pool.stats().free_blocks == free_before
    assert pool.free("c") == [1, 0]               # released deepest first
    pool.check_invariants()


def test_allocate_past_capacity_fails_then_gets_the_freed_block(pool: BlockPool) -> None:
    for i in range(4):
        ok(pool.allocate(i, 8))                   # 4 x 2 blocks = the whole pool
    result = pool.allocate("x", 1)
    assert result == NoFit(needed=1, available=0) and "x" not in pool
    assert pool.append(0) == NoFit(needed=1, available=0)  # seq 0's last block is full
    assert ok(pool.allocate("empty", 0)).block_table == []  # an empty sequence needs no block
    pool.free(2)                                  # blocks 5, 4 go back, deepest first
    x = ok(pool.allocate("x", 1))
    assert x.block_table == [5]
    pool.check_invariants()


def test_identical_prompts_share_every_full_block_and_get_private_tails(pool: BlockPool) -> None:
    prompt = list(range(10))
    a = ok(pool.allocate("a", 10, prompt))
    assert pool.commit(["a"]) == 2                # a's K/V is written: its full blocks shareable
    b = ok(pool.allocate("b", 10, prompt))
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    stats = pool.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert stats.logical_tokens == 20 and stats.filled_slots == 12
    pool.check_invariants()


@pytest.mark.parametrize("z", [0, 3, 4, 7, 9, 12])
def test_prompts_diverging_at_z_share_floor_z_over_b_blocks(z: int) -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    a = list(range(100, 113))
    b = a[:z] + [7] * (13 - z)
    ok(pool.allocate("a", 13, a))
    pool.commit(["a"])
    shared = set(pool.block_table("a")) & set(ok(pool.allocate("b", 13, b)).block_table)
    assert len(shared) == z // 4
    pool.check_invariants()


def test_freed_cached_blocks_are_revived_then_evicted_lru_with_keys_cleared() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    first, second = list(range(8)), list(range(50, 58))
    ok(pool.allocate("a", 8, first))              # a: [0, 1], both keyed (pending)
    pool.commit(["a"])                            # computed: both committed
    pool.free("a")
    stats = pool.stats()
    assert (stats.free_blocks, stats.cached_blocks, stats.used_blocks) == (4, 2, 0)
    b = ok(pool.allocate("b", 8, first))          # same content: revived, not recomputed
    assert b.block_table == [0, 1] and b.num_cached_tokens == 8
    pool.free("b")                                # parked again: 1 then 0 (deepest first)
    c = ok(pool.allocate("c", 12, [*second, 1, 2, 3, 4]))
    # Blocks 2, 3 were never cached, so they go first; then block 1 (deepest) is evicted.
    assert c.block_table == [2, 3, 1] and c.num_cached_tokens == 0
    d = ok(pool.allocate("d", 4, first[:4]))      # block 0 survived eviction
    assert d.block_table == [0] and d.num_cached_tokens == 4
    assert pool.free("c") == [1, 3, 2]            # c never committed: no key survives
    pool.free("d")
    e = ok(pool.allocate("e", 8, first))          # block 1 lost its key: only block 0 hits
    assert e.num_cached_tokens == 4 and e.block_table[0] == 0
    pool.check_invariants()


def test_different_salts_never_share(pool: BlockPool) -> None:
    prompt = list(range(8))
    a = ok(pool.allocate("a", 8, prompt, salt=b"tenant-a"))
    pool.commit(["a"])
    b = ok(pool.allocate("b", 8, prompt, salt=b"tenant-b"))
    pool.commit(["b"])
    c = ok(pool.allocate("c", 8, prompt, salt=b"tenant-a"))
    assert not set(a.block_table) & set(b.block_table) and b.num_cached_tokens == 0
    assert c.block_table == a.block_table and c.num_cached_tokens == 8
    pool.check_invariants()


def test_decode_appends_with_token_ids_key_blocks_as_they_fill(pool: BlockPool) -> None:
    ok(pool.allocate("a", 2, [1, 2]))
    for token in (3, 4, 5, 6):
        ok(pool.append("a", 1, [token]))
    assert pool.stats().pending_blocks == 1       # filled by the appends, not yet computed
    pool.commit(["a"])
    b = ok(pool.allocate("b", 6, [1, 2, 3, 4, 5, 6]))
    assert b.num_cached_tokens == 4 and b.block_table[0] == pool.block_table("a")[0]
    pool.check_invariants()


def test_append_without_token_ids_stops_keying_the_sequence(pool: BlockPool) -> None:
    ok(pool.allocate("a", 2, [1, 2]))
    ok(pool.append("a", 2))                       # ids unknown: block 0 cannot be keyed
    pool.commit(["a"])
    assert ok(pool.allocate("b", 4, [1, 2, 3, 4])).num_cached_tokens == 0
    pool.check_invariants()


def test_copy_on_write_copies_shared_and_unkeys_private_blocks(pool: BlockPool) -> None:
    ok(pool.allocate("a", 8, list(range(8))))
    pool.commit(["a"])
    ok(pool.fork("a", "b"))
    b = ok(pool.copy_on_write("b", 0))
    assert b.copies == [BlockCopy(src=0, dst=2)] and b.block_table == [2, 1]
    again = ok(pool.copy_on_write("b", 0))        # now private: nothing to copy
    assert again.copies == [] and again.block_table == [2, 1]
    ok(pool.copy_on_write("a", 0))                # private to a, but keyed: key dropped
    assert ok(pool.allocate("c", 8, list(range(8)))).num_cached_tokens == 0
    pool.check_invariants()


def test_batched_append_matches_per_sequence_appends() -> None:
    batched, single = BlockPool(32, 4), BlockPool(32, 4)
    for p in (batched, single):
        ok(p.allocate("a", 3, [1, 2, 3]))
        ok(p.allocate("b", 4, [1, 2, 3, 4]))
        ok(p.fork("a", "c"))
    result = batched.append_batch(["a", "b", "c"], 2, [[5, 6], [7, 8], [9, 10]])
    assert not isinstance(result, NoFit)
    slots = [ok(single.append(s, 2, t)).slot_mapping
             for s, t in (("a", [5, 6]), ("b", [7, 8]), ("c", [9, 10]))]
    assert result.slot_mapping.tolist() == [s for seq_slots in slots for s in seq_slots]
    for s in "abc":
        assert batched.block_table(s) == single.block_table(s)
    # a and c share partial block 0: a, first in the batch, gets the copy; c, the last sharer,
    # keeps the original.
    assert result.copies == [BlockCopy(src=0, dst=2)]
    changed = sorted(zip(result.changed_seq_index.tolist(), result.changed_logical_block.tolist(),
                         result.changed_block_id.tolist(), strict=True))
    assert changed == [(0, 0, 2), (0, 1, 3), (1, 1, 4), (2, 1, 5)]
    batched.check_invariants()


def test_batched_append_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    ok(pool.allocate("a", 4))
    ok(pool.allocate("b", 4))
    before = (pool.stats(), pool.block_table("a"), pool.block_table("b"))
    assert pool.append_batch(["a", "b"], 1) == NoFit(needed=2, available=1)
    assert (pool.stats(), pool.block_table("a"), pool.block_table("b")) == before
    with pytest.raises(InvalidArgument, match="twice"):
        pool.append_batch(["a", "a"], 1)
    with pytest.raises(SequenceNotFound):
        pool.append_batch(["a", "zz"], 1)
    with pytest.raises(InvalidArgument, match="token_ids"):
        pool.append_batch(["a", "b"], 1, [1, 2, 3])
    assert (pool.stats(), pool.block_table("a"), pool.block_table("b")) == before
    pool.check_invariants()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda p: p.allocate("a", 1), SequenceExists),
        (lambda p: p.allocate("n", -1), InvalidArgument),
        (lambda p: p.allocate("n", 3, [1, 2]), InvalidArgument),
        (lambda p: p.allocate("n", 2, ["x", "y"]), InvalidArgument),
        (lambda p: p.append("zz", 1), SequenceNotFound),
        (lambda p: p.append("a", 0), InvalidArgument),
        (lambda p: p.append("a", 2, [1]), InvalidArgument),
        (lambda p: p.fork("zz", "n"), SequenceNotFound),
        (lambda p: p.fork("a", "b"), SequenceExists),
        (lambda p: p.copy_on_write("a", 2), InvalidArgument),
        (lambda p: p.copy_on_write("a", -1), InvalidArgument),
        (lambda p: p.free("zz"), SequenceNotFound),
    ],
)
def test_caller_mistakes_raise_and_change_nothing(call: object, error: type[Exception]) -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    ok(pool.allocate("a", 6, list(range(6))))
    ok(pool.allocate("b", 3))
    before = (pool.stats(), pool.block_table("a"), pool.block_table("b"))
    with pytest.raises(error):
        call(pool)  # type: ignore[operator]
    assert (pool.stats(), pool.block_table("a"), pool.block_table("b")) == before
    pool.check_invariants()


def test_stats_count_utilization_and_sharing() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    ok(pool.allocate("a", 5))                     # 2 blocks, 5 filled slots
    ok(pool.fork("a", "b"))                       # shares both: 10 logical tokens
    stats = pool.stats()
    assert (stats.used_blocks, stats.allocated_slots, stats.filled_slots) == (2, 8, 5)
    assert stats.utilization == pytest.approx(5 / 8)
    assert stats.sharing_ratio == pytest.approx(2.0)
    assert stats.free_blocks == 14 and stats.num_sequences == 2


def test_tables_and_rows_grow_past_their_initial_capacity() -> None:
    pool = BlockPool(num_blocks=4096, block_size=2)
    for i in range(200):                          # more rows than the initial 64
        ok(pool.allocate(i, 1))
    long = ok(pool.append(0, 99))                 # 50 blocks: more columns than the initial 8
    assert len(long.block_table) == 50 and len(set(long.block_table)) == 50
    assert np.array_equal(long.slot_mapping[:1], [long.block_table[0] * 2 + 1])
    pool.check_invariants()


def test_the_core_imports_neither_torch_nor_grpc() -> None:
    import subprocess
    import sys

    code = ("import sys, pagedkv.daemon.core; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_transaction_costs_the_work_done_not_the_size_of_the_pool() -> None:
    """The undo journal records what a 2-op batch changed, never a copy of the pool state: the
    records and every array they keep are the same at 64 and at 65,536 blocks."""
    footprints = []
    for num_blocks in (64, 65_536):
        pool = BlockPool(num_blocks, block_size=4)
        for i in range(8):
            ok(pool.allocate(i, 6, list(range(i, i + 6))))
        with pool.transaction() as journal:
            pool.append_batch([0, 1], 3, list(range(6)))
            pool.free(2)
            records = list(journal._undo or [])
        sizes = [np.asarray(arg).size for _, args in records for arg in args
                 if isinstance(arg, np.ndarray | list)]
        footprints.append(([undo.__name__ for undo, _ in records], sizes))
        pool.check_invariants()
    assert footprints[0] == footprints[1]


def test_undo_records_per_call_do_not_grow_with_the_blocks_it_touches() -> None:
    """Each call records its undo coarsely (a few records per call, never one per block): the
    same calls over 1-block and 30-block prompts leave the same records."""
    def records(full_blocks: int) -> list[str]:
        pool = BlockPool(256, block_size=2)
        seqs = [0, 1, 2]
        with pool.transaction() as journal:
            for seq in seqs:
                n = 2 * full_blocks + 1
                ok(pool.allocate(seq, n, list(range(100 * seq, 100 * seq + n))))
            pool.commit(seqs)
            pool.append_batch(seqs, 1, [7, 8, 9])  # fills every last block
            pool.commit(seqs)
            for seq in seqs:
                pool.free(seq)
            return [undo.__name__ for undo, _ in journal._undo or []]
    assert records(1) == records(30)


def test_a_rolled_back_eviction_gives_the_block_back_its_token_ids() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    ok(pool.allocate("a", 2, [1, 2]))
    pool.commit(["a"])
    pool.free("a")                                 # block 0 cached; block 1 free
    before = pool_state(pool)
    with contextlib.suppress(RuntimeError), pool.transaction():
        ok(pool.allocate("b", 4, [5, 6, 7, 8]))    # takes block 1, evicts block 0, keys both
        raise RuntimeError
    assert pool_state(pool) == before
    pool.check_invariants()                        # block 0's key matches its ids [1, 2] again
    assert ok(pool.allocate("c", 2, [1, 2])).num_cached_tokens == 2


def test_rolled_back_appends_across_a_block_boundary_keep_the_partial_ids() -> None:
    """Each append writes ids only past the row's partial ones, but after an earlier append of
    the same transaction filled the block, the next one writes from offset 0."""
    pool = BlockPool(num_blocks=4, block_size=2)
    ok(pool.allocate("a", 1, [7]))
    before = pool_state(pool)
    with contextlib.suppress(RuntimeError), pool.transaction():
        pool.append_batch(["a"], 1, [8])           # fills block 0
        pool.append_batch(["a"], 1, [9])           # opens block 1: its offset 0 held the 7
        raise RuntimeError
    assert pool_state(pool) == before
    ok(pool.append("a", 1, [8]))                   # block 0 is keyed by its real ids 7, 8
    pool.commit(["a"])
    assert ok(pool.allocate("b", 2, [7, 8])).num_cached_tokens == 2


def test_pending_blocks_are_matched_only_once_committed(pool: BlockPool) -> None:
    prompt = list(range(10))
    a = ok(pool.allocate("a", 10, prompt))        # a: [0, 1, 2]; blocks 0, 1 full, pending
    assert pool.stats().pending_blocks == 2
    b = ok(pool.allocate("b", 10, prompt))        # nothing written yet: b computes its own copy
    assert (b.block_table, b.num_cached_tokens) == ([3, 4, 5], 0)
    assert pool.commit(["a"]) == 2                # a's K/V is written
    assert pool.commit(["a"]) == 0                # idempotent
    c = ok(pool.allocate("c", 10, prompt))
    assert (c.block_table, c.num_cached_tokens) == ([0, 1, 6], 8)
    assert pool.commit(["b"]) == 0                # same content, committed second: stays private
    assert pool.stats().pending_blocks == 0
    assert pool.free("b") == [5, 4, 3]            # b's duplicates hold no key: plain free blocks
    assert a.block_table == [0, 1, 2]
    pool.check_invariants()


def test_commit_of_a_token_prefix_counts_only_blocks_fully_inside(pool: BlockPool) -> None:
    ok(pool.allocate("a", 10, list(range(10))))   # chunked prefill: 5 tokens computed so far
    assert pool.commit(["a"], [5]) == 1           # block 0 (tokens 0-3) is complete
    assert pool.commit(["a"], [7]) == 0           # block 1 needs tokens 4-7
    assert pool.commit(["a"], [8]) == 1
    with pytest.raises(InvalidArgument, match="exceeds"):
        pool.commit(["a"], [11])
    ok(pool.allocate("b", 2))
    with pytest.raises(InvalidArgument, match="1 token counts given for 2"):
        pool.commit(["a", "b"], [4])
    with pytest.raises(SequenceNotFound):
        pool.commit(["zz"])
    assert ok(pool.allocate("c", 8, list(range(8)))).num_cached_tokens == 8
    pool.check_invariants()


def test_a_forked_child_keeps_pending_blocks_and_may_commit_them(pool: BlockPool) -> None:
    ok(pool.allocate("p", 9, list(range(9))))     # p: [0, 1, 2]; 0 and 1 pending
    ok(pool.fork("p", "c"))
    assert pool.free("p") == []                   # the child still references every block
    assert pool.stats().pending_blocks == 2
    assert pool.commit(["c"]) == 2                # the child's owner computed them
    assert ok(pool.allocate("x", 8, list(range(8)))).num_cached_tokens == 8
    pool.check_invariants()


class Heard:
    """Cache events, as the service hears them during a call (taken from the pool's queue)."""

    def __init__(self) -> None:
        # ("evicted", blocks) and ("parked", [block]) in the order they happened.
        self.events: list[tuple[str, list[int]]] = []
        # ("committed", blocks) and ("uncommitted", [block]): what KV events announce.
        self.keying: list[tuple[str, list[int]]] = []

    def take(self, pool: BlockPool) -> None:
        for event in pool.take_events():
            match event:
                case Evicted(blocks):
                    self.events.append(("evicted", blocks))
                case Parked(blocks, _keys):
                    self.events.extend(("parked", [block]) for block in blocks)
                case Committed(blocks):
                    self.keying.append(("committed", blocks))
                case Uncommitted(block):
                    self.keying.append(("uncommitted", [block]))


def test_cache_events_and_uncache_of_what_no_one_can_hit_any_more() -> None:
    pool, heard = BlockPool(num_blocks=4, block_size=2), Heard()
    with pool.recording_events():
        ok(pool.allocate("a", 4, [1, 2, 3, 4], salt=b"private"))
        pool.commit(["a"])
        pool.free("a")  # both blocks stay cached, the deeper one first
        ok(pool.allocate("b", 6))  # blocks 2, 3, then evicts block 1 (least recently parked)
        heard.take(pool)
    assert heard.events == [("parked", [1]), ("parked", [0]), ("evicted", [1])]
    keys = pool.cached_keys()
    assert list(keys) == [0]
    before = pool_state(pool)
    with pytest.raises(RuntimeError), pool.transaction():
        assert pool.uncache({**keys, 3: b"in use", 1: keys[0]}) == [0]
        raise RuntimeError("undone")
    assert pool_state(pool) == before
    assert pool.uncache({0: b"another key"}) == []  # re-keyed content is someone else's
    assert pool.uncache(keys) == [0]
    stats = pool.stats()
    assert (stats.cached_blocks, stats.free_blocks) == (0, 1)
    assert ok(pool.allocate("c", 2, [1, 2], salt=b"private")).num_cached_tokens == 0
    pool.check_invariants()


def test_cache_events_hear_the_blocks_a_commit_made_matchable_and_a_rewrite_unkeyed() -> None:
    """What KV events announce: exactly the blocks a commit made matchable, in chain order
    (a block another committed first is not among them), and a committed block in use whose
    owner rewrites it in place."""
    pool, heard = BlockPool(num_blocks=8, block_size=2), Heard()
    with pool.recording_events():
        ok(pool.allocate("a", 5, [1, 2, 3, 4, 5]))  # blocks 0, 1 keyed pending, 2 partial
        ok(pool.allocate("b", 4, [1, 2, 3, 4]))  # the same content, pending too: 3, 4
        assert pool.commit(["b"]) == 2
        assert pool.commit(["a"]) == 0  # b committed it first: a's blocks lose their keys
        assert pool.commit(["b"]) == 0  # nothing new
        ok(pool.copy_on_write("b", 1))  # b alone holds block 4: rewritten in place
        ok(pool.copy_on_write("a", 0))  # pending no more, never committed: not announced
        heard.take(pool)
    assert heard.keying == [("committed", [3, 4]), ("uncommitted", [4])]
    _, parents, tokens = pool.block_content([3])
    assert parents == [pool.root_key(b"")] and tokens.tolist() == [[1, 2]]
    pool.check_invariants()


def test_a_remembered_batch_is_looked_up_again_once_its_rows_may_have_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool remembers the rows of the last list of sequences (a Step with commit asks
    twice); a sequence leaving (freed, or its allocation rolled back), the list changed in
    place, or rows renumbered once a transaction that freed sequences succeeds must each make
    it look the list up again."""
    monkeypatch.setattr(seq_table, "INITIAL_ROWS", 2)
    pool = BlockPool(num_blocks=64, block_size=4)
    for seq in range(12):
        ok(pool.allocate(seq, 1))
    batch = [10, 11]
    assert pool.commit(batch) == 0
    assert not isinstance(pool.append_batch(batch), NoFit)  # the same rows, remembered
    batch[1] = 9  # the same list object, changed in place
    assert not isinstance(pool.append_batch(batch), NoFit)
    assert [pool.num_tokens(seq) for seq in (9, 10, 11)] == [2, 3, 2]
    assert not isinstance(pool.append_batch([10, 11]), NoFit)  # remembered
    pool.free(11)
    with pytest.raises(SequenceNotFound):
        pool.append_batch([10, 11])  # 11 is gone: not served from memory
    with contextlib.suppress(RuntimeError), pool.transaction():
        ok(pool.allocate(20, 1))
        assert not isinstance(pool.append_batch([20, 10]), NoFit)  # remembered
        raise RuntimeError("rolled back")
    with pytest.raises(SequenceNotFound):
        pool.append_batch([20, 10])  # 20 was never made
    rows = len(pool._seqs.num_tokens)
    with pool.transaction():
        for seq in range(9):
            pool.free(seq)
        assert not isinstance(pool.append_batch(batch), NoFit)  # remembered before packing
    assert len(pool._seqs.num_tokens) < rows  # the rows were packed and renumbered
    assert not isinstance(pool.append_batch(batch), NoFit)
    assert (pool.num_tokens(10), pool.num_tokens(9)) == (6, 4)
    pool.check_invariants()
