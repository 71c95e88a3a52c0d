"""Pages of a pool's block ids: withdrawn, restored, and picked when idle (exact block ids).

Every pool here has 4 pages of 2 blocks (num_blocks=8, blocks_per_page=2): page p is blocks
2p and 2p + 1. Blocks come off the free list in id order (FIFO); released and restored blocks
go to its tail.
"""

import re

import pytest

from pagedkv.daemon.core import BlockPool, InvalidArgument, NoFit, SeqUpdate
from pagedkv.daemon.core.cache_events import Evicted

from pool_state import pool_state


def ok(result: object) -> SeqUpdate:
    assert isinstance(result, SeqUpdate), result
    return result


def paged(block_size: int = 4, withdrawn: bool = False) -> BlockPool:
    return BlockPool(num_blocks=8, block_size=block_size, blocks_per_page=2, withdrawn=withdrawn)


def cached_pool() -> BlockPool:
    """Page 0 cached (a committed prompt of ids 1..4, block size 2, freed): the LRU holds
    block 1 then block 0 (deepest first); the free list is blocks 2..7."""
    pool = paged(block_size=2)
    ok(pool.allocate("a", 4, [1, 2, 3, 4]))  # blocks [0, 1]
    assert pool.commit(["a"]) == 2
    assert pool.free("a") == []                # both stay cached
    return pool


def test_allocation_never_takes_a_block_of_a_withdrawn_page() -> None:
    pool = paged()
    assert (pool.blocks_per_page, pool.held_pages) == (2, 4)
    assert pool.withdraw_pages([0, 2]) == []   # nothing cached there
    stats = pool.stats()
    assert (stats.num_blocks, stats.free_blocks, pool.num_free_blocks) == (4, 4, 4)
    assert pool.held_pages == 2
    a = ok(pool.allocate("a", 12))             # 3 blocks: the free list is [2, 3, 6, 7]
    assert a.block_table == [2, 3, 6]
    assert pool.allocate("b", 8) == NoFit(needed=2, available=1)
    pool.check_invariants()
    pool.restore_pages([0])                    # free list: [7, 0, 1]
    assert pool.held_pages == 3 and pool.stats().num_blocks == 6
    assert ok(pool.allocate("b", 8)).block_table == [7, 0]
    assert ok(pool.append("a", 4)).block_table == [2, 3, 6, 1]
    assert pool.allocate("c", 1) == NoFit(needed=1, available=0)  # page 2 stays withdrawn
    stats = pool.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.allocated_slots) == (6, 0, 24)
    pool.check_invariants()


def test_a_format_that_starts_with_no_memory_gets_the_pages_restored() -> None:
    pool = paged(withdrawn=True)
    assert pool.held_pages == 0 and pool.idle_pages() == []
    stats = pool.stats()
    assert (stats.num_blocks, stats.free_blocks, stats.used_blocks) == (0, 0, 0)
    assert pool.allocate("a", 1) == NoFit(needed=1, available=0)
    pool.check_invariants()
    pool.restore_pages([3, 1])                 # free list: [6, 7, 2, 3]
    assert ok(pool.allocate("a", 12)).block_table == [6, 7, 2]
    assert pool.idle_pages() == []             # page 1 holds block 3 free, block 2 used
    pool.check_invariants()


def test_withdraw_evicts_cached_blocks_and_reports_them_as_evictions() -> None:
    pool = cached_pool()
    with pool.recording_events():
        assert pool.withdraw_pages([0]) == [0, 1]
        assert pool.take_events() == [Evicted([0, 1])]
    stats = pool.stats()
    assert (stats.num_blocks, stats.cached_blocks, stats.free_blocks) == (6, 0, 6)
    pool.check_invariants()
    pool.restore_pages([0])                    # free list: [2, ..., 7, 0, 1]
    b = ok(pool.allocate("b", 4, [1, 2, 3, 4]))
    assert b.num_cached_tokens == 0 and b.block_table == [2, 3]  # the prefix is gone
    pool.check_invariants()


