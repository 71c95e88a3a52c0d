"""The compiled per-row loops (`_rows_*.c`) on their own: what each computes, and that an
inconsistent input raises before anything is written. The pool's own tests (Hypothesis state
machines, rolled-back transactions) run every function through `BlockPool`."""

from array import array
from collections import deque

import numpy as np
import pytest

from pagedkv.daemon.core import BatchAppend, BlockPool, _rows

BS = 4


def ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class Tables:
    """Three rows of `SeqTable` arrays over a 12-entry store: row 0 holds 5 tokens in blocks
    [7, 8] (region of 4 at 0), row 1 holds 4 tokens in [9] (region of 4 at 4), row 2 is
    empty (no region)."""

    def __init__(self) -> None:
        self.num_tokens = ints(5, 4, 0)
        self.num_blocks = ints(2, 1, 0)
        self.start = ints(0, 4, 0)
        self.capacity = ints(4, 4, 0)
        self.data = ints(7, 8, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0)
        self.partial = np.zeros((3, BS), dtype=np.int64)
        self.chain_ok = np.ones(3, dtype=np.bool_)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.num_tokens, self.num_blocks, self.start, self.capacity, self.data

    def snapshot(self) -> list[np.ndarray]:
        return [a.copy() for a in (*self.arrays(), self.partial, self.chain_ok)]

    def unchanged(self, before: list[np.ndarray]) -> bool:
        now = (*self.arrays(), self.partial, self.chain_ok)
        return all((a == b).all() for a, b in zip(now, before, strict=True))


def plan(t: Tables, rows: np.ndarray, ref: np.ndarray | None = None
         ) -> tuple[tuple[int, int, int] | None, np.ndarray, np.ndarray, np.ndarray]:
    written, grow, logical = (np.empty(len(rows), dtype=np.int64) for _ in range(3))
    planned = _rows.plan_step(rows, *t.arrays(), ref, BS, written, grow, logical)
    return planned, written, grow, logical


def test_a_decode_step_writes_where_each_row_lands() -> None:
    t = Tables()
    rows = ints(0, 1, 2)
    planned, written, grow, logical = plan(t, rows)
    # Row 0 writes into block 8 (slot 1); rows 1 and 2 are at a block's edge: new blocks.
    assert planned == (2, 1, 1)  # two grow; row 2 has no region (short); row 2 was empty
    assert written.tolist() == [8, -1, -1] and grow[:2].tolist() == [1, 2]
    assert logical[:2].tolist() == [1, 0]
    t.start[2], t.capacity[2] = 8, 4  # what the caller's move does for the short row
    slots, new, sealed = (np.empty(3, dtype=np.int64) for _ in range(3))
    count = _rows.apply_step(rows, written, grow[:2], ints(3, 5), ints(10, 11, 12), *t.arrays(),
                             t.partial, t.chain_ok, BS, True, slots, new, sealed)
    assert slots.tolist() == [8 * BS + 1, 3 * BS, 5 * BS] and new.tolist() == [6, 5, 1]
    assert t.data[[5, 8]].tolist() == [3, 5] and t.num_blocks.tolist() == [2, 2, 1]
    assert count == 0 and t.partial[:, 0].tolist() == [0, 11, 12] and t.partial[0, 1] == 10


def test_a_write_into_a_shared_partial_block_is_left_to_the_general_append() -> None:
    t = Tables()
    ref = np.ones(16, dtype=np.int64)
    ref[8] = 2  # row 0's partial last block is shared
    assert plan(t, ints(0, 1), ref)[0] is None
    assert plan(t, ints(1), ref)[0] == (1, 0, 0)  # row 1's full block: no copy


