"""Decode ahead: the runner takes a client's next decode step before the client asks.

A step marks a sequence `decode_ahead`; once it samples a token that does not finish the
sequence, the runner appends that token in the daemon and computes it, and the client's next
step, naming the same token, is answered from that result. One Llama family model
(tests/support/families.py's) over a real pagedkvd, the engine in-process.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from pagedkv.client import (
    History,
    PoolClient,
    PoolExhausted,
    SamplingParams,
    SeqStep,
    SequenceNotFound,
    Session,
)
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.engine.steps import InvalidStep
from pagedkv.model_runner.kernels.attention_backend import get_backend

import families
from engine_driver import RecordingRunner, decode, new, recorder
from families import BLOCK_SIZE, GREEDY, NEW_TOKENS, VOCAB, expected_tokens

FAMILY = "llama"
# The fixtures daemon and prompts are conftest.py's (the families' pool).


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


async def start_engine(client: PoolClient, registry: CollectorRegistry) -> StepEngine:
    runner = RecordingRunner.attach(families.paged_model(FAMILY), await client.pool_info(),
                                    get_backend("torch"))
    engine = StepEngine(client, runner, metrics=RunnerMetrics(registry))
    await engine.start()
    return engine


@pytest.fixture
async def engine(runner_client: PoolClient,
                 registry: CollectorRegistry) -> AsyncIterator[StepEngine]:
    started = await start_engine(runner_client, registry)
    yield started
    await started.stop()


def ahead_tokens(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value("pagedkv_runner:decode_ahead_tokens_total",
                                      {"outcome": outcome})
    return value or 0.0


async def settled(engine: StepEngine) -> None:
    """Wait for the steps being decoded ahead (their daemon call and forward)."""
    await asyncio.gather(*engine._ahead_tasks)


def step(seq_id: int, token: int, params: SamplingParams = GREEDY,
         ahead: bool = True) -> SeqStep:
    return SeqStep(seq_id, (token,), False, 0, params, decode_ahead=ahead)


async def held(session: Session, seq_id: int) -> int:
    return (await session.block_tables([seq_id]))[0].num_tokens


async def test_every_step_after_the_first_is_answered_from_its_forward_ahead(
    session: Session, engine: StepEngine, registry: CollectorRegistry,
    prompts: list[tuple[int, ...]],
) -> None:
    """A ragged batch of three prompts decoded ahead gives transformers' greedy tokens; one
    forward per token (the client's steps after the first run none of their own), every one of
    them answered from the results computed ahead, and nothing is left once released."""
    first = [new(i, prompt, GREEDY) for i, prompt in enumerate(prompts)]
    decoded = await decode(engine, session.session_id, first, NEW_TOKENS, decode_ahead=True)
    for i, prompt in enumerate(prompts):
        assert decoded[i].tokens == expected_tokens(FAMILY, prompt)
        assert [r.num_tokens for r in decoded[i].results] == [
            len(prompt) + k for k in range(NEW_TOKENS)]
    assert len(recorder(engine).chunks) == NEW_TOKENS
    assert ahead_tokens(registry, "used") == ahead_tokens(registry, "computed") == \
        len(prompts) * (NEW_TOKENS - 1)
    assert ahead_tokens(registry, "failed") == 0
    stats = (await session.stats()).session
    assert stats is not None and (stats.num_sequences, stats.blocks_held) == (0, 0)


async def test_a_step_naming_another_token_is_refused_and_changes_nothing(
    session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    prompt = prompts[1]
    expected = expected_tokens(FAMILY, prompt)
    first = await engine.step(session.session_id, [
        dataclasses.replace(new(1, prompt, GREEDY), decode_ahead=True)])
    assert first[0].token_id == expected[0]
    assert first[0].num_tokens == len(prompt)
    with pytest.raises(InvalidStep, match="decode_ahead"):
        await engine.step(session.session_id, [step(1, (expected[0] + 1) % VOCAB)])
    with pytest.raises(InvalidStep, match="decode_ahead"):
        await engine.step(session.session_id, [SeqStep(1, (), False, 0, GREEDY)])
    assert await held(session, 1) == len(prompt) + 1  # the token appended ahead, no more
    second = await engine.step(session.session_id, [step(1, expected[0], ahead=False)])
    assert (second[0].token_id, second[0].num_tokens) == (
        expected[1], len(prompt) + 1)
    await settled(engine)
    assert await held(session, 1) == len(prompt) + 1  # not marked: nothing appended ahead


async def test_changed_sampling_samples_the_position_again_writing_nothing(
    session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """The step computed ahead sampled greedily; the client's step asks for logprobs too: the
    runner recomputes that position's logits with slot -1 and samples again."""
    prompt = prompts[0]
    expected = expected_tokens(FAMILY, prompt)
    await engine.step(session.session_id, [
        dataclasses.replace(new(1, prompt, GREEDY), decode_ahead=True)])
    await settled(engine)
    runner = recorder(engine)
    mark = len(runner.chunks)
    with_logprobs = dataclasses.replace(GREEDY, logprobs=3)
    outcome = await engine.step(session.session_id, [step(1, expected[0], with_logprobs)])
    assert [(c.start, list(c.slot_mapping)) for c in runner.chunks[mark]] == [(len(prompt), [-1])]
    result = outcome[0]
    assert result.token_id == expected[1] == result.top_token_ids[0]
    assert len(result.top_logprobs) == 3


async def test_finished_and_released_sequences_are_not_decoded_ahead(
    session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    prompt = prompts[0]
    expected = expected_tokens(FAMILY, prompt)
    one_token = dataclasses.replace(GREEDY, max_tokens=1)
    outcome = await engine.step(session.session_id, [
        dataclasses.replace(new(1, prompt, one_token), decode_ahead=True),
        dataclasses.replace(new(2, prompt, GREEDY), decode_ahead=True)])
    assert [r.finished for r in outcome] == [True, False]
    await settled(engine)
    assert [await held(session, 1), await held(session, 2)] == [len(prompt), len(prompt) + 1]
    # Released while its step ahead is computed: freed after that forward, nothing left.
    await engine.step(session.session_id, [], release=[1, 2])
    stats = (await session.stats()).session
    assert stats is not None and (stats.num_sequences, stats.blocks_held) == (0, 0)
    assert outcome[1].token_id == expected[0]


async def test_a_sequence_decoded_ahead_is_forked_only_after_its_next_step(
    session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    prompt = prompts[2]
    expected = expected_tokens(FAMILY, prompt)
    await engine.step(session.session_id, [
        dataclasses.replace(new(1, prompt, GREEDY), decode_ahead=True)])
    with pytest.raises(InvalidStep, match="decode_ahead"):
        await engine.step(session.session_id, [SeqStep(2, (), True, 0, GREEDY,
                                                          parent_seq_id=1)])
    with pytest.raises(SequenceNotFound):
        await session.block_tables([2])
    with pytest.raises(InvalidStep, match="decode_ahead"):  # not in the step naming it either
        await engine.step(session.session_id, [
            step(1, expected[0]), SeqStep(2, (), True, 0, GREEDY, parent_seq_id=1)])
    second = await engine.step(session.session_id, [step(1, expected[0], ahead=False)])
    fork = await engine.step(session.session_id, [
        SeqStep(2, (), True, 0, GREEDY, parent_seq_id=1)])
    assert second[0].token_id == fork[0].token_id == expected[1]
    assert await held(session, 2) == len(prompt) + 1


async def test_an_ahead_step_that_does_not_fit_is_left_to_the_clients_step(
    client: PoolClient, session: Session, engine: StepEngine, registry: CollectorRegistry,
) -> None:
    """A prompt one token short of a block, and another session holding every free block: the
    client's step fills the block and samples; appending that token ahead needs a new block and
    fails, changing nothing. The client's own step then meets the full pool itself; once
    blocks are free it gets its token."""
    prompt = tuple(range(1, BLOCK_SIZE))
    expected = expected_tokens(FAMILY, prompt)
    await engine.step(session.session_id, [new(1, prompt, GREEDY)])
    async with await client.open_session("hog") as hog:
        await hog.allocate(1, (await hog.stats()).free_blocks * BLOCK_SIZE)
        second = await engine.step(session.session_id, [step(1, expected[0])])
        assert second[0].token_id == expected[1]
        await settled(engine)
        assert ahead_tokens(registry, "failed") == 1
        assert await held(session, 1) == BLOCK_SIZE
        with pytest.raises(PoolExhausted):
            await engine.step(session.session_id, [step(1, expected[1])])
        assert await held(session, 1) == BLOCK_SIZE
    third = await engine.step(session.session_id, [step(1, expected[1], ahead=False)])
    assert (third[0].token_id, third[0].num_tokens) == (
        expected[2], BLOCK_SIZE + 1)


async def test_a_restarted_runner_takes_the_token_appended_ahead_from_the_client(
    runner_client: PoolClient, session: Session, engine: StepEngine,
    registry: CollectorRegistry, prompts: list[tuple[int, ...]],
) -> None:
    """The runner appended a token ahead, then restarted (a new engine that knows nothing): the
    client resends the sequence's history without that token and the token itself; the daemon
    holds one token more, which the new runner takes as that token and computes."""
    prompt = prompts[1]
    expected = expected_tokens(FAMILY, prompt)
    first = await engine.step(session.session_id, [
        dataclasses.replace(new(1, prompt, GREEDY), decode_ahead=True)])
    await settled(engine)
    assert await held(session, 1) == len(prompt) + 1
    restarted = await start_engine(runner_client, CollectorRegistry())
    try:
        history = History(prompt, len(prompt), len(prompt))
        resent = dataclasses.replace(step(1, first[0].token_id), history=history)
        decoded = await decode(restarted, session.session_id, [resent], NEW_TOKENS - 1,
                               decode_ahead=True)
    finally:
        await restarted.stop()
    assert [first[0].token_id, *decoded[1].tokens] == expected
