"""A pool restored from its image is the same pool: it answers every call as the original.

The machine runs random operations (allocate with shared prompt heads, append, fork, commit,
free, page withdrawal) on a pool with a host tier and holder groups, and at random points
takes the pool's image through msgpack (what the snapshot file keeps) into a fresh pool.
From then on every operation runs on the original and on each restored copy side by side:
their answers (tables, slots, copies, cache hits, NoFit) must be equal, each passes
`check_invariants`, and their whole states (`pool_state`, stats, host tier) are equal, so the
free-list and LRU order, pending and committed keys and figures all came back exactly.
"""

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.daemon.core import BlockPool, InvalidArgument, PoolError
from pagedkv.daemon.core.pool_image import pool_image, restore_image

from pool_state import pool_state

BLOCK_SIZE = 4
NUM_BLOCKS = 12
HOST_SLOTS = 4
NAMES = st.sampled_from([("s", 1), ("s", 2), ("t", 1), "u", 7])
HEADS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


def new_pool(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> BlockPool:
    pool = BlockPool(num_blocks, block_size, blocks_per_page=2)
    pool.track_holders(2)
    pool.attach_host_tier(HOST_SLOTS)
    return pool


def restored(pool: BlockPool) -> BlockPool:
    """A fresh pool holding `pool`'s image, read back as a snapshot reads it."""
    image = msgpack.unpackb(msgpack.packb(pool_image(pool), use_bin_type=True),
                            raw=False, strict_map_key=False)
    copy = new_pool()
    restore_image(copy, image)
    copy.check_invariants()
    return copy


def whole_state(pool: BlockPool) -> object:
    host = pool.host_tier
    assert host is not None
    return (pool_state(pool), pool.stats(), dict(host.slot_of), list(host.lru),
            list(host.free), host.stores, host.restores,
            [pool.blocks_held(level, group) for level in range(2) for group in range(3)])


class RestoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # The original first, then each restored copy: every call runs on all of them.
        self.pools = [new_pool()]

    def _all(self, call: Callable[[BlockPool], Any]) -> None:
        """Run `call` on every pool; answers (or the error's type) must be equal (compared
        as their reprs: answers hold numpy arrays)."""
        answers = []
        for pool in self.pools:
            try:
                answers.append(repr(call(pool)))
            except PoolError as exc:
                answers.append(repr(type(exc)))
        assert all(answer == answers[0] for answer in answers), answers

    @rule(seq=NAMES, head=st.sampled_from(HEADS), extra=st.integers(0, 6),
          salt=st.sampled_from([b"", b"x"]))
    def allocate(self, seq: object, head: list[int], extra: int, salt: bytes) -> None:
        tokens = head + list(range(100, 100 + extra))
        group = hash(seq) % 3

        def call(pool: BlockPool) -> object:
            with pool.holding([group, group % 2]):
                return pool.allocate(seq, len(tokens), tokens, salt)
        self._all(call)

    @rule(seq=NAMES, k=st.integers(1, 5), reserve=st.integers(0, 4))
    def append(self, seq: object, k: int, reserve: int) -> None:
        self._all(lambda pool: pool.append_batch([seq], k, [list(range(k))], reserve))

    @rule(parent=NAMES, child=NAMES)
    def fork(self, parent: object, child: object) -> None:
        def call(pool: BlockPool) -> object:
            with pool.holding([1, 0]):
                return pool.fork(parent, child)
        self._all(call)

    @rule(seq=NAMES)
    def commit(self, seq: object) -> None:
        self._all(lambda pool: pool.commit([seq]))

    @rule(seq=NAMES)
    def free(self, seq: object) -> None:
        self._all(lambda pool: pool.free(seq))

    @rule(page=st.integers(0, NUM_BLOCKS // 2 - 1))
    def withdraw_and_restore(self, page: int) -> None:
        self._all(lambda pool: pool.withdraw_pages([page]))
        self._all(lambda pool: pool.restore_pages([page]))

    @rule()
    def restart(self) -> None:
        self.pools.append(restored(self.pools[-1]))

    @invariant()
    def the_copies_are_the_original(self) -> None:
        first = whole_state(self.pools[0])
        for pool in self.pools:
            pool.check_invariants()
            assert whole_state(pool) == first


RestoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                            deadline=None)
TestRestoreMachine = RestoreMachine.TestCase


def test_an_image_of_another_geometry_is_refused_naming_it() -> None:
    image = pool_image(new_pool())
    other = new_pool(num_blocks=16)
    with pytest.raises(InvalidArgument, match="num_blocks 12 != 16"):
        restore_image(other, image)
    assert len(other) == 0 and other.stats() == new_pool(num_blocks=16).stats()
