"""The host tier's bookkeeping (daemon/core/host_tier.py) through BlockPool: exact block ids and
slots on tiny pools, the order copies are dropped in, salts, protection, all-or-nothing.

Pool: 4 blocks of 2 slots, a host tier of 3 slots, unless a test says otherwise. Fresh blocks
and free slots come out in id order; a freed sequence's blocks enter the LRU deepest first.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.daemon.core import BlockPool, InvalidArgument, NoFit, SeqUpdate
from pagedkv.daemon.core.cache_events import Committed, Evicted, Offloaded, Restored


class Heard:
    """The cache events the service would get: the pool's queue, taken each time `log` is
    read."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._log: list[tuple[object, ...]] = []

    @property
    def log(self) -> list[tuple[object, ...]]:
        for event in self._pool.take_events():
            match event:
                case Evicted(blocks):
                    self._log.append(("evicted", blocks))
                case Committed(blocks):
                    self._log.append(("committed", blocks))
                case Offloaded(blocks, stored):
                    self._log.append(("offloaded", blocks, stored.copied,
                                      [s for s, _ in stored.dropped]))
                case Restored(slots, blocks):
                    self._log.append(("restored", slots, blocks))
        return self._log


def tiered(num_blocks: int = 4, slots: int = 3) -> BlockPool:
    pool = BlockPool(num_blocks, 2)
    pool.attach_host_tier(slots)
    return pool


def update(result: SeqUpdate | NoFit) -> SeqUpdate:
    assert isinstance(result, SeqUpdate), result
    return result


def cache(pool: BlockPool, seq: str, tokens: list[int], salt: bytes = b"") -> list[int]:
    """Allocate, commit and free a prompt: its full blocks stay cached. Returns its table."""
    table = update(pool.allocate(seq, len(tokens), tokens, salt)).block_table
    pool.commit([seq])
    pool.free(seq)
    return table


def test_evicted_blocks_are_copied_and_a_later_prefix_is_restored_from_them() -> None:
    pool = tiered()
    heard = Heard(pool)
    with pool.recording_events():
        assert cache(pool, "a", [1, 2, 3, 4]) == [0, 1]  # blocks 0, 1 cached (LRU: 1, 0)
        # 4 blocks of new content: free blocks 2, 3 first, then evicts 1 then 0 (deepest first).
        assert update(pool.allocate("b", 8, [9] * 8)).block_table == [2, 3, 1, 0]
        # Block 1 (tokens 3, 4) went to slot 0, block 0 (tokens 1, 2) to slot 1, before the
        # writer got them: the offload is told before the eviction.
        assert heard.log[-2:] == [("offloaded", [1, 0], [(0, 0), (1, 1)], []),
                                  ("evicted", [1, 0])]
        pool.free("b")  # never committed: its blocks go back free, in table order deepest first
        heard.log.clear()
        # The prompt [1, 2, 3, 4, 5]: no pool hit; both full blocks are in the host tier, in
        # chain order slots 1 then 0, restored into the first two fresh blocks.
        got = update(pool.allocate("c", 5, [1, 2, 3, 4, 5]))
        assert (got.block_table, got.num_cached_tokens) == ([0, 1, 3], 4)
        assert heard.log == [("restored", [1, 0], [0, 1]), ("committed", [0, 1])]
        assert pool.committed_tokens("c") == 4
        pool.check_invariants()
    tier = pool.host_tier
    assert tier is not None and (tier.stores, tier.restores) == (2, 2)
    stats = pool.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 + 8 + 5, 4)


def test_a_restored_block_is_matchable_by_the_next_prompt_without_a_copy() -> None:
    pool = tiered()
    heard = Heard(pool)
    with pool.recording_events():
        cache(pool, "a", [1, 2, 3, 4])
        update(pool.allocate("b", 8, [9] * 8))
        pool.free("b")
        update(pool.allocate("c", 4, [1, 2, 3, 4]))
        heard.log.clear()
        got = update(pool.allocate("d", 4, [1, 2, 3, 4]))  # shares c's restored blocks
        assert (got.block_table, got.num_cached_tokens, heard.log) == ([0, 1], 4, [])
        pool.check_invariants()


def test_the_least_recently_used_copy_is_dropped_and_a_held_key_is_only_touched() -> None:
    pool = tiered(num_blocks=2, slots=2)
    heard = Heard(pool)
    tier = pool.host_tier
    assert tier is not None
    with pool.recording_events():
        cache(pool, "a", [1, 1, 2, 2])  # blocks 0 = [1 1], 1 = [2 2]; LRU 1, 0
        cache(pool, "b", [3, 3, 4, 4])  # evicts 1, 0: slot 0 = [2 2], slot 1 = [1 1]
        assert heard.log[1] == ("offloaded", [1, 0], [(0, 0), (1, 1)], [])
        heard.log.clear()
        # [1 1] is restored from slot 1 (touched and protected: slot 0 is the LRU head). b's
        # blocks are evicted, 0 = [4 4] first: one slot of room, slot 0, whose [2 2] is
        # dropped; 1 = [3 3] finds no room and is not copied.
        cache(pool, "c", [1, 1, 9, 9])
        assert heard.log[:3] == [("offloaded", [0, 1], [(0, 0)], [0]), ("evicted", [0, 1]),
                                 ("restored", [1], [0])]
        assert tier.tokens_of[[0, 1]].tolist() == [[4, 4], [1, 1]] and list(tier.lru) == [1, 0]
        heard.log.clear()
        # c's blocks are evicted, 1 = [9 9] then 0 = [1 1]: [1 1] is held (slot 1) so it is
        # touched first, and [9 9] takes the slot before it, 0 ([4 4] dropped).
        update(pool.allocate("d", 4, [7, 7, 8, 8]))
        assert heard.log == [("offloaded", [1, 0], [(0, 0)], [0]), ("evicted", [1, 0])]
        assert (tier.stores, list(tier.lru)) == (4, [1, 0])
        pool.check_invariants()


