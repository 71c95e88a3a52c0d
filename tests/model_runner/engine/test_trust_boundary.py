"""The runner as a trust boundary: what a client states is checked against the daemon,
one client's bad step fails alone, blocks outlive the forwards that write them, and the runner
forgets sessions that ended.

One Llama model (tests/support/families.py's) over a real pagedkvd; the engine in-process,
its forwards held at will (`GatedRunner`) so which steps share a forward, and when a forward
runs, are decided by the test, not by timing.
"""

import asyncio
import contextlib
import dataclasses
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest
import torch

from pagedkv.client import (
    History,
    PoolClient,
    SeqStep,
    SequenceNotFound,
    Session,
    SessionBusy,
    SessionExpired,
    StepOutputs,
)
from pagedkv.client import StepNotComputed as ClientStepNotComputed
from pagedkv.client.engine.runner_link import RunnerLink
from pagedkv.client.pool.errors import error_from_rpc, error_from_status
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.engine.steps import InvalidStep, StepNotComputed, UnknownSequence
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.process.servicer import status_of
from pagedkv.model_runner.runner import SequenceChunk
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

import families
from engine_driver import RecordingRunner, decode, new
from families import GREEDY, NEW_TOKENS, VOCAB, expected_tokens
from pagedkvd_process import Pagedkvd

FAMILY = "llama"
# The fixtures daemon and prompts are conftest.py's (the families' pool).
# How many event-loop polls a test waits for a state the engine reaches at once (10 ms each).
POLLS = 500
# The lease of a client that dies mid-step.
DYING_LEASE_MS = 1000
# A short runner hold, and how many of its halves a held forward outlasts.
SHORT_HOLD_MS = 1000
HELD_HALVES = 5


class GatedRunner(RecordingRunner):
    """A runner whose forwards wait while `gate` is clear (each sets `entered` first), and
    whose next forward raises when `fail_next` is set."""

    gate: threading.Event
    entered: threading.Event
    fail_next: bool

    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(timeout=60), "a test left a forward held"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected forward failure")
        return super().step(chunks)


@pytest.fixture
async def engine(runner_client: PoolClient) -> AsyncIterator[StepEngine]:
    runner = GatedRunner.attach(families.paged_model(FAMILY), await runner_client.pool_info(),
                                get_backend("torch"))
    runner.gate, runner.entered, runner.fail_next = threading.Event(), threading.Event(), False
    runner.gate.set()
    started = StepEngine(runner_client, runner)
    await started.start()
    yield started
    runner.gate.set()
    await started.stop()


def gated(engine: StepEngine) -> GatedRunner:
    assert isinstance(engine.runner, GatedRunner)
    return engine.runner


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(POLLS):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine never reached the state waited for")


async def hold_a_forward(engine: StepEngine, session_id: str,
                         requests: list[SeqStep]) -> "asyncio.Task[StepOutputs]":
    """Close the gate and start the step `requests`, whose forward then waits in the runner
    (until the test opens the gate: `gated(engine).gate.set()`)."""
    runner = gated(engine)
    runner.gate.clear()
    runner.entered.clear()
    step = asyncio.create_task(engine.step(session_id, requests))
    await until(runner.entered.is_set)
    return step


async def held(session: Session, seq_id: int) -> int:
    return (await session.block_tables([seq_id]))[0].num_tokens


def decode_step(seq_id: int, token: int, history: History | None = None) -> SeqStep:
    return SeqStep(seq_id, (token,), False, 0, GREEDY, history=history)


# ------------------------------------------------------------ 1: a client's history


@pytest.fixture
async def salted(client: PoolClient) -> AsyncIterator[tuple[Session, Session]]:
    """Two sessions sharing one cache salt: the victim's and the attacker's."""
    salt = f"trust-{uuid.uuid4().hex}"
    async with await client.open_session("victim", cache_salt=salt) as victim, \
            await client.open_session("attacker", cache_salt=salt) as attacker:
        yield victim, attacker


