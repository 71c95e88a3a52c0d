"""`Engine.stream(delta=True)` (vLLM's RequestOutputKind.DELTA): each output carries only the
tokens and logprobs new since the previous one, and they add up to what `generate` and the
cumulative stream return; a real `pagedkvd` and `pagedkv runner` (conftest.py's roomy pool, and
a small one where requests are preempted and recomputed mid-stream).
"""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.client.engine.scheduler import SchedulerConfig

from client_engine_model import PROMPTS
from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd
from served_model import hf_greedy


@pytest.fixture(scope="module")
def small(config_path: Path) -> Iterator[tuple[Pagedkvd, Pagedkvd]]:
    """12 blocks of 16 tokens: eight requests of 20 tokens cannot all run at once."""
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "12") as daemon, \
            pagedkv_runner(daemon, "--random-init", str(config_path)) as runner:
        yield daemon, runner


def joined(outputs: list[RequestOutput]) -> dict[int, CompletionOutput]:
    """Each output index's deltas joined into one completion (its last finish reason and
    cumulative logprob)."""
    whole: dict[int, CompletionOutput] = {}
    for output in outputs:
        for delta in output.outputs:
            before = whole.get(delta.index)
            if before is None:
                whole[delta.index] = delta
                continue
            whole[delta.index] = CompletionOutput(
                delta.index, before.token_ids + delta.token_ids, delta.cumulative_logprob,
                None if delta.logprobs is None or before.logprobs is None
                else before.logprobs + delta.logprobs,
                None if delta.top_logprobs is None or before.top_logprobs is None
                else before.top_logprobs + delta.top_logprobs, delta.finish_reason)
    return whole


async def collected(engine: Engine, prompt: list[int],
                    params: SamplingParams) -> list[RequestOutput]:
    return [output async for output in engine.stream(prompt, params, delta=True)]


async def test_deltas_add_up_to_the_whole_output_of_parallel_samples(
        roomy: tuple[Pagedkvd, Pagedkvd]) -> None:
    """n = 3 seeded samples with top-2 logprobs: every delta output carries tokens not shown
    before (one per sample per step), and joined per sample they are generate's tokens,
    logprobs and top logprobs; the request's counts are totals in every output."""
    daemon, runner = roomy
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=9, logprobs=2)
    async with await Engine.connect(daemon.unix_target, runner.unix_target) as engine:
        deltas = await collected(engine, PROMPTS[3], params)
        whole = await engine.generate(PROMPTS[3], params)
    assert deltas[-1].finished and not any(output.finished for output in deltas[:-1])
    assert all(len(delta.token_ids) <= 1 for output in deltas for delta in output.outputs)
    assert [output.num_generated_tokens for output in deltas] == sorted(
        output.num_generated_tokens for output in deltas)
    assert deltas[-1].num_generated_tokens == whole.num_generated_tokens == 27
    joined_outputs = joined(deltas)
    assert [joined_outputs[i] for i in sorted(joined_outputs)] == whole.outputs


async def test_deltas_survive_preemption_with_the_greedy_tokens(
        small: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    """Eight delta streams on a pool too small for them all: requests are preempted and
    recomputed, and each stream's deltas still join into transformers' greedy tokens (a
    recomputed token is never shown twice)."""
    daemon, runner = small
    params = SamplingParams(temperature=0, max_tokens=20)
    async with await Engine.connect(daemon.unix_target, runner.unix_target,
                                    config=SchedulerConfig(watermark=0.0)) as engine:
        streams = await asyncio.gather(*(collected(engine, p, params) for p in PROMPTS))
        assert engine.scheduler.num_preemptions > 0
    for prompt, deltas in zip(PROMPTS, streams, strict=True):
        whole = joined(deltas)[0]
        assert list(whole.token_ids) == hf_greedy(reference, prompt, 20)
        assert whole.finish_reason == "length" and whole.logprobs is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, beam_width=2, max_tokens=4),
    SamplingParams(temperature=1.0, n=1, best_of=3, max_tokens=4),
], ids=["beam search", "best_of > n"])
async def test_delta_outputs_of_a_request_chosen_at_the_end_are_refused(
        roomy: tuple[Pagedkvd, Pagedkvd], params: SamplingParams) -> None:
    """Beam search and best_of > n pick their outputs at the end: no deltas to stream. The
    request is refused before it is queued."""
    daemon, runner = roomy
    async with await Engine.connect(daemon.unix_target, runner.unix_target) as engine:
        with pytest.raises(ValueError, match="delta outputs need plain or parallel sampling"):
            await collected(engine, PROMPTS[0], params)
        assert not engine.scheduler.has_work and not list(engine.waiters)
