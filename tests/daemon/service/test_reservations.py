"""Slots reserved ahead (kvpool.proto's StepRequest.reserve_tokens), through a real daemon.

Pool: 16 blocks of 4 slots, handed out in order 0, 1, 2, ... (released blocks go to the back).
A Step may reserve slots past the tokens it appends: the blocks are taken by that Step and
answered as changed entries; later appends into them take no block and change no entry. Reserved
slots hold no token: no commit covers them, nothing is keyed by them, and they go back with the
sequence however it ends (Free, CloseSession, the lease of a holder that died).
"""

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from pagedkv.client import (
    AnswerTooLarge,
    BlockCopy,
    InvalidArgument,
    PoolClient,
    PoolExhausted,
    Session,
    StepResult,
)
from pagedkv.daemon.service.limits import Limits
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import Daemon, running_daemon
from hand_clock import HandClock

NUM_BLOCKS = 16
# A prompt of two full blocks, and the four tokens a runner decodes after it.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
DECODED = [9, 10, 11, 12]



@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=NUM_BLOCKS, block_size=4) as running:
        yield running


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target) as connected:
        yield connected


async def table(session: Session, seq_id: int) -> tuple[list[int], int]:
    """The sequence's block table and token count, as the daemon tells them."""
    [blocks] = await session.block_tables([seq_id])
    return blocks.block_ids, blocks.num_tokens


def changed(step: StepResult) -> list[tuple[int, int, int]]:
    """A step's changed entries as (seq index, logical block, block)."""
    return list(zip(step.changed_seq_index, step.changed_logical_block, step.changed_block_id,
                    strict=True))


async def test_a_reservation_takes_its_blocks_at_once_and_appends_into_it_take_none(
        daemon: Daemon, client: PoolClient) -> None:
    session = await client.open_session("decode-ahead")
    assert (await session.allocate(1, token_ids=[1, 2, 3])).block_ids == [0]
    # Token 4 fills block 0; 4 + 8 reserved slots need 3 blocks: 1 and 2 are taken now.
    step = await session.step([1], [4], reserve_tokens=8)
    assert (step.slot_mapping, changed(step), step.copies, step.num_tokens) == (
        [3], [(0, 1, 1), (0, 2, 2)], [], [4])
    assert await table(session, 1) == ([0, 1, 2], 4)  # reserved slots are not tokens
    assert daemon.pool.stats().free_blocks == NUM_BLOCKS - 3
    # Four tokens decoded ahead land in block 1 (slots 4..7), a fifth in block 2: no block
    # taken, no entry changed, the slots the table already gave.
    step = await session.step([1], [5, 6, 7, 8], num_tokens=4)
    assert (step.slot_mapping, changed(step)) == ([4, 5, 6, 7], [])
    step = await session.step([1], [9])
    assert (step.slot_mapping, changed(step), step.num_tokens) == ([8], [], [9])
    assert daemon.pool.stats().free_blocks == NUM_BLOCKS - 3
    # Reserving again reaches further (10 + 6 slots: block 3); reserving less keeps it all.
    step = await session.step([1], [10], reserve_tokens=6)
    assert (step.slot_mapping, changed(step)) == ([9], [(0, 3, 3)])
    step = await session.step([1], [11])
    assert (step.slot_mapping, changed(step)) == ([10], [])
    # An Append (or a Batch's) into the reservation takes nothing either.
    appended = await session.append(1, token_ids=[12])
    assert (appended.slot_mapping, appended.block_ids) == ([11], [0, 1, 2, 3])
    assert await table(session, 1) == ([0, 1, 2, 3], 12)
    stats = await session.stats()
    assert stats.session is not None and stats.session.block_table_entries == 4
    daemon.service.check_invariants()