async def test_a_forged_history_is_refused_and_the_shared_prefix_stays_intact(
    engine: StepEngine, salted: tuple[Session, Session], prompts: list[tuple[int, ...]],
) -> None:
    """The attack of issue 17 #1: the attacker allocates P directly in the daemon (a hit on the
    victim's committed blocks), then sends the runner a history of other tokens Q claiming
    nothing computed. The runner checks Q against the ids the daemon holds and refuses it
    (nothing changed); the victim's next request for P hits the cache and gives the tokens of
    a private run."""
    victim, attacker = salted
    prompt = prompts[2]  # two full blocks and one token
    await decode(engine, victim.session_id, [new(1, prompt, GREEDY)], NEW_TOKENS)
    table = await attacker.allocate(7, token_ids=prompt)
    assert table.num_cached_tokens == 32
    forged = tuple((t + 1) % VOCAB for t in prompt)
    (attack,) = await asyncio.gather(engine.step(attacker.session_id, [
        decode_step(7, 5, History(forged, 33, 0))]), return_exceptions=True)
    again = await decode(engine, victim.session_id, [new(2, prompt, GREEDY)], NEW_TOKENS)
    assert again[2].results[0].num_cached == 32
    assert again[2].tokens == expected_tokens(FAMILY, prompt)
    assert isinstance(attack, InvalidStep) and "sequence 7: its history differs" in str(attack)
    assert await held(attacker, 7) == len(prompt)


async def test_a_history_claiming_uncomputed_tokens_computed_is_computed_again(
    engine: StepEngine, salted: tuple[Session, Session], prompts: list[tuple[int, ...]],
) -> None:
    """The attacker allocates R directly (blocks keyed pending, never computed) and sends R's
    true history claiming every token computed: the runner takes the daemon's committed count
    (none), computes R, and what it commits is R's K/V, which the victim's R then hits."""
    victim, attacker = salted
    prompt = prompts[2]
    await attacker.allocate(7, token_ids=prompt)
    first = expected_tokens(FAMILY, prompt)[0]
    out = await engine.step(attacker.session_id, [
        decode_step(7, first, History(prompt, len(prompt), len(prompt)))])
    assert (out[0].num_computed, out[0].token_id) == (
        len(prompt) + 1, expected_tokens(FAMILY, prompt)[1])
    await engine.step(attacker.session_id, [], release=[7])
    victims = await decode(engine, victim.session_id, [new(1, prompt, GREEDY)], NEW_TOKENS)
    assert victims[1].results[0].num_cached == 32
    assert victims[1].tokens == expected_tokens(FAMILY, prompt)


async def test_a_client_forked_sequence_with_other_ids_than_its_parent_is_refused(
    engine: StepEngine, session: Session, prompts: list[tuple[int, ...]],
) -> None:
    """A child the client forked itself must hold its parent's ids: one forked from another
    sequence but named as the parent's child is refused, nothing changed."""
    await engine.step(session.session_id, [new(1, prompts[1], GREEDY)])
    await session.allocate(2, token_ids=prompts[2][:len(prompts[1])])
    await session.fork(2, 3)
    with pytest.raises(InvalidStep, match="sequence 3: its history differs"):
        await engine.step(session.session_id, [
            SeqStep(3, (4,), False, 0, GREEDY, parent_seq_id=1)])
    assert await held(session, 3) == len(prompts[1])


# ------------------------------------------------- 3: a bad step in a merged forward


async def test_an_out_of_vocabulary_history_fails_alone_before_a_merged_forward(
    engine: StepEngine, client: PoolClient, prompts: list[tuple[int, ...]],
) -> None:
    """A good client's decode and a bad client's step (a history id past the vocabulary) are
    ready for the same forward: the bad one is refused before any daemon call (its sequence
    unchanged), the good one is answered with its token."""
    async with await client.open_session("good") as good, \
            await client.open_session("bad") as bad, \
            await client.open_session("blocker") as blocker_session:
        prompt = prompts[1]
        expected = expected_tokens(FAMILY, prompt)
        await engine.step(good.session_id, [new(1, prompt, GREEDY)])
        await bad.allocate(5, token_ids=prompts[0])
        history = History((*prompts[0][:-1], VOCAB + 3), len(prompts[0]), 0)
        blocker = await hold_a_forward(engine, blocker_session.session_id,
                                       [new(99, (1, 2, 3), GREEDY)])
        good_step = asyncio.create_task(engine.step(good.session_id,
                                                    [decode_step(1, expected[0])]))
        bad_step = asyncio.create_task(engine.step(bad.session_id,
                                                   [decode_step(5, 7, history)]))
        await until(lambda: len(engine.forwards._ready) + bad_step.done() == 2)
        gated(engine).gate.set()
        await blocker
        assert (await good_step)[0].token_id == expected[1]
        with pytest.raises(InvalidStep, match=r"sequence 5: history.token_ids must be in"):
            await bad_step
        assert await held(bad, 5) == len(prompts[0])


