"""The bundled client and the message-size limit both sides share, errors mapped by their cause,
and the retry rules of kvpool.proto for calls whose answer was lost.

A lost answer is injected in the daemon under test: a servicer method wrapped (before the
server binds it) so that it applies the call and then aborts with UNAVAILABLE, or sleeps past
the client's deadline, or aborts before applying. Pool: 16 blocks of 4 slots unless said.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from pagedkv.client import (
    AnswerTooLarge,
    DaemonUnavailable,
    DeadlineExceeded,
    LimitExceeded,
    MessageTooLarge,
    OutcomeUnknown,
    PoolClient,
    PoolExhausted,
    RetryPolicy,
    SequenceBlocks,
    Session,
    Step,
)
from pagedkv.client.pool.errors import error_from_rpc
from pagedkv.daemon.edge.servicer import KVPoolServicer
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.operations import Allocate, Append
from pagedkv.proto.limits import MAX_MESSAGE_BYTES

from daemon_harness import Daemon, running_daemon

KVPOOL = "pagedkv.v1.KVPool"
# The client's deadline in these tests, and how long a "slow" answer takes.
TIMEOUT_S = 0.5
SLOW_S = 1.5
PROMPT = list(range(100, 110))  # 10 tokens: two full blocks and a partial one


@dataclass
class Loss:
    """How the next answers of one method are lost."""

    # Answers still to lose.
    times: int = 0
    # Apply the call before losing its answer (else lose it before the call runs).
    applied: bool = True
    # "unavailable": abort UNAVAILABLE; "deadline": answer only after the client's deadline.
    how: str = "unavailable"


class Losses:
    """Wraps KVPoolServicer's Allocate, Step, StepMany and Free (before the server binds them)
    so that a test can make their next answers get lost."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plans = {method: Loss() for method in ("Allocate", "Step", "StepMany", "Free")}
        # Calls that reached each method, however they ended.
        self.received = dict.fromkeys(self.plans, 0)
        for method in self.plans:
            monkeypatch.setattr(KVPoolServicer, method, self._lossy(method))

    def lose(self, method: str, times: int = 1, *, applied: bool = True,
             how: str = "unavailable") -> None:
        self.plans[method] = Loss(times, applied, how)

    def _lossy(self, method: str) -> Callable[..., Awaitable[Any]]:
        original = getattr(KVPoolServicer, method)

        async def lossy(servicer: KVPoolServicer, request: Any, context: Any) -> Any:
            plan = self.plans[method]
            self.received[method] += 1
            if plan.times == 0:
                return await original(servicer, request, context)
            plan.times -= 1
            answer = await original(servicer, request, context) if plan.applied else None
            if plan.how == "deadline":
                await asyncio.sleep(SLOW_S)
                return answer
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost (test)")

        return lossy


@pytest.fixture
def losses(monkeypatch: pytest.MonkeyPatch) -> Losses:
    return Losses(monkeypatch)


@pytest.fixture
async def daemon(losses: Losses) -> AsyncIterator[Daemon]:
    async with running_daemon() as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def session(daemon: Daemon) -> AsyncIterator[Session]:
    async with await PoolClient.connect(daemon.unix_target, timeout=TIMEOUT_S) as client, \
            await client.open_session("lossy") as opened:
        await opened.allocate(1, token_ids=PROMPT)  # blocks 0, 1, 2
        await opened.commit([1])  # blocks 0 and 1 now shareable
        yield opened


def calls(daemon: Daemon, method: str, code: str = "OK") -> float:
    """How many `method` calls the daemon answered with `code`."""
    labels = {"service": KVPOOL, "method": method, "code": code}
    return daemon.registry.get_sample_value("pagedkv:rpc_requests_total", labels) or 0.0


# ------------------------------------------------------------------ message size

async def test_an_answer_over_grpc_default_4_mib_reaches_the_client(losses: Losses) -> None:
    """The issue: the third ~2^20-token Allocate on a 200k-block pool answered 4,390,927 bytes;
    the client's default 4 MiB limit refused it as PoolExhausted while the daemon kept the
    sequence. The daemon's default answers fit 4 MiB; where its operator raised
    max_answer_bytes to 8 MiB, the bundled client, which accepts 8 MiB, receives them."""
    raised = Limits(max_answer_bytes=MAX_MESSAGE_BYTES)
    async with running_daemon(num_blocks=200_000, block_size=16, limits=raised) as daemon:
        async with await PoolClient.connect(daemon.unix_target, timeout=30) as client, \
                await client.open_session("big") as session:
            for seq_id in (1, 2):  # the first 2^21 slots: 3-byte varints, 4-byte ones after
                await daemon.service.allocate(session.session_id, Allocate(seq_id, 1 << 20))
            third = await session.allocate(3, 1 << 20)
            assert len(third.slot_mapping) == 1 << 20 and third.slot_mapping[0] == 1 << 21
        assert daemon.service.check_invariants() is None


