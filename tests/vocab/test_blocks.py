"""Block arithmetic shared by the pool, the client and the runner (vocab/blocks.py)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.vocab.blocks import blocks_for, ceil_div, patch_table, slot_of, slots_of


def test_blocks_for_rounds_up_to_whole_blocks() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert ceil_div(13, 7) == 2 and ceil_div(14, 7) == 2 and ceil_div(15, 7) == 3


def test_blocks_for_takes_arrays_and_tensors_whole() -> None:
    counts = [0, 1, 16, 17, 33]
    assert blocks_for(np.array(counts, dtype=np.int64), 16).tolist() == [0, 1, 1, 2, 3]
    assert blocks_for(torch.tensor(counts), 16).tolist() == [0, 1, 1, 2, 3]


def test_blocks_for_stays_exact_beyond_float_precision() -> None:
    assert blocks_for(2**60 + 1, 2) == 2**59 + 1


def test_slots_follow_the_block_table() -> None:
    table = [7, 2, 5]  # logical block i -> physical block
    assert slot_of(table, 0, 4) == 28
    assert slot_of(table, 5, 4) == 9
    assert slots_of(table, 2, 9, 4) == [30, 31, 8, 9, 10, 11, 20]
    assert slots_of(table, 3, 3, 4) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12), st.integers(1, 16),
       st.data())
def test_slots_of_is_each_positions_slot(table: list[int], block_size: int,
                                          data: st.DataObject) -> None:
    """By runs of a block, the same slots as position by position (`slot_of`)."""
    stop = data.draw(st.integers(0, len(table) * block_size))
    start = data.draw(st.integers(0, stop))
    assert slots_of(table, start, stop, block_size) == [
        slot_of(table, position, block_size) for position in range(start, stop)]


def test_patch_table_replaces_an_entry_or_appends_the_next() -> None:
    table = [7, 2]
    patch_table(table, 1, 9)  # a copy-on-write copy replaced the last block
    assert table == [7, 9]
    patch_table(table, 2, 4)  # a new last block
    assert table == [7, 9, 4]