async def test_a_shared_last_block_is_copied_and_a_fork_shares_only_blocks_with_tokens(
        daemon: Daemon, client: PoolClient) -> None:
    session = await client.open_session("forks")
    await session.allocate(1, token_ids=[1, 2])
    assert (await session.fork(1, 2)).block_ids == [0]
    # Block 0 is shared and partly filled: the parent gets a copy (block 1) before its token
    # lands, so the slots it reserves (block 2 too) are its own.
    step = await session.step([1], [3], reserve_tokens=4)
    assert (step.copies, changed(step), step.slot_mapping) == (
        [BlockCopy(0, 1)], [(0, 0, 1), (0, 1, 2)], [6])
    assert await table(session, 2) == ([0], 2)
    # A fork of the reserving parent shares block 1 (its tokens), never reserved block 2.
    assert (await session.fork(1, 3)).block_ids == [1]
    daemon.service.check_invariants()
    # The parent's next token lands in the shared block 1: copied (block 3), reported; its
    # reserved entry stays.
    step = await session.step([1], [4])
    assert (step.copies, changed(step), step.slot_mapping) == (
        [BlockCopy(1, 3)], [(0, 0, 3)], [15])
    assert await table(session, 1) == ([3, 2], 4)
    step = await session.step([1], [5])
    assert (step.slot_mapping, changed(step)) == ([8], [])  # into reserved block 2
    daemon.service.check_invariants()


async def test_refused_reservations_change_nothing(daemon: Daemon, client: PoolClient) -> None:
    quota = await client.open_session("quota", max_blocks=3)
    await quota.allocate(1, token_ids=[1, 2, 3])
    # 4 tokens + 12 reserved slots need 4 table entries: over the session's 3.
    with pytest.raises(PoolExhausted, match=r"session quota.*max_blocks=3"):
        await quota.step([1], [4], reserve_tokens=12)
    assert await table(quota, 1) == ([0], 3)
    assert daemon.pool.stats().free_blocks == NUM_BLOCKS - 1
    # The pool: each sequence's reservation alone would fit, both do not; neither changes.
    full = await client.open_session("full")
    await full.allocate(2, token_ids=[1, 2, 3])
    await full.allocate(3, token_ids=[1, 2, 3])
    await full.allocate(4, num_tokens=4 * (NUM_BLOCKS - 4))
    assert daemon.pool.stats().free_blocks == 1
    with pytest.raises(PoolExhausted, match="pool full: the call needs 2 blocks, 1 available"):
        await full.step([3, 2], [4, 4], reserve_tokens=1)
    assert [await table(full, seq) for seq in (2, 3)] == [([1], 3), ([2], 3)]
    assert daemon.pool.stats().free_blocks == 1
    stats = await full.stats()
    assert stats.session is not None and stats.session.block_table_entries == NUM_BLOCKS - 2
    daemon.service.check_invariants()


async def test_reserve_tokens_past_max_reserve_tokens_is_refused() -> None:
    assert Limits().max_reserve_tokens == 256  # two blocks ahead at block size 128
    async with running_daemon(num_blocks=NUM_BLOCKS, block_size=4,
                              limits=Limits(max_reserve_tokens=8)) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session()
        await session.allocate(1, token_ids=[1])
        with pytest.raises(InvalidArgument, match=r"9 reserve_tokens.*max_reserve_tokens=8"):
            await session.step([1], [2], reserve_tokens=9)
        assert await table(session, 1) == ([0], 1)
        assert (await session.step([1], [2], reserve_tokens=8)).changed_block_id == [1, 2]


