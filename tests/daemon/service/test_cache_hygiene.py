"""One tenant's K/V never reaches the next through the prefix cache (cache_hygiene.py).

A real in-process daemon over real CPU pool memory (16 blocks of 4 tokens). The tests write
"K/V" into blocks as a runner would, then look at what a later owner's blocks hold:
- a session with a private salt leaves nothing cached when it ends (closed or expired), and
  with zero_freed_blocks what it left is zeroed;
- with zero_freed_blocks, a cached block evicted for a new owner (another salt) is zeroed by
  the evicting call, before its answer, and before a copy-on-write copy the same call makes
  into it (so the copy is not wiped).
"""

from collections.abc import AsyncIterator, Callable

import pytest
import torch

from pagedkv.client import Allocate, PoolClient, PoolExhausted, Session

from daemon_harness import Daemon, running_daemon
from hand_clock import HandClock

PROMPT = list(range(100, 108))  # two full blocks of 4 tokens




@pytest.fixture(params=[True, False], ids=["zeroing", "no-zeroing"])
def zeroing(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
async def daemon(zeroing: bool, clock: HandClock) -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=16, block_size=4, with_memory=True,
                              zero_freed_blocks=zeroing, clock=clock) as running:
        yield running


def kv(daemon: Daemon) -> torch.Tensor:
    assert daemon.memory is not None
    return daemon.memory.kv


def write(daemon: Daemon, blocks: list[int], value: float) -> None:
    """What a runner does: K/V written into these blocks."""
    kv(daemon)[blocks] = value


def holds(daemon: Daemon, blocks: list[int], value: float) -> bool:
    return bool((kv(daemon)[blocks] == value).all())


async def cache_a_prompt(session: Session, value: float, daemon: Daemon) -> list[int]:
    """Allocate PROMPT, write its K/V, commit and free it: its two blocks stay cached."""
    blocks = (await session.allocate(1, token_ids=PROMPT)).block_ids
    write(daemon, blocks, value)
    await session.commit([1])
    await session.free(1)
    return blocks


async def end_by_close(session: Session, daemon: Daemon, clock: HandClock) -> None:
    await session.close()


async def end_by_expiry(session: Session, daemon: Daemon, clock: HandClock) -> None:
    clock.now += 3600  # far past its lease (it keeps no lease alive: keep_alive=False)
    assert await daemon.service.expire_due() == 1


@pytest.mark.parametrize("end", [end_by_close, end_by_expiry], ids=["close", "expiry"])
async def test_a_private_sessions_cached_blocks_go_when_it_ends(
        daemon: Daemon, zeroing: bool, clock: HandClock,
        end: Callable[[Session, Daemon, HandClock], object]) -> None:
    async with await PoolClient.connect(daemon.unix_target) as client:
        tenant_a = await client.open_session("a", keep_alive=False)  # private salt
        blocks = await cache_a_prompt(tenant_a, 7.0, daemon)
        assert daemon.pool.stats().cached_blocks == 2  # A may reuse them while it lives
        again = await tenant_a.allocate(2, token_ids=PROMPT)
        assert again.num_cached_tokens == 8 and again.block_ids == blocks
        await tenant_a.free(2)
        await end(tenant_a, daemon, clock)  # type: ignore[func-returns-value]
        stats = daemon.pool.stats()  # pool-wide figures are the operator's, not GetStats'
        assert stats.cached_blocks == 0 and stats.free_blocks == 16  # no one could hit them
        assert holds(daemon, blocks, 0.0) is zeroing
        # Tenant B takes the whole pool: with zeroing, none of A's K/V is in its blocks.
        tenant_b = await client.open_session("b")
        taken = (await tenant_b.allocate(1, 64)).block_ids
        assert set(blocks) <= set(taken)
        assert holds(daemon, taken, 0.0) is zeroing
        daemon.service.check_invariants()  # includes: no record of A's blocks is left


async def test_evicted_blocks_are_zeroed_before_the_new_owner_and_before_copies_into_them(
        daemon: Daemon, zeroing: bool) -> None:
    async with await PoolClient.connect(daemon.unix_target) as client:
        tenant_a = await client.open_session("a", cache_salt="team-a")  # a shared salt
        cached = await cache_a_prompt(tenant_a, 7.0, daemon)
        await tenant_a.close()
        assert daemon.pool.stats().cached_blocks == 2  # kept: the salt's others may hit
        tenant_b = await client.open_session("b")
        # 54 tokens: the 14 free blocks, the last one half full. Its K/V is written.
        seq = await tenant_b.allocate(1, 54)
        assert not set(cached) & set(seq.block_ids)
        write(daemon, seq.block_ids, 5.0)
        await tenant_b.fork(1, 2)
        # A write to the shared half-full block copies it into a block evicted from the cache.
        step = await tenant_b.step([2])
        (copy,) = step.copies
        assert copy.dst in cached
        assert holds(daemon, [copy.dst], 5.0)  # the copy, not wiped by a later zeroing
        # The last cached block goes to a new sequence: A's K/V is gone when zeroing is on.
        (other,) = set(cached) - {copy.dst}
        assert (await tenant_b.allocate(3, 4)).block_ids == [other]
        assert holds(daemon, [other], 0.0) is zeroing
        assert holds(daemon, [other], 7.0) is not zeroing
        daemon.service.check_invariants()


async def test_a_failed_call_that_evicted_leaves_the_records_as_they_were(
        daemon: Daemon) -> None:
    async with await PoolClient.connect(daemon.unix_target) as client:
        tenant_a = await client.open_session("a")
        await cache_a_prompt(tenant_a, 7.0, daemon)
        # 15 blocks evict one of A's cached blocks, then the second op fails: all undone.
        with pytest.raises(PoolExhausted):
            await tenant_a.batch([Allocate(2, 60), Allocate(3, 1000)])
        assert daemon.pool.stats().cached_blocks == 2
        daemon.service.check_invariants()
        await tenant_a.close()  # both still known as A's: both dropped
        assert daemon.pool.stats().cached_blocks == 0
        daemon.service.check_invariants()