def test_idle_pages_are_the_unreferenced_ones_coldest_first() -> None:
    pool = paged(block_size=2)
    ok(pool.allocate("a", 4, [1, 2, 3, 4]))    # page 0
    ok(pool.allocate("b", 4, [5, 6, 7, 8]))    # page 1
    ok(pool.allocate("c", 2))                  # block 4: page 2 is referenced
    pool.commit(["a", "b"])
    pool.free("b")                             # LRU: 3, 2
    pool.free("a")                             # LRU: 3, 2, 1, 0
    # Page 3 was never used; page 1's warmest block (2) was released before page 0's (0).
    assert pool.idle_pages() == [3, 1, 0]
    assert ok(pool.allocate("d", 2, [5, 6])).num_cached_tokens == 2  # revives block 2
    assert pool.idle_pages() == [3, 0]
    pool.free("d")                             # block 2 is now the most recently released
    assert pool.idle_pages() == [3, 0, 1]
    assert pool.withdraw_pages([3, 0]) == [0, 1]   # page by page, in id order
    assert pool.idle_pages() == [1]
    pool.check_invariants()


def test_a_default_pool_holds_every_page_of_one_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    assert (pool.blocks_per_page, pool.held_pages) == (1, 4)
    ok(pool.allocate("a", 5))                  # blocks [0, 1]
    assert pool.idle_pages() == [2, 3]
    assert pool.withdraw_pages([2]) == []
    assert ok(pool.allocate("b", 1)).block_table == [3]
    pool.check_invariants()


@pytest.mark.parametrize(("verb", "pages", "words"), [
    ("withdraw", [4], "page 4 is out of range"),
    ("withdraw", [-1], "page -1 is out of range"),
    ("withdraw", [3, 3], "name a page twice"),
    ("withdraw", [3, 2], "page 2 is already withdrawn"),
    ("withdraw", [0, 1], "page 1 has referenced blocks [3]"),
    ("withdraw", [True], "is not an integer"),
    ("restore", [2, 3], "page 3 is not withdrawn"),
    ("restore", [2, 2], "name a page twice"),
    ("restore", [5], "page 5 is out of range"),
])
def test_page_mistakes_name_the_page_and_change_nothing(verb: str, pages: list[int],
                                                        words: str) -> None:
    pool = paged(block_size=2)
    ok(pool.allocate("b", 6, [1, 2, 3, 4, 5, 6]))  # blocks [0, 1, 2]
    pool.commit(["b"])
    ok(pool.allocate("a", 2))                  # block 3
    pool.free("b")                             # pages 0 and 1 cached, block 3 referenced
    pool.withdraw_pages([2])
    before = pool_state(pool)
    with pytest.raises(InvalidArgument, match=re.escape(words)):
        if verb == "withdraw":
            pool.withdraw_pages(pages)
        else:
            pool.restore_pages(pages)
    assert pool_state(pool) == before
    pool.check_invariants()


@pytest.mark.parametrize(("num_blocks", "blocks_per_page"), [(9, 2), (8, 0), (8, 3)])
def test_blocks_must_make_whole_pages(num_blocks: int, blocks_per_page: int) -> None:
    with pytest.raises(InvalidArgument, match="blocks_per_page"):
        BlockPool(num_blocks, 4, blocks_per_page=blocks_per_page)


def test_a_failed_transaction_undoes_withdraw_and_restore() -> None:
    pool = cached_pool()
    pool.withdraw_pages([3])
    before = pool_state(pool)
    with pytest.raises(RuntimeError), pool.transaction():
        assert pool.withdraw_pages([1, 0]) == [0, 1]
        pool.restore_pages([3])
        ok(pool.allocate("b", 8))              # blocks 4, 5, 6, 7
        raise RuntimeError("undone")
    assert pool_state(pool) == before
    assert pool.held_pages == 3 and pool.stats().cached_blocks == 2
    pool.check_invariants()
    b = ok(pool.allocate("b", 4, [1, 2, 3, 4]))
    assert b.num_cached_tokens == 4 and b.block_table == [0, 1]  # the prefix is back
    assert ok(pool.allocate("c", 6)).block_table == [2, 3, 4]    # the free list's order too
    pool.check_invariants()