async def test_a_forward_that_fails_after_the_appends_says_so_and_a_resend_computes_them(
    engine: StepEngine, session: Session, prompts: list[tuple[int, ...]],
) -> None:
    """The daemon call was applied, the forward failed: StepNotComputed (not "nothing
    changed"); the step resent without its token computes it, appending nothing twice."""
    prompt = prompts[1]
    expected = expected_tokens(FAMILY, prompt)
    await engine.step(session.session_id, [new(1, prompt, GREEDY)])
    gated(engine).fail_next = True
    with pytest.raises(StepNotComputed):
        await engine.step(session.session_id, [decode_step(1, expected[0])])
    assert await held(session, 1) == len(prompt) + 1
    resent = await engine.step(session.session_id, [SeqStep(1, (), False, 0, GREEDY)])
    assert (resent[0].token_id, resent[0].num_tokens) == (
        expected[1], len(prompt) + 1)
    assert await held(session, 1) == len(prompt) + 1


async def test_a_step_not_computed_that_named_a_token_decoded_ahead_is_resent_without_it(
    engine: StepEngine, session: Session, prompts: list[tuple[int, ...]],
) -> None:
    """The runner appended a token ahead and its forward failed; the client's step naming the
    token fails in its forward too (StepNotComputed): resent without the token, as every
    StepNotComputed is, it computes that token, appending nothing more."""
    prompt = prompts[1]
    expected = expected_tokens(FAMILY, prompt)
    await engine.step(session.session_id, [
        dataclasses.replace(new(1, prompt, GREEDY), decode_ahead=True)])
    gated(engine).fail_next = True  # the forward ahead, which starts after this answer
    await asyncio.gather(*engine._ahead_tasks)
    gated(engine).fail_next = True
    with pytest.raises(StepNotComputed):
        await engine.step(session.session_id, [decode_step(1, expected[0])])
    resent = await engine.step(session.session_id, [SeqStep(1, (), False, 0, GREEDY)])
    assert resent[0].token_id == expected[1]
    assert await held(session, 1) == len(prompt) + 1


# ------------------------------------------------------- 4: a cancelled step's blocks


async def test_a_cancelled_steps_blocks_are_not_released_before_its_forward_ends(
    engine: StepEngine, session: Session, prompts: list[tuple[int, ...]],
) -> None:
    """The client gives up on a step whose forward is running (held), then releases the
    sequence through the runner: the release waits for that forward, so the daemon holds the
    blocks while it may write them, and frees them once it is done."""
    prompt = prompts[1]
    await engine.step(session.session_id, [new(1, prompt, GREEDY)])
    runner = gated(engine)
    step = await hold_a_forward(engine, session.session_id,
                                [decode_step(1, expected_tokens(FAMILY, prompt)[0])])
    step.cancel()
    release = asyncio.create_task(engine.step(session.session_id, [], release=[1]))
    for _ in range(20):  # time for a release that did not wait to reach the daemon
        await asyncio.sleep(0.01)
    assert not release.done()
    assert await held(session, 1) == len(prompt) + 1
    runner.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await step
    await release
    with pytest.raises(SequenceNotFound):
        await session.block_tables([1])


