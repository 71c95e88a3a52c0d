"""The forward thread decodes a followed session on its own (decode_run.py, issue 35).

After a step marked decode_ahead, `StepEngine.follow` claims the step computed ahead and lets the
forward thread take the implied steps back to back, inside the sequences' reservations: the
tokens are transformers' greedy ones, one forward per token, no daemon call between two
reservations; a stop asked leaves the implied step to `step`, which goes on with the same
tokens. The trust rules are checked on a run of hand-made states: the thread never appends a
token whose slot is not reserved past the committed tokens, nor under a hold that ended or may
lapse, nor while another step waits for the session.
"""

import asyncio
import dataclasses
import io
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import CollectorRegistry

from pagedkv.client import PoolClient, SeqStep, Session, StepOutputs
from pagedkv.model_runner.engine.decode_run import DecodeRun
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.sequences import SeqState
from pagedkv.model_runner.engine.sessions import SessionEntry
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.engine.steps import implied_step
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.process.log_setup import configure

import families
from engine_driver import RecordingRunner, new, recorder
from families import GREEDY, NEW_TOKENS, expected_tokens
from log_capture import events

FAMILY = "llama"
# The fixtures daemon and prompts are conftest.py's (the families' pool).


@pytest.fixture
async def engine(runner_client: PoolClient) -> AsyncIterator[StepEngine]:
    runner = RecordingRunner.attach(families.paged_model(FAMILY),
                                    await runner_client.pool_info(), get_backend("torch"))
    started = StepEngine(runner_client, runner)
    await started.start()
    yield started
    await started.stop()


async def first_step(engine: StepEngine, session: Session,
                     prompts: list[tuple[int, ...]]) -> tuple[list[SeqStep], StepOutputs]:
    """Every prompt's prefill, decode_ahead; the step computed ahead done."""
    first = [dataclasses.replace(new(i, p, GREEDY), decode_ahead=True)
             for i, p in enumerate(prompts)]
    outputs = await engine.step(session.session_id, first)
    await asyncio.gather(*engine._ahead_tasks)
    return first, outputs


async def test_the_forward_thread_decodes_to_the_end_with_transformers_tokens(
        session: Session, engine: StepEngine, prompts: list[tuple[int, ...]]) -> None:
    first, outputs = await first_step(engine, session, prompts)
    pushes: list[StepOutputs] = []
    until: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    forwards = len(recorder(engine).chunks)
    left = await engine.follow(session.session_id, implied_step(first, outputs, ()),
                               pushes.append, until)
    assert left == []  # every sequence finished at max_tokens
    tokens = {i: [outputs[i].token_id] for i in range(len(prompts))}
    for push in pushes:
        for out in push:
            tokens[out.seq_id].append(out.token_id)
    assert tokens == {i: expected_tokens(FAMILY, p) for i, p in enumerate(prompts)}
    assert all(out.finished for out in pushes[-1])
    # The first push was the step computed ahead; each later one, one forward.
    assert len(recorder(engine).chunks) - forwards == len(pushes) - 1 == NEW_TOKENS - 2
    await engine.step(session.session_id, [], release=list(range(len(prompts))))
    stats = (await session.stats()).session
    assert stats is not None and (stats.num_sequences, stats.blocks_held) == (0, 0)


async def test_a_runs_steps_are_logged_and_counted_as_client_steps(
        session: Session, runner_client: PoolClient, prompts: list[tuple[int, ...]],
        restore_root_logger: None) -> None:
    """Each step of a run counts as a step (its duration, forward taken to push) whose tokens
    were computed ahead and used, and a sequence it finishes gets its "sequence finished" line,
    as a client step's would."""
    registry, stream = CollectorRegistry(), io.StringIO()
    configure("debug", "json", stream)
    runner = RecordingRunner.attach(families.paged_model(FAMILY),
                                    await runner_client.pool_info(), get_backend("torch"))
    engine = StepEngine(runner_client, runner, metrics=RunnerMetrics(registry))
    await engine.start()
    try:
        first, outputs = await first_step(engine, session, prompts)
        until: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pushes: list[StepOutputs] = []
        await engine.follow(session.session_id, implied_step(first, outputs, ()),
                            pushes.append, until)
    finally:
        await engine.stop()
    run_steps = len(pushes) - 1  # the first push was the step computed ahead, claimed
    steps = registry.get_sample_value("pagedkv_runner:step_duration_seconds_count")
    assert steps == 1 + run_steps
    ahead = {outcome: registry.get_sample_value("pagedkv_runner:decode_ahead_tokens_total",
                                                {"outcome": outcome})
             for outcome in ("computed", "used")}
    pushed = sum(len(push) for push in pushes)
    assert ahead == {"computed": pushed, "used": pushed}
    finished = events(stream, "sequence finished")
    assert sorted(line["seq_id"] for line in finished) == list(range(len(prompts)))