async def test_grpc_own_resource_exhausted_is_not_pool_exhausted(daemon: Daemon,
                                                                 session: Session) -> None:
    """A request over 8 MiB is refused by gRPC (RESOURCE_EXHAUSTED, no cause): MessageTooLarge,
    an OutcomeUnknown, never PoolExhausted; it is not retried as it is."""
    with pytest.raises(MessageTooLarge) as failure:
        await session.allocate(2, token_ids=[2**60] * 1_000_000)  # 9 bytes per token id
    assert isinstance(failure.value, OutcomeUnknown)
    assert not isinstance(failure.value, PoolExhausted)
    assert len(daemon.pool) == 1 and calls(daemon, "GetBlockTables") == 0


def status(code: grpc.StatusCode, cause: str | None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(("pagedkv-error", cause)) if cause else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, "details")


def test_errors_are_mapped_by_the_daemons_cause_not_the_code_alone() -> None:
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert type(error_from_rpc(status(exhausted, "PoolExhausted"))) is PoolExhausted
    assert type(error_from_rpc(status(exhausted, "LimitExceeded"))) is LimitExceeded
    assert type(error_from_rpc(status(exhausted, "AnswerTooLarge"))) is AnswerTooLarge
    assert type(error_from_rpc(status(exhausted, None))) is MessageTooLarge
    assert type(error_from_rpc(status(grpc.StatusCode.DEADLINE_EXCEEDED, None))) \
        is DeadlineExceeded


# ------------------------------------------------------------------- lost answers

# What Allocate(2, PROMPT) answers after the fixture: blocks 0 and 1 from the prefix cache,
# block 3 fresh (seq 1 holds block 2).
SECOND = SequenceBlocks(2, [0, 1, 3], 10, 8, [0, 1, 2, 3, 4, 5, 6, 7, 12, 13], [])


@pytest.mark.parametrize("how", ["unavailable", "deadline"])
async def test_a_lost_allocate_that_was_applied_is_read_back_not_resent(
        daemon: Daemon, session: Session, losses: Losses, how: str) -> None:
    """Found with the requested tokens: applied. The answer is rebuilt exactly (the cached
    prefix included); the Allocate is not sent again (it would get ALREADY_EXISTS)."""
    losses.lose("Allocate", how=how)
    assert await session.allocate(2, token_ids=PROMPT) == SECOND
    assert losses.received["Allocate"] == 2  # seq 1's and the lost one: never resent
    assert calls(daemon, "GetBlockTables") == 1


async def test_a_lost_allocate_that_was_not_applied_is_sent_again(
        daemon: Daemon, session: Session, losses: Losses) -> None:
    """NOT_FOUND on read-back: not applied, so it is sent again."""
    losses.lose("Allocate", applied=False)
    assert await session.allocate(2, token_ids=PROMPT) == SECOND
    assert losses.received["Allocate"] == 3 and calls(daemon, "Allocate") == 2


@pytest.mark.parametrize("how", ["unavailable", "deadline"])
async def test_a_lost_step_that_was_applied_is_rebuilt_from_the_tables(
        daemon: Daemon, session: Session, losses: Losses, how: str) -> None:
    """Every sequence one step longer than the session last heard: applied once, never twice.
    The slots are exact; the changed entries are every entry the step touched (here seq 2's
    unchanged block 3 too); copies were made by the daemon before it answered."""
    await session.allocate(2, 6)  # blocks 3 and 4; seq 1 holds 10 tokens in 0, 1, 2
    losses.lose("Step", how=how)
    result = await session.step([1, 2], token_ids=[7, 8])
    assert result.slot_mapping == [2 * 4 + 2, 4 * 4 + 2] and result.num_tokens == [11, 7]
    assert list(zip(result.changed_seq_index, result.changed_logical_block,
                    result.changed_block_id, strict=True)) == [(0, 2, 2), (1, 1, 4)]
    assert [daemon.pool.num_tokens(daemon.service.sessions.get(session.session_id).key(q))
            for q in (1, 2)] == [11, 7]
    assert losses.received["Step"] == 1  # the lost one only: never resent