async def test_reserved_blocks_count_in_the_call_work_and_answer_bounds() -> None:
    """A reservation's blocks are work the call does and entries its answer lists: refused
    before the pool is asked (without the count, the pool would answer PoolExhausted)."""
    limits = Limits(max_reserve_tokens=1 << 16, max_call_work=1024)
    async with running_daemon(num_blocks=NUM_BLOCKS, block_size=4, limits=limits) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session()
        await session.allocate(1, token_ids=[1])
        with pytest.raises(InvalidArgument, match="max_call_work=1024"):
            await session.step([1], [2], reserve_tokens=4096)
    limits = Limits(max_reserve_tokens=1 << 16, max_answer_bytes=4096)
    async with running_daemon(num_blocks=NUM_BLOCKS, block_size=4, limits=limits) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session()
        await session.allocate(1, token_ids=[1])
        with pytest.raises(AnswerTooLarge, match="max_answer_bytes=4096"):
            await session.step([1], [2], reserve_tokens=8192)
        assert await table(session, 1) == ([0], 1)


async def test_a_step_many_entry_reserves_alone(daemon: Daemon, client: PoolClient) -> None:
    session = await client.open_session()
    await session.allocate(1, token_ids=[1])
    await session.allocate(2, token_ids=[1])
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        reply = await kvpool_pb2_grpc.KVPoolStub(channel).StepMany(pb.StepManyRequest(steps=[
            pb.StepRequest(session_id=session.session_id, seq_ids=[1], token_ids=[2],
                           reserve_tokens=4),
            pb.StepRequest(session_id=session.session_id, seq_ids=[2], token_ids=[2],
                           reserve_tokens=4 * NUM_BLOCKS)]))
    first, second = reply.results
    assert (first.code, list(first.step.changed_block_id)) == (0, [2])
    assert (second.code, second.cause) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                           "PoolExhausted")
    assert await table(session, 2) == ([1], 1)
    daemon.service.check_invariants()


# ------------------------------------------------------------ rollback paths


async def decode_ahead(session: Session, seq_id: int) -> list[int]:
    """A runner's decode-ahead: the prompt, certified; one decoded token appended with 8 slots
    reserved, into which it writes the K/V of 3 more tokens it decodes ahead (never appended:
    the sequence stops). Returns the table."""
    await session.allocate(seq_id, token_ids=PROMPT)
    await session.step([seq_id], DECODED[:1], commit=True, reserve_tokens=8)
    blocks, tokens = await table(session, seq_id)
    assert (len(blocks), tokens) == (5, 9)  # 9 + 8 slots: 5 blocks
    return blocks


async def cached_tokens(client: PoolClient, salt: str) -> int:
    """What a later prompt of the decoded tokens, under `salt`, finds cached: the certified
    prompt only, never the slots decoded ahead into the reservation."""
    later = await client.open_session("later", cache_salt=salt)
    hit = (await later.allocate(1, token_ids=PROMPT + DECODED)).num_cached_tokens
    await later.close()
    return hit


async def test_an_early_stop_frees_its_reservation_and_never_commits_it(
        daemon: Daemon, client: PoolClient) -> None:
    session = await client.open_session("stops", cache_salt="shared")
    await decode_ahead(session, 1)
    # No commit covers a reserved slot: the sequence holds 9 tokens, whatever its table.
    with pytest.raises(InvalidArgument, match="exceeds the tokens its sequence holds"):
        await session.commit([1], [12])
    assert await session.commit([1]) == 0  # the prompt's 2 blocks are committed already
    assert await session.free(1) == 3  # 1 block of a token, 2 reserved: no content kept
    stats = daemon.pool.stats()
    assert (stats.free_blocks, stats.used_blocks, stats.cached_blocks, stats.pending_blocks) == (
        NUM_BLOCKS, 0, 2, 0)
    assert await cached_tokens(client, "shared") == len(PROMPT)
    daemon.service.check_invariants()


async def test_an_abort_through_close_session_frees_its_reservation(
        daemon: Daemon, client: PoolClient) -> None:
    session = await client.open_session("aborts", cache_salt="shared")
    await decode_ahead(session, 1)
    await decode_ahead(session, 2)  # its prompt hits the cache: 2 blocks shared
    # Tokens 10..12 appended into sequence 1's reservation, aborted before they are certified.
    assert (await session.step([1], DECODED[1:], num_tokens=3)).changed_block_id == []
    assert daemon.pool.stats().used_blocks == 2 + 3 + 3
    await session.close()
    stats = daemon.pool.stats()
    assert (stats.free_blocks, stats.used_blocks, stats.pending_blocks) == (NUM_BLOCKS, 0, 0)
    assert await cached_tokens(client, "shared") == len(PROMPT)
    daemon.service.check_invariants()


