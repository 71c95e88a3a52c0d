"""The block tables' memory follows the entries held (issue 17, finding 8).

A dense [rows, longest table] array made 8,000 empty sequences and one long table cost
hundreds of MiB, kept after every session closed. Here the arrays' bytes (nbytes, not RSS) must
stay proportional to the sequences and entries held and return near their start once freed; and
an empty sequence must count against quotas, so a quota bounds the rows as well as the blocks.
"""

import random
from collections.abc import Iterator

import numpy as np
import pytest

from pagedkv.daemon.core import BlockPool, NoFit, seq_table, table_store
from pagedkv.daemon.service.errors import PoolExhausted
from pagedkv.daemon.service.operations import Allocate, Append
from pagedkv.daemon.service.pool_service import PoolService

from pool_state import ROWS, pool_state

# Bytes a held sequence or table entry may cost, with room for doubling (a row holds its
# lengths, region, flags and a block_size-wide partial block: 81 bytes at block size 4).
BYTES_PER_HELD = 256


def table_bytes(pool: BlockPool) -> int:
    """Bytes of every numpy array the pool's per-sequence state keeps, however it is laid out."""
    parts = [pool._seqs, getattr(pool._seqs, "store", None)]  # the store: ragged tables
    held = [value for part in parts if part is not None for value in vars(part).values()]
    return sum(value.nbytes for value in held if isinstance(value, np.ndarray))


def test_table_memory_follows_the_entries_held_and_returns_when_freed() -> None:
    pool = BlockPool(num_blocks=4096, block_size=4)
    start = table_bytes(pool)
    empty = 2000
    for seq in range(empty):                        # many empty sequences...
        assert not isinstance(pool.allocate(seq, 0), NoFit)
    long = pool.allocate("long", 4 * 2000)          # ...and one long table
    assert not isinstance(long, NoFit)
    held = empty + 1 + 2000
    assert table_bytes(pool) <= start + BYTES_PER_HELD * held, (
        f"{table_bytes(pool)} bytes for {held} sequences and entries")
    pool.check_invariants()
    with pool.transaction():                        # as the service frees: in a transaction
        for seq in [*range(empty), "long"]:
            pool.free(seq)
    assert len(pool) == 0
    assert table_bytes(pool) <= 2 * start, f"{table_bytes(pool)} bytes left, {start} at start"
    pool.check_invariants()


def test_a_rolled_back_free_keeps_the_tables_and_a_later_one_shrinks_them() -> None:
    pool = BlockPool(num_blocks=2048, block_size=2)
    for seq in range(300):
        assert not isinstance(pool.allocate(seq, 7, list(range(7))), NoFit)
    grown, before = table_bytes(pool), pool_state(pool)
    with pytest.raises(RuntimeError), pool.transaction():
        for seq in range(299):
            pool.free(seq)
        raise RuntimeError("the call's memory work failed")
    assert pool_state(pool) == before and table_bytes(pool) == grown  # nothing packed
    for seq in range(299):
        pool.free(seq)
    assert table_bytes(pool) < grown / 3
    assert pool.block_table(299) == before[ROWS][299][2]  # type: ignore[index]
    pool.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_random_ops_with_packing_keep_every_table(monkeypatch: pytest.MonkeyPatch,
                                                   seed: int) -> None:
    """Tiny initial sizes make rows and regions move, grow and pack all the time; every
    table must read back as a shadow kept beside it, and every failed transaction must leave
    the state exactly as it was."""
    monkeypatch.setattr(seq_table, "INITIAL_ROWS", 2)
    monkeypatch.setattr(table_store, "INITIAL_ENTRIES", 4)
    monkeypatch.setattr(table_store, "MIN_REGION", 1)
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=256, block_size=2)
    assert len(pool._seqs.num_tokens) == 2 and len(pool._seqs.store.data) == 4  # the sizes above
    shadow: dict[int, list[int]] = {}
    names = iter(range(10**6))
    for _ in range(200):
        before, tables = pool_state(pool), dict(shadow)
        fail = rng.random() < 0.3
        try:
            with pool.transaction():
                for _ in range(rng.randint(1, 6)):
                    _random_op(pool, rng, shadow, names)
                if fail:
                    raise RuntimeError("rolled back")
        except RuntimeError:
            assert pool_state(pool) == before
            shadow = tables
        for seq, table in shadow.items():
            assert pool.block_table(seq) == table
        pool.check_invariants()


def _random_op(pool: BlockPool, rng: random.Random, shadow: dict[int, list[int]],
               names: Iterator[int]) -> None:
    live = list(shadow)
    choice = rng.random()
    if choice < 0.3 or not live:
        seq = next(names)
        update = pool.allocate(seq, rng.randint(0, 9))
    elif choice < 0.55:
        seq = rng.choice(live)
        update = pool.append(seq, rng.randint(1, 5))
    elif choice < 0.65:
        parent, seq = rng.choice(live), next(names)
        update = pool.fork(parent, seq)
    else:
        seq = rng.choice(live)
        pool.free(seq)
        del shadow[seq]
        return
    if not isinstance(update, NoFit):
        shadow[seq] = update.block_table


async def test_an_empty_sequence_counts_against_the_quota() -> None:
    """Empty sequences are not free: each counts one block-table entry until its first block,
    which then adds nothing."""
    service = PoolService(BlockPool(64, 4), None, pool_id="quota")
    sid = service.open_session("a", max_blocks=3).session_id
    for seq_id in range(3):
        await service.allocate(sid, Allocate(seq_id, 0))
    with pytest.raises(PoolExhausted, match="max_blocks=3"):
        await service.allocate(sid, Allocate(3, 0))
    await service.append(sid, Append(0, 4))        # the first block: charged already
    with pytest.raises(PoolExhausted, match="max_blocks=3"):
        await service.append(sid, Append(0, 1))    # a second block: over the quota
    assert service.stats_of(sid).block_table_entries == 3
    service.check_invariants()
    await service.close_session(sid)


async def test_closing_the_sessions_gives_the_table_memory_back() -> None:
    """The finding's probe through the service: many empty sequences over several sessions and
    one long table, then every session closes."""
    pool = BlockPool(num_blocks=4096, block_size=4)
    service = PoolService(pool, None, pool_id="close")
    start = table_bytes(pool)
    sids = [service.open_session(f"s{i}").session_id for i in range(8)]
    for sid in sids:
        for seq_id in range(250):
            await service.allocate(sid, Allocate(seq_id, 0))
    await service.append(sids[0], Append(0, 4 * 2000))
    assert table_bytes(pool) <= start + BYTES_PER_HELD * (8 * 250 + 2000)
    for sid in sids:
        await service.close_session(sid)
    assert table_bytes(pool) <= 2 * start, f"{table_bytes(pool)} bytes left, {start} at start"
    service.check_invariants()