async def test_a_dead_clients_lease_is_kept_until_its_forward_ends(
    engine: StepEngine, client: PoolClient, prompts: list[tuple[int, ...]],
) -> None:
    """A client that dies mid-step (no KeepAlive of its own, its step cancelled) keeps its
    session, and so its blocks, while the forward is held: the runner renews the lease until
    the forward ends; then the lease lapses and the daemon frees everything."""
    dying = await client.open_session("dying", lease_ttl_ms=DYING_LEASE_MS, keep_alive=False)
    prompt = prompts[1]
    await engine.step(dying.session_id, [new(1, prompt, GREEDY)])
    runner = gated(engine)
    step = await hold_a_forward(engine, dying.session_id,
                                [decode_step(1, expected_tokens(FAMILY, prompt)[0])])
    step.cancel()
    await asyncio.sleep(2.5 * DYING_LEASE_MS / 1000)  # past two leases
    assert await held(dying, 1) == len(prompt) + 1
    runner.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await step
    await asyncio.sleep(2.5 * DYING_LEASE_MS / 1000)
    with pytest.raises(SessionExpired):
        await dying.block_tables([1])


async def test_a_session_closed_directly_under_its_step_keeps_its_blocks_until_the_forward(
    daemon: Pagedkvd, engine: StepEngine, client: PoolClient, prompts: list[tuple[int, ...]],
) -> None:
    """The last hole of #4 (the runner fuzzer's closed_mid_step): a client sends a step, then
    closes its session (or frees its sequence) directly in the daemon while the step's forward
    is held. The runner's hold makes the daemon refuse both (SessionBusy, nothing freed), so
    another session's copy-on-write gets none of its blocks; once the forward is done the hold
    ends, the close succeeds, and the other session decodes the tokens of a private run."""
    expected = expected_tokens(FAMILY, prompts[1])
    async with await client.open_session("bystander") as bystander:
        await engine.step(bystander.session_id, [new(1, prompts[1], GREEDY)])
        attacker = await client.open_session("attacker", keep_alive=False)
        runner = gated(engine)
        step = await hold_a_forward(engine, attacker.session_id, [new(1, prompts[2], GREEDY)])
        (table,) = await attacker.block_tables([1])
        async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # one close, not a wait
                await kvpool_pb2_grpc.KVPoolStub(channel).CloseSession(
                    pb.CloseSessionRequest(session_id=attacker.session_id))
        closed = error_from_rpc(refused.value)
        assert isinstance(closed, SessionBusy) and re.match(
            r"CloseSession refused: a runner holds session attacker#\d+ for \d+ ms more",
            closed.message)
        with pytest.raises(SessionBusy, match="release the sequences through the runner"):
            await attacker.free(1)
        assert (await attacker.block_tables([1]))[0].block_ids == table.block_ids
        await bystander.allocate(5, token_ids=prompts[1])
        await bystander.fork(5, 6)
        copied = await bystander.step([6], [expected[0]])  # the shared partial block copied
        assert copied.copies and not {c.dst for c in copied.copies} & set(table.block_ids)
        runner.gate.set()
        await step
        assert await attacker.close() == 1  # the runner ended its hold after the forward
        decoded = await decode(engine, bystander.session_id, [decode_step(1, expected[0])],
                               NEW_TOKENS - 1)
        assert decoded[1].tokens == expected[1:]


async def test_a_forward_longer_than_the_hold_keeps_the_session_held(
    engine: StepEngine, client: PoolClient, prompts: list[tuple[int, ...]],
) -> None:
    """The runner renews its hold at half its length while a forward waits or runs: the
    client's own Free is refused for as long as the forward is held (here two and a half holds),
    and once the forward is done and the session idle the runner ends the hold."""
    engine.holds.hold_ms = SHORT_HOLD_MS
    expected = expected_tokens(FAMILY, prompts[1])
    async with await client.open_session("long-forward") as session:
        await engine.step(session.session_id, [new(1, prompts[1], GREEDY)])
        runner = gated(engine)
        step = await hold_a_forward(engine, session.session_id, [decode_step(1, expected[0])])
        for _ in range(HELD_HALVES):
            with pytest.raises(SessionBusy):
                await session.free(1)
            await asyncio.sleep(SHORT_HOLD_MS / 2000)
        runner.gate.set()
        assert (await step)[0].token_id == expected[1]
        for _ in range(POLLS):  # the runner ends it once the session is idle
            with contextlib.suppress(SessionBusy):
                assert await session.free(1) >= 0
                break
            await asyncio.sleep(0.01)
        with pytest.raises(SequenceNotFound):
            await session.block_tables([1])