def test_the_step_refuses_bad_indices_and_changes_nothing() -> None:
    t = Tables()
    before = t.snapshot()
    with pytest.raises(IndexError, match="row 3 out of range"):
        plan(t, ints(0, 3))
    written = ints(8, -1, -1)
    out = [np.empty(3, dtype=np.int64) for _ in range(3)]
    with pytest.raises(IndexError, match="no room"):  # row 2 has no region: not moved first
        _rows.apply_step(ints(0, 1, 2), written, ints(1, 2), ints(3, 5), None, *t.arrays(),
                         t.partial, t.chain_ok, BS, True, *out)
    with pytest.raises(IndexError, match="blocks taken"):
        _rows.apply_step(ints(0, 1, 2), written, ints(1, 2), ints(3), None, *t.arrays(),
                         t.partial, t.chain_ok, BS, True, *out)
    assert t.unchanged(before)


def test_arrays_are_checked_for_dtype_and_layout() -> None:
    t = Tables()
    with pytest.raises(TypeError, match="rows must be a int64 array"):
        plan(t, np.array([0], dtype=np.int32))
    with pytest.raises(TypeError, match="rows must be a C-contiguous"):
        plan(t, ints(0, 1, 2)[::2])
    t.num_blocks.flags.writeable = False
    out = [np.empty(1, dtype=np.int64) for _ in range(3)]
    with pytest.raises(TypeError, match="num_blocks must be a C-contiguous writable"):
        _rows.apply_step(ints(0), ints(8), ints(), ints(), None, *t.arrays(), t.partial,
                         t.chain_ok, BS, True, *out)


def test_commit_runs_lists_the_new_full_blocks_and_refuses_a_count_past_the_tokens() -> None:
    t = Tables()
    committed = ints(0, 0, 0)
    with pytest.raises(IndexError, match="6 tokens to commit of 4"):
        _rows.commit_runs(ints(0, 1), ints(4, 6), *t.arrays(), committed, BS)
    assert committed.tolist() == [0, 0, 0]
    assert _rows.commit_runs(ints(0, 1, 2), None, *t.arrays(), committed, BS) == (
        [0, 1], [0, 0], [7, 9])
    assert committed.tolist() == [1, 1, 0]
    assert _rows.commit_runs(ints(0, 1), None, *t.arrays(), committed, BS) == ([], [], [])


def keys_of(n: int) -> tuple[list[bytes | None], list[bytes | None], bytearray]:
    return [None] * n, [None] * n, bytearray(n)


def test_keys_are_set_claimed_and_released() -> None:
    key_of, parent_of, committed = keys_of(4)
    tokens_of = np.zeros((4, BS), dtype=np.int64)
    ids = np.arange(2 * BS, dtype=np.int64).reshape(2, BS)
    _rows.set_keys(ints(1, 2), [b"k", b"k"], [b"p", b"q"], ids, key_of, parent_of, committed,
                   tokens_of)
    assert key_of == [None, b"k", b"k", None] and (tokens_of[1:3] == ids).all()
    with pytest.raises(IndexError, match="block 2 already has a key"):
        _rows.set_keys(ints(3, 2), [b"x", b"y"], [b"p", b"p"], ids, key_of, parent_of,
                       committed, tokens_of)
    assert key_of[3] is None  # checked before any is keyed
    block_of: dict[bytes, int] = {}
    # Block 1 claims k first; block 2, the same content, loses its key.
    assert _rows.claim_keys([1, 2], key_of, parent_of, committed, block_of) == (
        [1], [(2, b"k", b"q")])
    assert block_of == {b"k": 1} and key_of[2] is None and committed == bytearray([0, 1, 0, 0])
    key_of[3], parent_of[3] = b"m", b"p"  # a pending key
    assert _rows.release_keys([3, 1, 0], key_of, parent_of, committed) == (
        [1], [3, 0], [(3, b"m", b"p")])
    with pytest.raises(IndexError, match="block 4 out of range"):
        _rows.release_keys([0, 4], key_of, parent_of, committed)


