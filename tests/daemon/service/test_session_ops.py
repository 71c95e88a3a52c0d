"""SessionOps' runs of Appends: a Batch's consecutive Appends of one length go to the pool as
one vectorized append, with the answers, changes and errors of one by one.

The reference is the same ops each sent as a Batch of its own, on a twin service. Block ids
may differ between the two (one append makes every copy first, one by one interleaves copies
and new blocks), so states and answers are compared with each block renamed by its first
appearance in the sessions' tables.
"""

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_service import make_service, snapshot

from pagedkv.daemon.core import InvalidArgument, SequenceNotFound, SeqUpdate
from pagedkv.daemon.service.errors import PoolExhausted
from pagedkv.daemon.service.operations import Allocate, Append, Commit, Fork, Free, Operation
from pagedkv.daemon.service.pool_service import PoolService


async def prepared(num_blocks: int = 32, max_blocks: int = 0) -> tuple[PoolService, str]:
    """Sequences 1-4 of 3, 4, 5 and 6 tokens with ids, 1 and 2 committed, 5 a fork of 1
    (sharing its partially filled last block)."""
    service = make_service(num_blocks=num_blocks)
    options: dict[str, Any] = {"max_blocks": max_blocks} if max_blocks else {}
    sid = service.open_session("a", **options).session_id
    await service.batch(sid, [Allocate(s, s + 2, [10 * s + i for i in range(s + 2)])
                              for s in (1, 2, 3, 4)])
    await service.batch(sid, [Commit([1, 2]), Fork(1, 5)])
    return service, sid


def renamed(service: PoolService, updates: list[SeqUpdate]) -> tuple[object, ...]:
    """The sessions' tables, books and the answers, each block id replaced by the order of its
    first appearance in the tables (sessions and sequences in order), then in the answers."""
    names: dict[int, int] = {}

    def name(block: int) -> int:
        return names.setdefault(block, len(names))

    stats, tables, books, host = snapshot(service)
    tables = {key: ([name(b) for b in table], n) for key, (table, n) in sorted(tables.items())}
    bs = service.pool.block_size
    answers = [([name(b) for b in u.block_table], u.num_tokens,
                [name(s // bs) * bs + s % bs for s in u.slot_mapping],
                [(name(c.src), name(c.dst)) for c in u.copies]) for u in updates]
    return stats, tables, books, host, answers


async def both(ops: list[Operation], **options: Any) -> tuple[object, object]:
    """`ops` as one Batch, and one by one on a twin: each side's renamed state and answers."""
    together, sid = await prepared(**options)
    one_by_one, twin = await prepared(**options)
    updates = await together.batch(sid, ops)
    singles = [(await one_by_one.batch(twin, [op]))[0] for op in ops]
    together.check_invariants()
    one_by_one.check_invariants()
    return renamed(together, updates), renamed(one_by_one, singles)


async def test_a_release_of_decoded_tokens_is_what_one_by_one_does() -> None:
    """A runner's release: every sequence's decoded tokens appended (certified), committed,
    freed; the fork appends into its shared partial block first (a copy)."""
    ops: list[Operation] = [Append(s, 3, [100 + s, 200 + s, 300 + s]) for s in (5, 1, 2, 3, 4)]
    ops += [Commit([5, 1, 2, 3, 4]), *(Free(s) for s in (5, 1, 2, 3, 4))]
    together, one_by_one = await both(ops)
    assert together == one_by_one


async def test_appends_without_ids_and_a_copy_mid_run_match_one_by_one() -> None:
    together, one_by_one = await both([Append(s, 2) for s in (2, 1, 5, 4)])
    assert together == one_by_one


async def test_the_same_sequence_twice_is_appended_twice_in_order() -> None:
    service, sid = await prepared()
    first, second = await service.batch(sid, [Append(3, 1, [7]), Append(3, 1, [8])])
    assert (first.num_tokens, second.num_tokens) == (6, 7)
    assert second.slot_mapping == [first.slot_mapping[0] + 1]
    service.check_invariants()


@pytest.mark.parametrize(("ops", "error", "message"), [
    ([Append(1, 1), Append(99, 1), Append(2, 1)], SequenceNotFound,
     r"^op 1 \(Append\): sequence 99 not found"),
    ([Append(1, 2, [1, 2]), Append(2, 2, [3]), Append(3, 2, [4, 5])], InvalidArgument,
     r"^op 1 \(Append\): .*num_tokens=2"),
    # 26 of 32 blocks are free, and 28 tokens take about 7 more a sequence.
    ([Append(s, 28) for s in (1, 2, 3, 4, 5)], PoolExhausted,
     r"^ops 0-4 \(Append\): pool full: the call needs \d+ blocks, \d+ available"),
])
async def test_a_refused_run_names_its_op_and_changes_nothing(
        ops: list[Operation], error: type[Exception], message: str) -> None:
    service, sid = await prepared()
    before = snapshot(service)
    with pytest.raises(error, match=message):
        await service.batch(sid, ops)
    assert snapshot(service) == before
    service.check_invariants()


async def test_the_session_quota_counts_the_run_so_far() -> None:
    """max_blocks 10: the sequences hold 7 table entries; 4 more tokens take one more block
    each, so the fourth Append of the run (op 3) passes the quota."""
    service, sid = await prepared(max_blocks=10)
    before = snapshot(service)
    with pytest.raises(PoolExhausted, match=r"^op 3 \(Append\): session quota: the call needs "
                                            r"4 more blocks, 3 of max_blocks=10 left"):
        await service.batch(sid, [Append(s, 4) for s in (1, 2, 3, 4, 5)])
    assert snapshot(service) == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(st.sampled_from([1, 2, 3, 4, 5]), min_size=2, max_size=6),
       num_tokens=st.integers(1, 9), with_ids=st.booleans(),
       num_blocks=st.sampled_from([12, 16, 32]))
async def test_random_runs_match_one_by_one(seqs: list[int], num_tokens: int, with_ids: bool,
                                            num_blocks: int) -> None:
    """Any run (a repeated sequence splits it), refused or not: the same outcome both ways."""
    ops: list[Operation] = [Append(s, num_tokens, [s] * num_tokens if with_ids else [])
                            for s in seqs]
    together, sid = await prepared(num_blocks)
    one_by_one, twin = await prepared(num_blocks)
    try:
        updates = await together.batch(sid, ops)
    except PoolExhausted:  # refused whole: one by one, some op finds the pool full
        with pytest.raises(PoolExhausted):
            for op in ops:
                await one_by_one.batch(twin, [op])
        return
    singles = [(await one_by_one.batch(twin, [op]))[0] for op in ops]
    assert renamed(together, updates) == renamed(one_by_one, singles)
