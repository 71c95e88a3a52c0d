"""The engine and the model's longest context (RunnerInfo.max_model_len), with a scripted
runner: a prompt longer than the model is refused at once, beam search must fit its max_tokens,
and a sampled request ends with finish reason "length" when the runner reports the context full
(its `finished`), before its max_tokens."""

from collections.abc import Sequence

import pytest

from pagedkv.client import SamplingParams, SeqOutput, SeqStep, StepOutputs

from scripted_engine import ScriptedRunner, engine

LIMIT = 24


class ContextRunner(ScriptedRunner):
    """Reports a sampled token finished once the sequence holds LIMIT tokens, as a runner does
    for a model of LIMIT positions."""

    async def step(self, session: object, seqs: Sequence[SeqStep],
                   release: Sequence[int] = (), *, follow: bool = False) -> StepOutputs:
        answer = await super().step(session, seqs, release, follow=follow)
        return StepOutputs([SeqOutput(o.seq_id, o.num_tokens, o.num_computed, 0, o.sampled,
                                      o.token_id, o.logprob, (), (), o.num_tokens >= LIMIT)
                            for o in answer], answer.free_blocks)


async def test_a_request_stops_with_length_when_the_context_is_full() -> None:
    generating = engine(ContextRunner(full=set()), LIMIT)
    output = await generating.generate([1] * 20, SamplingParams(temperature=0, max_tokens=100))
    await generating.close()
    # Holding 20, 21, 22, 23, 24 tokens it samples 5 tokens; the last has no position left.
    assert len(output.outputs[0].token_ids) == LIMIT - 20 + 1
    assert output.outputs[0].finish_reason == "length"


async def test_prompts_longer_than_the_model_and_beams_past_it_are_refused() -> None:
    generating = engine(ContextRunner(full=set()), LIMIT)
    with pytest.raises(ValueError, match="at most 24 positions"):
        await generating.generate([1] * (LIMIT + 1), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceeds the model's 24 positions"):
        await generating.generate([1] * 20, SamplingParams(temperature=0, beam_width=2,
                                                           max_tokens=8))
    await generating.close()


async def test_a_max_model_len_below_the_models_bounds_max_tokens() -> None:
    """SchedulerConfig.max_model_len (here 16, the engine's limit) below the model's 24: the
    request ends with "length" at 16 positions as it would at the model's, its min_tokens
    lowered with it, and a longer prompt is refused."""
    generating = engine(ContextRunner(full=set()), 16)
    output = await generating.generate([1] * 10, SamplingParams(temperature=0, max_tokens=100,
                                                                min_tokens=50))
    with pytest.raises(ValueError, match="at most 16 positions"):
        await generating.generate([1] * 17, SamplingParams(max_tokens=1))
    await generating.close()
    assert len(output.outputs[0].token_ids) == 16 - 10 + 1
    assert output.outputs[0].finish_reason == "length"