def test_chain_and_seal_hash_parent_then_ids() -> None:
    digest = lambda data: data[-9:]  # noqa: E731 -- a readable stand-in: the last 9 bytes
    ids = np.arange(2 * BS, dtype=np.int64).reshape(2, BS)
    keys = _rows.chain_keys(b"root", ids, BS, digest)
    assert keys == [(b"root" + ids[0].tobytes())[-9:], (keys[0] + ids[1].tobytes())[-9:]]
    key_of, parent_of, committed = keys_of(4)
    tokens_of = np.zeros((4, BS), dtype=np.int64)
    chain_key = [b"a", b"b"]
    _rows.seal_blocks(ints(1), ints(3), ids, chain_key, digest, key_of, parent_of, committed,
                      tokens_of)
    assert key_of[3] == chain_key[1] == (b"b" + ids[1].tobytes())[-9:] and parent_of[3] == b"b"
    assert (tokens_of[3] == ids[1]).all()
    with pytest.raises(IndexError, match="block 3 out of range or already keyed"):
        _rows.seal_blocks(ints(0), ints(3), ids, chain_key, digest, key_of, parent_of,
                          committed, tokens_of)
    assert chain_key[0] == b"a"


def test_blocks_are_taken_released_and_linked() -> None:
    ref = ints(0, 0, 1, 0)
    free = deque([0, 2, 3])  # block 2 is referenced: an inconsistent free list
    out = np.empty(3, dtype=np.int64)
    with pytest.raises(IndexError, match="free block 2"):
        _rows.pop_free(free, out, ref)
    assert list(free) == [0, 2, 3] and ref.tolist() == [0, 0, 1, 0]  # put back, untouched
    free = deque([3, 0])
    assert _rows.pop_free(free, out, ref) == 2 and out[:2].tolist() == [3, 0] and not free
    assert ref.tolist() == [1, 0, 1, 1]
    assert _rows.release_refs(ints(3, 2), ref) == [2, 3]  # deepest first
    with pytest.raises(IndexError, match="unreferenced"):
        _rows.release_refs(ints(0, 1), ref)
    assert ref.tolist() == [1, 0, 0, 0]
    prev, nxt = array("q", [-1, -1, -1, 3]), array("q", [-1, -1, -1, 3])  # blocks 0..2: empty
    _rows.link_tail(prev, nxt, [2, 0])
    assert nxt.tolist() == [3, -1, 0, 2] and prev.tolist() == [2, -1, 3, 0]
    with pytest.raises(IndexError, match="block 0 is already in the LRU"):
        _rows.link_tail(prev, nxt, [1, 0])
    with pytest.raises(IndexError, match="block 1 is already in the LRU"):
        _rows.link_tail(prev, nxt, [1, 1])  # twice in one call
    assert prev[1] == -1 and nxt.tolist() == [3, -1, 0, 2]


def test_rows_are_looked_up_and_slots_listed() -> None:
    out = np.empty(3, dtype=np.int64)
    row_of = {"a": 2, "b": 0}
    assert _rows.lookup_rows(row_of, ["b", "a"], out) == 2 and out[:2].tolist() == [0, 2]
    assert _rows.lookup_rows(row_of, ["a", "x", "b"], out) == 1  # missing
    assert _rows.lookup_rows(row_of, ["a", "b", "a"], out) == 2  # repeated
    table = ints(5, 2)
    assert _rows.table_slots(table, 6, BS) == [20, 21, 22, 23, 8, 9]
    with pytest.raises(IndexError):
        _rows.table_slots(table, 9, BS)


def test_a_block_size_that_is_no_power_of_two_divides() -> None:
    """Block and offset are a shift and a mask for powers of two; other sizes divide."""
    pool = BlockPool(num_blocks=8, block_size=3)
    pool.allocate("a", 5, [1, 2, 3, 4, 5])
    assert pool.append_batch(["a"], 1, [6]).slot_mapping.tolist() == [1 * 3 + 2]  # fills block 1
    step = pool.append_batch(["a"], 1, [7])  # opens block 2
    assert isinstance(step, BatchAppend) and step.slot_mapping.tolist() == [2 * 3]
    assert step.changed_logical_block.tolist() == [2] and step.changed_block_id.tolist() == [2]
    assert pool.commit(["a"]) == 2 and pool.committed_tokens("a") == 6
    pool.check_invariants()