async def test_a_lost_step_that_reserved_lists_its_reserved_entries(
        daemon: Daemon, session: Session, losses: Losses) -> None:
    """A lost Step with reserve_tokens, applied: the rebuilt answer's changed entries reach
    over the reservation (blocks 3 and 4: 11 tokens + 6 reserved slots), as the lost one's did."""
    losses.lose("Step")
    result = await session.step([1], token_ids=[7], reserve_tokens=6)
    assert result.slot_mapping == [10] and result.num_tokens == [11]
    assert list(zip(result.changed_seq_index, result.changed_logical_block,
                    result.changed_block_id, strict=True)) == [(0, 2, 2), (0, 3, 3), (0, 4, 4)]
    assert [table.block_ids for table in await session.block_tables([1])] == [[0, 1, 2, 3, 4]]
    assert losses.received["Step"] == 1


async def test_a_lost_step_that_was_not_applied_is_sent_again(
        daemon: Daemon, session: Session, losses: Losses) -> None:
    losses.lose("Step", applied=False)
    result = await session.step([1], token_ids=[7])
    assert result.num_tokens == [11] and result.slot_mapping == [10]
    assert losses.received["Step"] == 2 and calls(daemon, "Step") == 1


async def test_a_lost_step_is_not_guessed_when_the_session_cannot_tell(
        daemon: Daemon, session: Session, losses: Losses) -> None:
    """Someone else (a runner under this session) appended: the lengths fit neither outcome,
    so the lost call's error is raised rather than a guess."""
    number = daemon.service.sessions.get(session.session_id).number
    await daemon.service.append(session.session_id, Append(1, 2))  # behind its back: 12 tokens
    losses.lose("Step")
    with pytest.raises(DaemonUnavailable):
        await session.step([1])
    assert daemon.pool.num_tokens((number, 1)) == 13  # applied once, and said unknown


@pytest.mark.parametrize("applied", [True, False])
async def test_a_lost_step_many_is_read_back_entry_by_entry(
        daemon: Daemon, losses: Losses, applied: bool) -> None:
    """Two sessions' Steps in one unary StepMany (an external scheduler's; lost StepStream
    messages are tests/daemon/edge/test_step_stream.py's), its answer lost: each entry is read
    back as its session's lost Step: applied, its result rebuilt (never sent again); not
    applied, sent again as a Step of its own. Each sequence is one token longer."""
    async with await PoolClient.connect(daemon.unix_target, timeout=TIMEOUT_S,
                                        step_stream=False) as client, \
            await client.open_session("a") as alice, await client.open_session("b") as bob:
        await alice.allocate(1, 3)  # block 0
        await bob.allocate(1, 5)  # blocks 1 and 2
        losses.lose("StepMany", applied=applied)
        results = await client.step_many([(alice, Step([1], [7])), (bob, Step([1], [8]))])
        assert [(r.num_tokens, r.slot_mapping) for r in results  # type: ignore[union-attr]
                ] == [([4], [3]), ([6], [9])]
        assert [(await s.block_tables([1]))[0].num_tokens for s in (alice, bob)] == [4, 6]
    assert losses.received["StepMany"] == 1
    assert losses.received["Step"] == (0 if applied else 2)


@pytest.mark.parametrize("applied", [True, False])
async def test_a_lost_free_is_read_back(daemon: Daemon, session: Session, losses: Losses,
                                        applied: bool) -> None:
    """NOT_FOUND on read-back: applied (the released count was in the lost answer: 0); found:
    sent again."""
    await session.allocate(2, 3)  # block 3, released by the free
    losses.lose("Free", applied=applied)
    assert await session.free(2) == (0 if applied else 1)
    assert daemon.service.stats_of(session.session_id).num_sequences == 1
    assert losses.received["Free"] == (1 if applied else 2)


async def test_recovery_can_be_turned_off(daemon: Daemon, losses: Losses) -> None:
    """retry=None: the lost call's error is raised at once, and the caller must read back."""
    async with await PoolClient.connect(daemon.unix_target, timeout=TIMEOUT_S,
                                        retry=None) as client, \
            await client.open_session() as session:
        losses.lose("Allocate")
        with pytest.raises(OutcomeUnknown):
            await session.allocate(1, 4)
        assert [t.num_tokens for t in await session.block_tables([1])] == [4]  # it was applied
    assert calls(daemon, "GetBlockTables") == 1
    assert RetryPolicy(attempts=1).attempts == 1
    with pytest.raises(ValueError, match="attempts >= 1"):
        RetryPolicy(attempts=0)
