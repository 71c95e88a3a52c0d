"""The runner keeps each sequence's sampling from its first step (issue 18): later steps leave
it out, and a runner that keeps none (it restarted) refuses the step, changing nothing, until
the client resends the sequence's history with its sampling.

One Llama family model (tests/support/families.py's) over a real pagedkvd, the engine
in-process; a second engine on the same pool is the restarted runner.
"""

import dataclasses
from collections.abc import AsyncIterator

import pytest

from pagedkv.client import History, PoolClient, SamplingParams, SeqStep, Session
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.engine.steps import InvalidStep, UnknownSequence
from pagedkv.model_runner.kernels.attention_backend import get_backend

import families
from engine_driver import RecordingRunner, new
from families import expected_tokens

FAMILY = "llama"
# The fixtures daemon and prompts are conftest.py's (the families' pool).
# Sent once: greedy, two top logprobs, three tokens at most.
KEPT = SamplingParams(temperature=0.0, logprobs=2, max_tokens=3)


async def start_engine(client: PoolClient) -> StepEngine:
    runner = RecordingRunner.attach(families.paged_model(FAMILY), await client.pool_info(),
                                    get_backend("torch"))
    engine = StepEngine(client, runner)
    await engine.start()
    return engine


@pytest.fixture
async def engine(runner_client: PoolClient) -> AsyncIterator[StepEngine]:
    started = await start_engine(runner_client)
    yield started
    await started.stop()


def decode(seq_id: int, token: int, params: SamplingParams | None = None) -> SeqStep:
    return SeqStep(seq_id, (token,), False, 0, params)


async def held(session: Session, seq_id: int) -> int:
    return (await session.block_tables([seq_id]))[0].num_tokens


async def test_later_steps_use_the_sampling_of_the_first(
        session: Session, engine: StepEngine, prompts: list[tuple[int, ...]]) -> None:
    """Only the first step sends KEPT: every answer has its two top logprobs, and the third
    token finishes the sequence (its max_tokens)."""
    prompt = prompts[0]
    out = (await engine.step(session.session_id, [new(1, prompt, KEPT)]))[0]
    answers = [out]
    for _ in range(2):
        out = (await engine.step(session.session_id, [decode(1, out.token_id)]))[0]
        answers.append(out)
    assert [a.token_id for a in answers] == expected_tokens(FAMILY, prompt)[:3]
    assert [len(a.top_token_ids) for a in answers] == [2, 2, 2]
    assert [a.finished for a in answers] == [False, False, True]
    assert engine.sessions.get(session.session_id) is not None
    await engine.step(session.session_id, [], release=[1])
    # the session's entry, and the sequence's sampling with it, is forgotten once released
    assert engine.sessions.get(session.session_id) is None


async def test_a_new_sequence_without_sampling_is_refused(
        session: Session, engine: StepEngine, prompts: list[tuple[int, ...]]) -> None:
    with pytest.raises(InvalidStep, match="new sequence 1 has no sampling"):
        await engine.step(session.session_id, [SeqStep(1, prompts[0], True, 0, None)])
    assert (await session.stats()).session.num_sequences == 0  # type: ignore[union-attr]


async def test_a_restarted_runner_refuses_the_step_until_the_sampling_is_resent(
        runner_client: PoolClient, session: Session, engine: StepEngine,
        prompts: list[tuple[int, ...]]) -> None:
    """The new runner keeps no sampling: the step, with or without the history, is refused
    naming the sequence, and the daemon holds what it held. Resent with history and sampling,
    it goes on with the resent sampling (one top logprob now)."""
    prompt = prompts[1]
    first = (await engine.step(session.session_id, [new(1, prompt, KEPT)]))[0]
    restarted = await start_engine(runner_client)
    try:
        history = History(prompt, len(prompt), len(prompt))
        for step in (decode(1, first.token_id),
                     dataclasses.replace(decode(1, first.token_id), history=history)):
            with pytest.raises(UnknownSequence, match=r"sequence 1 .*history and sampling"):
                await restarted.step(session.session_id, [step])
            assert await held(session, 1) == len(prompt)
        resent = dataclasses.replace(decode(1, first.token_id, dataclasses.replace(
            KEPT, logprobs=1)), history=history)
        second = (await restarted.step(session.session_id, [resent]))[0]
        third = (await restarted.step(session.session_id,
                                      [decode(1, second.token_id)]))[0]
    finally:
        await restarted.stop()
    tokens = [first.token_id, second.token_id, third.token_id]
    assert tokens == expected_tokens(FAMILY, prompt)[:3]
    assert [len(second.top_token_ids), len(third.top_token_ids)] == [1, 1]
    assert third.finished
