"""A runner step's answer is bounded before the step changes anything (issue 17, finding 9).

On main, a step of 27 sequences asking for every logprob of a 32,000-token vocabulary got an
answer of about 6 MB: the client's gRPC refused it while the daemon kept every sequence. Now a
sequence may ask for at most `max_logprobs` (INVALID_ARGUMENT), and a step whose answer could
pass `max_answer_bytes` is RESOURCE_EXHAUSTED (`AnswerTooLarge`), both before any daemon call;
the default limit fits gRPC's default receive limit, so a stock channel gets every answer.

A real daemon and a real `pagedkv runner` process (its model: a tiny Llama with that vocabulary,
random weights) with `--max-logprobs 8000`; the default cap (vLLM's 20) is checked on the limits.
"""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from transformers import LlamaConfig

from pagedkv.client import (
    AnswerTooLarge,
    InvalidArgument,
    PoolClient,
    RunnerClient,
    SamplingParams,
    SeqStep,
    Session,
    StepOutputs,
)
from pagedkv.model_runner.engine.answer_limits import (
    ANSWER_FIXED,
    DEFAULT_MAX_LOGPROBS,
    STREAM_ENVELOPE,
    AnswerLimits,
    output_bytes,
)
from pagedkv.model_runner.engine.steps import InvalidStep
from pagedkv.model_runner.process.cli import parser
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.proto.limits import GRPC_DEFAULT_RECEIVE_BYTES, MAX_MESSAGE_BYTES

from pagedkvd_process import Pagedkvd, pagedkv_runner
from served_model import write_config

VOCAB = 32_000
MAX_LOGPROBS = 8_000
# The most sequences of a step asking MAX_LOGPROBS whose answer fits the default limit.
MOST_SEQS = (AnswerLimits().max_answer_bytes - ANSWER_FIXED) // output_bytes(MAX_LOGPROBS)
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                     pad_token_id=None)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(CONFIG, tmp_path_factory)


@pytest.fixture(scope="module")
def runner(daemon: Pagedkvd, config_path: Path) -> Iterator[Pagedkvd]:
    with pagedkv_runner(daemon, "--random-init", str(config_path),
                        "--max-logprobs", str(MAX_LOGPROBS)) as running:
        yield running


@pytest.fixture
async def compute(runner: Pagedkvd) -> AsyncIterator[RunnerClient]:
    async with await RunnerClient.connect(runner.unix_target) as connected:
        yield connected


def prompts(count: int, logprobs: int, first: int = 0) -> list[SeqStep]:
    """`count` new sequences (ids from `first`) of 4 tokens each, asking `logprobs` top
    logprobs."""
    params = SamplingParams(temperature=0.0, logprobs=logprobs)
    return [SeqStep(i, [(i * 4 + j) % VOCAB for j in range(4)], new_sequence=True,
                    params=params) for i in range(first, first + count)]


async def held(session: Session) -> int:
    stats = await session.stats()
    assert stats.session is not None
    return stats.session.num_sequences


def widest(count: int, top: int) -> rpb.RunnerStepResponse:
    """A packed answer of `count` sequences with `top` logprobs each, its ids at their widest
    (10-byte varints: the largest seq id, -1 tokens)."""
    return rpb.RunnerStepResponse(
        free_blocks=2**32 - 1, seq_ids=[2**64 - 1] * count, num_tokens=[0] * count,
        num_computed_tokens=[0] * count, num_cached_tokens=[0] * count,
        outcomes=[rpb.OUTCOME_NOT_SAMPLED] * count, token_ids=[-1] * count,
        logprobs=[0.0] * count, top_counts=[top] * count, top_token_ids=[-1] * count * top,
        top_logprobs=[0.0] * count * top)


def test_the_bound_covers_the_largest_encoding_of_every_field() -> None:
    """Every field at its widest (ids of 10-byte varints, -1 tokens): the bound holds."""
    top = 100
    answer = widest(3, top)
    answer.num_tokens[:] = answer.num_computed_tokens[:] = answer.num_cached_tokens[:] = (
        [2**32 - 1] * 3)
    answer.logprobs[:] = [-1.5] * 3
    answer.outcomes[:] = [rpb.OUTCOME_CONSTRAINT_ENDED] * 3
    answer.top_logprobs[:] = [-1.5] * 3 * top
    assert answer.ByteSize() <= ANSWER_FIXED + 3 * output_bytes(top)