async def test_a_spent_reservation_is_renewed_by_one_daemon_step_and_the_run_goes_on(
        session: Session, engine: StepEngine, prompts: list[tuple[int, ...]]) -> None:
    """100 tokens cross several reservations (two blocks' worth past a Step each): every push
    still comes from a run, one forward each, with transformers' tokens; the renewing daemon
    Steps appended (certified) the tokens decoded into the spent reservations."""
    n = 100
    params = dataclasses.replace(GREEDY, max_tokens=n, logprobs=None)
    first = [SeqStep(i, p, True, params=params, decode_ahead=True) for i, p in enumerate(prompts)]
    outputs = await engine.step(session.session_id, first)
    await asyncio.gather(*engine._ahead_tasks)
    pushes: list[StepOutputs] = []
    forwards = len(recorder(engine).chunks)
    left = await engine.follow(session.session_id, implied_step(first, outputs, ()),
                               pushes.append, asyncio.get_running_loop().create_future())
    assert left == [] and len(recorder(engine).chunks) - forwards == len(pushes) - 1 == n - 2
    tokens = {i: [outputs[i].token_id] for i in range(len(prompts))}
    for push in pushes:
        for out in push:
            tokens[out.seq_id].append(out.token_id)
    assert tokens == {i: expected_tokens(FAMILY, p, n) for i, p in enumerate(prompts)}
    # The Step after the prefill appended the first token; only a renewal appended more.
    tables = await session.block_tables(list(range(len(prompts))))
    assert all(table.num_tokens > len(p) + 1 for table, p in zip(tables, prompts, strict=True))
    await engine.step(session.session_id, [], release=list(range(len(prompts))))
    stats = (await session.stats()).session
    assert stats is not None and (stats.num_sequences, stats.blocks_held) == (0, 0)


async def test_a_stop_leaves_the_implied_step_and_the_engine_goes_on_identically(
        session: Session, engine: StepEngine, prompts: list[tuple[int, ...]]) -> None:
    first, outputs = await first_step(engine, session, prompts)
    loop = asyncio.get_running_loop()
    until: asyncio.Future[None] = loop.create_future()
    pushes: list[StepOutputs] = []

    async def next_message() -> None:  # the client's next message arrives
        until.set_result(None)
        await asyncio.sleep(0)  # the run's stop callback runs first

    def deliver(push: StepOutputs) -> None:  # on the forward thread (the first: the loop)
        pushes.append(push)
        if len(pushes) == 2:  # the thread goes on once the run is told (whatever the load)
            asyncio.run_coroutine_threadsafe(next_message(), loop).result()

    left = await engine.follow(session.session_id, implied_step(first, outputs, ()),
                               deliver, until)
    assert left and len(pushes) >= 2
    assert [r.token_ids[0] for r in left] == [out.token_id for out in pushes[-1]]
    tokens = {i: [outputs[i].token_id, *(push[i].token_id for push in pushes)]
              for i in range(len(prompts))}
    # The implied step left goes through `step` (what the stream does, or the client's own).
    while left:
        answer = await engine.step(session.session_id, left)
        for out in answer:
            tokens[out.seq_id].append(out.token_id)
        left = implied_step(left, answer, ())
    await asyncio.gather(*engine._ahead_tasks)
    assert tokens == {i: expected_tokens(FAMILY, p) for i, p in enumerate(prompts)}
    await engine.step(session.session_id, [], release=list(range(len(prompts))))