def test_slots_being_restored_are_never_dropped_by_the_same_allocation() -> None:
    # A host tier of 2 slots, both holding the prompt's prefix; the allocation evicts 2 more
    # cached blocks whose copies would need both slots: they are not copied (room is 0).
    pool = tiered(num_blocks=4, slots=2)
    heard = Heard(pool)
    with pool.recording_events():
        cache(pool, "a", [1, 1, 2, 2])              # blocks 0, 1
        cache(pool, "b", [3, 3, 4, 4, 5, 5, 6, 6])  # 2, 3 free, then evicts 1, 0 -> slots;
        # b's table 2, 3, 1, 0 is cached deepest first: LRU 0, 1, 3, 2
        heard.log.clear()
        got = update(pool.allocate("c", 4, [1, 1, 2, 2]))
        assert got.num_cached_tokens == 4
        offloads = [entry for entry in heard.log if entry[0] == "offloaded"]
        # b's blocks 0 = [6 6] and 1 = [5 5] are evicted with no copy: both slots are restoring.
        assert offloads == [("offloaded", [0, 1], [], [])]
        assert heard.log[-2][0] == "restored"
        pool.check_invariants()


def test_a_copy_is_matched_only_under_its_salt() -> None:
    pool = tiered()
    cache(pool, "a", [1, 2, 3, 4], salt=b"tenant-a")
    update(pool.allocate("b", 8, [9] * 8))
    pool.free("b")
    assert update(pool.allocate("x", 4, [1, 2, 3, 4], b"tenant-b")).num_cached_tokens == 0
    assert update(pool.allocate("y", 4, [1, 2, 3, 4], b"tenant-a")).num_cached_tokens == 4


def test_skip_host_tier_recomputes() -> None:
    pool = tiered()
    cache(pool, "a", [1, 2, 3, 4])
    update(pool.allocate("b", 8, [9] * 8))
    pool.free("b")
    got = update(pool.allocate("c", 4, [1, 2, 3, 4], use_host_tier=False))
    assert got.num_cached_tokens == 0 and pool.committed_tokens("c") == 0
    tier = pool.host_tier
    assert tier is not None and tier.restores == 0
    pool.check_invariants()


def test_a_failed_transaction_leaves_the_tier_exactly_as_it_was() -> None:
    pool = tiered()
    cache(pool, "a", [1, 2, 3, 4])
    tier = pool.host_tier
    assert tier is not None
    before = (dict(tier.slot_of), list(tier.lru), list(tier.free), tier.stores, tier.restores,
              tier.tokens_of.copy())
    with pytest.raises(RuntimeError), pool.transaction():
        update(pool.allocate("b", 8, [9] * 8))  # evicts and copies a's blocks
        assert tier.stores == 2
        raise RuntimeError("a later op of the call failed")
    after = (dict(tier.slot_of), list(tier.lru), list(tier.free), tier.stores, tier.restores,
             tier.tokens_of.copy())
    assert before[:5] == after[:5] and np.array_equal(before[5], after[5])
    pool.check_invariants()


def test_attach_checks_its_size() -> None:
    with pytest.raises(InvalidArgument, match="num_slots"):
        BlockPool(4, 2).attach_host_tier(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8), st.booleans(), st.booleans()),
                max_size=40))
def test_random_calls_keep_every_invariant_and_restore_only_what_was_stored(
        calls: list[tuple[int, int, bool, bool]]) -> None:
    """Prompts from 4 shared prefixes; each call allocates (maybe inside a transaction that
    fails), commits and frees. The pool's and the tier's invariants hold after every call (a
    slot's key is the hash of its tokens: a copy is only ever matched by its content), and a
    prompt's cached tokens never exceed what it shares with an earlier committed prompt."""
    pool = tiered(num_blocks=6, slots=4)
    prefixes = [[p] * 8 for p in range(4)]
    seen: list[tuple[int, list[int]]] = []  # committed prompts
    with pool.recording_events():
        for n, (prefix, length, fail, commit) in enumerate(calls):
            tokens = prefixes[prefix][:length]
            try:
                with pool.transaction():
                    got = pool.allocate(n, length, tokens)
                    if fail:
                        raise RuntimeError
            except RuntimeError:
                pool.check_invariants()
                continue
            if isinstance(got, NoFit):
                continue
            committed_before = [len(t) // 2 * 2 for p, t in seen if p == prefix]
            assert got.num_cached_tokens <= max([0, *committed_before]) // 2 * 2
            assert got.num_cached_tokens <= length // 2 * 2
            if commit:
                seen.append((prefix, tokens))
                pool.commit([n])
            pool.free(n)
            pool.check_invariants()
