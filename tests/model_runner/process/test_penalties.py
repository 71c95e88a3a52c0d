"""Presence and frequency penalties end to end: an `Engine` on a real `pagedkvd` and a real
`pagedkv runner` process, against transformers' logits penalized step by step (OpenAI's and
vLLM's rule: logit -= frequency * count + presence * (count > 0), over the generated tokens).

The engine decodes ahead, so the runner counts tokens it appended itself as well as the
client's. A raw client (the generated stub) sending a penalty out of [-2, 2] is refused with
INVALID_ARGUMENT naming the field, and nothing is allocated.
"""

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
import torch
from transformers import PreTrainedModel

from pagedkv.client import Engine, PoolClient, SamplingParams
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

from pagedkvd_process import Pagedkvd
from served_model import hf_greedy

# The module fixtures config_path, daemon, metrics_port, reference and runner are conftest.py's.

NEW_TOKENS = 12
# One token six times: plain greedy decoding of the test model then mostly repeats one token
# (53 twelve times, 32 nine times, 13 nine times), which the penalties must change.
PROMPTS = [[31] * 6, [3] * 6, [45] * 6]
# Values a float32 holds exactly, so the runner applies the penalties the reference does.
FREQUENCY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, frequency_penalty=2.0)
PRESENCE = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, presence_penalty=1.5,
                          frequency_penalty=-0.5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def penalized_greedy(reference: PreTrainedModel, prompt: list[int],
                     params: SamplingParams) -> list[int]:
    """The argmax of transformers' last logits, penalized by the tokens generated so far."""
    out: list[int] = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + out])).logits[0, -1].float()
        for token, count in Counter(out).items():
            logits[token] -= params.frequency_penalty * count + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


async def test_penalized_greedy_tokens_match_transformers_step_by_step(
        daemon: Pagedkvd, runner: Pagedkvd, reference: PreTrainedModel) -> None:
    """Three requests in one batch: a frequency penalty, presence with a negative frequency
    penalty, and none (its tokens are transformers' plain greedy ones)."""
    async with await Engine.connect(daemon.unix_target, runner.unix_target) as engine:
        outputs = await asyncio.gather(engine.generate(PROMPTS[0], FREQUENCY),
                                       engine.generate(PROMPTS[1], PRESENCE),
                                       engine.generate(PROMPTS[2], GREEDY))
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    assert tokens[0] == penalized_greedy(reference, PROMPTS[0], FREQUENCY)
    assert tokens[1] == penalized_greedy(reference, PROMPTS[1], PRESENCE)
    assert tokens[2] == hf_greedy(reference, PROMPTS[2], NEW_TOKENS)
    # The penalties changed what greedy decoding gives: no token repeats where plain greedy
    # repeated one.
    plain = [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in PROMPTS[:2]]
    assert len(set(plain[0])) == 1 and len(set(tokens[0])) == NEW_TOKENS
    assert tokens[1] != plain[1]


@pytest.fixture
async def stub(runner: Pagedkvd) -> AsyncIterator[runner_pb2_grpc.RunnerStub]:
    """The generated stub: a client that skips SamplingParams' checks."""
    async with grpc.aio.insecure_channel(runner.unix_target,
                                         options=MESSAGE_SIZE_OPTIONS) as channel:
        yield runner_pb2_grpc.RunnerStub(channel)


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
async def test_a_raw_client_sending_a_penalty_of_3_is_refused_naming_it(
        daemon: Pagedkvd, stub: runner_pb2_grpc.RunnerStub, name: str) -> None:
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await pool.open_session("raw penalty") as session:
        request = rpb.RunnerStepRequest(session_id=session.session_id, seqs=[
            rpb.SequenceStep(seq_id=1, new_sequence=True, token_ids=PROMPTS[0],
                             sampling=rpb.SamplingParams(temperature=0.0)),
            rpb.SequenceStep(seq_id=2, new_sequence=True, token_ids=PROMPTS[1],
                             sampling=rpb.SamplingParams(**{name: 3.0}))])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Step(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sequence 2: {name} must be in [-2, 2] (0 = off), got 3.0" in str(
            refused.value.details())
        stats = (await session.stats()).session
        assert stats is not None and stats.num_sequences == 0  # nothing allocated