def test_an_answer_on_the_step_stream_stays_within_the_message_limit() -> None:
    """On a StepStream the answer travels in a RunnerStreamResponse with the widest step id:
    STREAM_ENVELOPE covers what it adds, and max_answer_bytes leaves room for it (at the
    message limit the runner could not send the answer of a step it applied)."""
    answer = widest(3, 100)
    streamed = rpb.RunnerStreamResponse(step_id=2**64 - 1, answer=answer)
    assert streamed.ByteSize() - answer.ByteSize() <= STREAM_ENVELOPE
    AnswerLimits(max_answer_bytes=MAX_MESSAGE_BYTES - STREAM_ENVELOPE)
    with pytest.raises(ValueError, match="max_answer_bytes must be in"):
        AnswerLimits(max_answer_bytes=MAX_MESSAGE_BYTES)


def test_logprobs_are_capped_at_vllms_20_by_default() -> None:
    assert AnswerLimits().max_logprobs == DEFAULT_MAX_LOGPROBS == 20
    args = parser().parse_args(["--random-init", "tiny"])
    assert (args.max_logprobs, args.max_answer_bytes) == (20, AnswerLimits().max_answer_bytes)
    assert AnswerLimits().max_answer_bytes < GRPC_DEFAULT_RECEIVE_BYTES

    def step(logprobs: int) -> list[SeqStep]:
        return [SeqStep(9, (1,), True, 0, SamplingParams(logprobs=logprobs))]

    AnswerLimits().check(step(20))
    with pytest.raises(InvalidStep, match="sequence 9: logprobs=21 is over the runner's "
                                          "max_logprobs=20"):
        AnswerLimits().check(step(21))


def test_limits_that_no_step_could_meet_are_refused() -> None:
    with pytest.raises(ValueError, match="max_answer_bytes must be in"):
        AnswerLimits(max_logprobs=VOCAB, max_answer_bytes=4096)
    with pytest.raises(ValueError, match="max_answer_bytes must be in"):
        AnswerLimits(max_answer_bytes=2 * GRPC_DEFAULT_RECEIVE_BYTES + 1)


async def test_the_request_that_got_a_6_mb_answer_is_refused_and_leaves_nothing(
        daemon: Pagedkvd, compute: RunnerClient) -> None:
    """27 sequences asking for every logprob: an answer of about 6 MB on main, which the client
    refused while the daemon kept all 27 sequences."""
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await pool.open_session("greedy for logprobs") as session:
        with pytest.raises(InvalidArgument, match=f"logprobs={VOCAB} is over the runner's "
                                                  f"max_logprobs={MAX_LOGPROBS}"):
            await compute.step(session, prompts(27, VOCAB))
        assert await held(session) == 0


async def test_an_answer_that_could_pass_the_limit_is_refused_before_anything_changes(
        daemon: Pagedkvd, runner: Pagedkvd, compute: RunnerClient) -> None:
    """At the cap, one sequence more than fits is refused, naming the limit, with nothing held;
    the most that fit are answered, through a stock channel (gRPC's default 4 MiB)."""
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await pool.open_session("at the cap") as session:
        with pytest.raises(AnswerTooLarge, match="the limit is max_answer_bytes="
                                                 f"{AnswerLimits().max_answer_bytes}") as refused:
            await compute.step(session, prompts(MOST_SEQS + 1, MAX_LOGPROBS))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await held(session) == 0
        request = rpb.RunnerStepRequest(session_id=session.session_id, seqs=[
            seq.message() for seq in prompts(MOST_SEQS, MAX_LOGPROBS)])
        async with grpc.aio.insecure_channel(runner.unix_target) as stock:
            answer = await runner_pb2_grpc.RunnerStub(stock).Step(request)
        outputs = StepOutputs.from_message(answer)
        assert [len(out.top_token_ids) for out in outputs] == [MAX_LOGPROBS] * MOST_SEQS
        assert answer.ByteSize() <= AnswerLimits().max_answer_bytes
        assert await held(session) == MOST_SEQS
        # The sequences' kept sampling counts, though later steps do not send it: the same
        # sequences and one more are refused, nothing changed.
        decode = [SeqStep(i, [out.token_id]) for i, out in enumerate(outputs)]
        with pytest.raises(AnswerTooLarge, match="max_answer_bytes"):
            await compute.step(session, [*decode, *prompts(1, MAX_LOGPROBS, first=MOST_SEQS)])
        assert await held(session) == MOST_SEQS
        (out,) = await compute.step(session, decode[:1])
        assert len(out.top_token_ids) == MAX_LOGPROBS  # the kept sampling, not sent again
