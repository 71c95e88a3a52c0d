"""The model's longest context, enforced by the runner before anything changes.

A sequence may hold at most the model's `max_position_embeddings` tokens (`ModelRunner
.max_model_len`): GPT-2 and OPT have no embedding for a later position, and a RoPE model was
never trained past it. A step that would take a sequence beyond it is INVALID_ARGUMENT and
changes nothing, and fails alone: a concurrent step of another client is computed as if it came
alone. One daemon and the families' models (tests/support/families.py), in-process engines.
"""

import asyncio

import pytest

from pagedkv.client import PoolClient, SeqStep, SequenceNotFound, Session
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.engine.steps import InvalidStep

from engine_driver import new
from families import GREEDY, expected_tokens

# The fixtures daemon, prompts and (per family) engine are conftest.py's.


@pytest.mark.parametrize("family", ["gpt2", "llama"])
async def test_a_prompt_longer_than_the_model_is_refused_alone(
    family: str, client: PoolClient, session: Session, engine: StepEngine,
    prompts: list[tuple[int, ...]],
) -> None:
    limit = engine.runner.max_model_len
    assert limit == 256
    async with await client.open_session("other") as other:
        prompt = tuple(i % 100 + 1 for i in range(limit + 1))
        too_long = asyncio.create_task(engine.step(session.session_id, [new(1, prompt, GREEDY)]))
        fine = asyncio.create_task(engine.step(other.session_id, [new(1, prompts[0], GREEDY)]))
        with pytest.raises(InvalidStep, match=f"at most {limit} positions"):
            await too_long
        assert (await fine)[0].token_id == expected_tokens(family, prompts[0])[0]
    with pytest.raises(SequenceNotFound):
        await session.block_tables([1])


@pytest.mark.parametrize("family", ["gpt2"])
async def test_a_decode_past_the_last_position_is_refused_and_changes_nothing(
    family: str, session: Session, engine: StepEngine,
) -> None:
    """A prompt filling the model's context samples one token; appending it would need a
    position the model does not have."""
    limit = engine.runner.max_model_len
    prompt = tuple(i % 100 + 1 for i in range(limit))
    first = await engine.step(session.session_id, [new(1, prompt, GREEDY)])
    assert first[0].sampled and first[0].finished  # no position left for it
    with pytest.raises(InvalidStep, match=f"at most {limit} positions"):
        await engine.step(session.session_id, [
            SeqStep(1, (first[0].token_id,), False, 0, GREEDY)])
    assert (await session.block_tables([1]))[0].num_tokens == limit