async def test_a_run_followed_while_another_runs_joins_its_next_forward(
        client: PoolClient, session: Session, engine: StepEngine,
        prompts: list[tuple[int, ...]]) -> None:
    """Session B is followed while session A's run computes on the forward thread (A's second
    push waits there until B's run is handed over): every later forward of A's run carries B's
    sequences too (one forward for every followed sequence), and both get transformers'
    tokens. Before the fix B waited for A's run to end: no forward carried both."""
    n = len(prompts)
    async with await client.open_session("other") as other:
        firsts = [await first_step(engine, s, prompts) for s in (session, other)]
        b_followed = threading.Event()
        handed = engine.forwards.follow

        def follow(run: DecodeRun) -> None:
            handed(run)
            b_followed.set()  # the second run handed over (A's is the first)

        pushes: tuple[list[StepOutputs], list[StepOutputs]] = ([], [])

        def deliver_a(push: StepOutputs) -> None:  # on the forward thread (the first: the loop)
            pushes[0].append(push)
            if len(pushes[0]) == 2:
                assert b_followed.wait(10), "B's run was not handed over"

        forwards = len(recorder(engine).chunks)
        until: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        a = asyncio.create_task(engine.follow(session.session_id,
                                              implied_step(*firsts[0], ()), deliver_a, until))
        while len(pushes[0]) < 2:  # then A's thread waits in deliver_a
            await asyncio.sleep(0.001)
        engine.forwards.follow = follow  # type: ignore[method-assign]
        left_b = await engine.follow(other.session_id, implied_step(*firsts[1], ()),
                                     pushes[1].append, until)
        assert await a == [] and left_b == []
        sizes = [len(chunks) for chunks in recorder(engine).chunks[forwards:]]
        # A's first run forward alone, then A's other NEW_TOKENS - 3 with B's, then B's rest.
        assert sizes.count(2 * n) == NEW_TOKENS - 3 and sum(sizes) == 2 * n * (NEW_TOKENS - 2)
        for (_, outputs), got in zip(firsts, pushes, strict=True):
            tokens = {i: [outputs[i].token_id, *(push[i].token_id for push in got)]
                      for i in range(n)}
            assert tokens == {i: expected_tokens(FAMILY, p) for i, p in enumerate(prompts)}
        for s in (session, other):
            await engine.step(s.session_id, [], release=list(range(n)))


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    made = asyncio.new_event_loop()
    yield made
    made.close()


def hand_made_run(loop: asyncio.AbstractEventLoop, state: SeqState, held_at: float) -> DecodeRun:
    """A run of one sequence (block size 4, hold 5 s) whose next token is 7."""
    entry = SessionEntry(users=1)
    entry.sequences.held_at = held_at
    return DecodeRun(entry, [1], [state], [7], lambda _: None, lambda: 0, 4, 64, 5.0, loop)


def state_at(tokens: int, *, private_end: int, committed: int) -> SeqState:
    """A sequence of `tokens` tokens, all computed, in blocks 0, 1, 2 (block size 4)."""
    return SeqState(list(range(tokens)), 2, tokens, [0, 1, 2], committed=committed,
                    private_end=private_end)


@pytest.mark.parametrize("why", ["reservation spent", "committed", "hold ended", "hold lapsing",
                                 "another step waits", "stop asked"])
def test_the_thread_never_appends_where_the_loop_must_act(
        loop: asyncio.AbstractEventLoop, why: str) -> None:
    state = state_at(8, private_end=8 if why == "reservation spent" else 12,
                     committed=9 if why == "committed" else 4)
    held_at = {"hold ended": -math.inf, "hold lapsing": time.monotonic() - 4.99}.get(
        why, time.monotonic())
    run = hand_made_run(loop, state, held_at)
    run.entry.users += why == "another step waits"
    run.stopping = why == "stop asked"
    assert run.decode_followed(0.01) is None
    assert run.over and run.ended.done() and state.tokens == list(range(8))  # nothing appended


def test_inside_its_reservation_the_thread_writes_the_next_reserved_slot(
        loop: asyncio.AbstractEventLoop) -> None:
    state = state_at(8, private_end=12, committed=4)
    run = hand_made_run(loop, state, time.monotonic())
    (chunk,) = run.decode_followed(0.01) or ()
    assert (list(chunk.token_ids), chunk.start, list(chunk.slot_mapping)) == ([7], 8, [8])
    assert state.tokens[-1] == 7 and not run.over
