"""The contiguous baseline: max-length reservations, first fit, holes merged on free."""

import pytest

from pagedkv.daemon.core import (
    ContiguousAllocator,
    InvalidArgument,
    NoFit,
    SequenceExists,
    SequenceNotFound,
    SeqUpdate,
)


def ok(result: object) -> SeqUpdate:
    assert isinstance(result, SeqUpdate), result
    return result


@pytest.fixture
def alloc() -> ContiguousAllocator:
    # 64 slots = 4 reservations of max_model_len 16.
    return ContiguousAllocator(num_blocks=16, block_size=4, max_model_len=16)


def test_every_sequence_reserves_max_model_len_first_fit(alloc: ContiguousAllocator) -> None:
    assert ok(alloc.allocate("a", 3)).slot_mapping == [0, 1, 2]
    assert ok(alloc.allocate("b", 1)).slot_mapping == [16]
    assert ok(alloc.append("a", 2)).slot_mapping == [3, 4]
    stats = alloc.stats()
    assert (stats.allocated_slots, stats.filled_slots) == (32, 6)
    assert stats.utilization == pytest.approx(6 / 32)   # over-reservation shows up here


def test_no_hole_large_enough_means_no_fit(alloc: ContiguousAllocator) -> None:
    for seq in "abcd":
        ok(alloc.allocate(seq, 1))
    assert alloc.allocate("e", 1) == NoFit(needed=4, available=0)
    alloc.free("b")                                       # slots 16..31 come back
    assert ok(alloc.allocate("e", 1)).slot_mapping == [16]


def test_freed_neighbours_merge_into_one_hole(alloc: ContiguousAllocator) -> None:
    for seq in "abcd":
        ok(alloc.allocate(seq, 1))
    alloc.free("b")
    alloc.free("c")
    assert alloc.largest_hole() == 32
    alloc.free("a")
    assert alloc.largest_hole() == 48 and alloc.external_fragmentation() == 0.0


def test_holes_smaller_than_a_reservation_are_external_fragmentation() -> None:
    # 40 slots hold two 16-slot reservations and strand an 8-slot tail.
    alloc = ContiguousAllocator(num_blocks=10, block_size=4, max_model_len=16)
    ok(alloc.allocate("a", 1))
    ok(alloc.allocate("b", 1))
    assert alloc.largest_hole() == 8
    assert alloc.external_fragmentation() == pytest.approx(8 / 40)
    assert isinstance(alloc.allocate("c", 1), NoFit)


def test_caller_mistakes(alloc: ContiguousAllocator) -> None:
    ok(alloc.allocate("a", 15))
    with pytest.raises(SequenceExists):
        alloc.allocate("a", 1)
    with pytest.raises(InvalidArgument, match="max_model_len"):
        alloc.append("a", 2)                              # past the reservation
    with pytest.raises(SequenceNotFound):
        alloc.free("zz")
    with pytest.raises(InvalidArgument):
        ContiguousAllocator(num_blocks=2, block_size=4, max_model_len=16)
    assert alloc.stats().filled_slots == 15