async def test_lease_expiry_mid_reservation_gives_every_block_back() -> None:
    clock = HandClock()
    async with running_daemon(num_blocks=NUM_BLOCKS, block_size=4, clock=clock) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session("lapses", keep_alive=False, cache_salt="shared")
        await decode_ahead(session, 1)
        # Tokens 10..12 appended into the reservation, never certified: pending, then gone.
        await session.step([1], DECODED[1:], num_tokens=3)
        clock.now += 3600
        assert await daemon.service.expire_due() == 1
        stats = daemon.pool.stats()
        assert (stats.free_blocks, stats.used_blocks, stats.pending_blocks) == (NUM_BLOCKS, 0, 0)
        assert await cached_tokens(client, "shared") == len(PROMPT)
        daemon.service.check_invariants()


# The holder: reserve ahead, say READY with its table, then wait to be killed before it
# certifies the tokens it appends into the reservation.
HOLDER_SCRIPT = f"""
import asyncio, sys
from pagedkv.client import PoolClient

async def main(target):
    client = await PoolClient.connect(target)
    session = await client.open_session("doomed", lease_ttl_ms=400, cache_salt="shared")
    await session.allocate(1, token_ids={PROMPT})
    await session.step([1], {DECODED[:1]}, commit=True, reserve_tokens=8)
    await session.step([1], {DECODED[1:]}, num_tokens=3)
    print("READY", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1]))
"""


async def test_a_holder_killed_between_reserving_and_certifying_leaks_and_commits_nothing(
        daemon: Daemon, client: PoolClient) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER_SCRIPT, daemon.unix_target, stdout=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None
        assert (await asyncio.wait_for(process.stdout.readline(), timeout=60)).strip() == b"READY"
        stats = daemon.pool.stats()
        assert (stats.used_blocks, stats.pending_blocks) == (5, 1)  # tokens 9..12: pending
    finally:
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()
    for _ in range(200):  # its lease (0.4 s) lapses and the reaper frees it
        if daemon.service.num_sessions == 0:
            break
        await asyncio.sleep(0.05)
    assert daemon.service.num_sessions == 0
    stats = daemon.pool.stats()
    assert (stats.free_blocks, stats.used_blocks, stats.pending_blocks) == (NUM_BLOCKS, 0, 0)
    assert await cached_tokens(client, "shared") == len(PROMPT)
    daemon.service.check_invariants()


# ------------------------------------------------------------- contiguous


async def test_a_contiguous_reservation_holds_reserved_slots_up_to_max_model_len() -> None:
    """Reserved slots need no block in a contiguous pool: the table lists the reservation's
    blocks; past max_model_len they are refused (the reservation ends there)."""
    async with running_daemon(num_blocks=8, block_size=4, allocator="contiguous",
                              max_model_len=16) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session()
        assert (await session.allocate(1, token_ids=[1, 2, 3])).block_ids == [0]
        step = await session.step([1], [4], reserve_tokens=8)
        assert (step.slot_mapping, changed(step)) == ([3], [(0, 1, 1), (0, 2, 2)])
        step = await session.step([1], [5, 6, 7, 8, 9], num_tokens=5)
        assert (step.slot_mapping, changed(step)) == ([4, 5, 6, 7, 8], [])
        with pytest.raises(InvalidArgument, match="max_model_len=16"):
            await session.step([1], [10], reserve_tokens=7)
        assert await table(session, 1) == ([0, 1, 2], 9)
        assert await session.free(1) == 4
        daemon.service.check_invariants()