async def test_a_sequence_changed_directly_between_steps_is_read_back_before_a_write(
    engine: StepEngine, client: PoolClient, prompts: list[tuple[int, ...]],
) -> None:
    """A chunked prefill goes on with no append, so no daemon call of its own; between its
    steps (no hold then) the client freed and re-created the sequence directly, its old blocks
    free for any session. The runner reads the sequence back under its hold before computing,
    finds other blocks, and refuses the step (UnknownSequence) with no forward: it never writes
    from its stale table."""
    prompt = prompts[2]
    async with await client.open_session("chunker") as chunker:
        first = await engine.step(chunker.session_id, [new(1, prompt, GREEDY, 16)])
        assert first[0].num_computed == 16
        kept = engine.sessions.get(chunker.session_id)
        assert kept is not None
        stale = list(kept.sequences.seqs[1].block_table)
        for _ in range(POLLS):  # the runner ends its hold once the session is idle
            with contextlib.suppress(SessionBusy):
                await chunker.free(1)
                break
            await asyncio.sleep(0.01)
        recreated = await chunker.allocate(1, token_ids=prompt)
        assert recreated.block_ids != stale  # freed blocks queue last: others come first
        forwards = len(gated(engine).chunks)
        with pytest.raises(UnknownSequence, match="changed in the daemon behind the runner"):
            await engine.step(chunker.session_id, [SeqStep(1, (), False, 16, GREEDY)])
        assert len(gated(engine).chunks) == forwards


# ---------------------------------------------------------- 16: the session table


async def test_the_runner_forgets_sessions_that_ended_or_hold_nothing(
    engine: StepEngine, client: PoolClient, prompts: list[tuple[int, ...]],
) -> None:
    """Sessions whose client released everything, whose daemon session closed, or idle past
    the table's bound leave the runner's tables."""
    for n in range(3):  # released everything
        async with await client.open_session(f"done-{n}") as done:
            await decode(engine, done.session_id, [new(1, prompts[0], GREEDY)], 2)
    assert len(engine.sessions) == 0
    closed = await client.open_session("closed")
    await engine.step(closed.session_id, [new(1, prompts[0], GREEDY)])
    assert len(engine.sessions) == 1
    await closed.close()
    with pytest.raises(Exception, match="session"):
        await engine.step(closed.session_id, [decode_step(1, 3)])
    assert len(engine.sessions) == 0
    engine.sessions.max_idle = 2
    opened = [await client.open_session(f"idle-{n}") for n in range(4)]
    try:
        for idle in opened:
            await engine.step(idle.session_id, [new(1, prompts[0], GREEDY)])
        # An entry whose hold the runner must still end stays until its idle end (0.1 s).
        for _ in range(200):
            if len(engine.sessions) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(engine.sessions) == 2
    finally:
        for idle in opened:  # through the runner: it ends the holds of forgotten sessions too
            await engine.step(idle.session_id, [], release=[1])
            await idle.close()


async def test_the_client_link_never_resends_a_step_that_was_applied_but_not_computed() -> None:
    """StepNotComputed reaches the caller after one send: resending would append twice."""
    sent: list[object] = []

    class Failing:
        async def step(self, *args: object, follow: bool = False) -> object:
            sent.append(args)
            raise ClientStepNotComputed(grpc.StatusCode.ABORTED, "forward failed")

    link = RunnerLink(Failing(), None, "runner-1")  # type: ignore[arg-type]
    with pytest.raises(ClientStepNotComputed):
        await link.step([], [SeqStep(1, [5])], [])
    assert len(sent) == 1 and link.restarts == 0


def test_a_step_not_computed_reaches_the_client_as_its_own_class() -> None:
    """ABORTED with cause StepNotComputed on the wire, the client's StepNotComputed back."""
    code, cause, message = status_of(StepNotComputed("forward failed"))
    assert (code, cause, message) == (grpc.StatusCode.ABORTED, "StepNotComputed",
                                      "forward failed")
    assert isinstance(error_from_status(code, cause, message), ClientStepNotComputed)
