"""A consumer that lags behind a following runner (runner.proto's StepStream, "Following";
model_runner/process/outbox.py), against a real `pagedkvd` and `pagedkv runner` process: a
client that sleeps between reads gets exactly the tokens, logprobs and finishes of one that
reads at once, in no more messages (steps the stream had not sent yet are merged: the count
depends on how far the runner's event loop falls behind its forward thread; the client's gRPC
buffers absorb the pushes of a sleeping reader, so its writes seldom wait)."""

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pagedkv.client import PoolClient, SamplingParams, SeqOutput, SeqStep, StepOutputs
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

from pagedkvd_process import Pagedkvd

# Eight greedy sequences with 20 top logprobs (every field of a merged push is checked).
PROMPTS = [[(5 * i + 3 * j) % 128 for j in range(4 + 3 * i)] for i in range(8)]
LIMITS = [90 + 4 * i for i in range(8)]
LOGPROBS = 20
# How long the lagging client sleeps before its first push, and before each next one.
FIRST_LAG_S = 0.2
LAG_S = 0.01

# The module fixtures daemon and runner are conftest.py's.


@pytest.fixture
async def pool(daemon: Pagedkvd) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target) as client:
        yield client


@pytest.fixture
async def stub(runner: Pagedkvd) -> AsyncIterator[runner_pb2_grpc.RunnerStub]:
    async with grpc.aio.insecure_channel(
            runner.unix_target, options=MESSAGE_SIZE_OPTIONS) as channel:
        yield runner_pb2_grpc.RunnerStub(channel)


async def generate(pool: PoolClient, stub: runner_pb2_grpc.RunnerStub, name: str,
                   lag: tuple[float, float]) -> tuple[dict[int, list[SeqOutput]], int, int]:
    """Every sequence followed to its end, reading the first push lag[0] seconds late and
    each next one lag[1]: each
    sequence's outputs in order, the pushes (messages) read and the steps they carried."""
    outputs: dict[int, list[SeqOutput]] = {i: [] for i in range(len(PROMPTS))}
    messages = steps = 0
    async with await pool.open_session(name) as session:
        call = stub.StepStream()
        await call.write(rpb.RunnerStreamRequest(step_id=1, follow=True, step=rpb.RunnerStepRequest(
            session_id=session.session_id, seqs=[
                SeqStep(i, prompt, True, decode_ahead=True, params=SamplingParams(
                    temperature=0.0, max_tokens=n, logprobs=LOGPROBS)).message()
                for i, (prompt, n) in enumerate(zip(PROMPTS, LIMITS, strict=True))])))
        going = len(PROMPTS)
        while going:
            if messages:
                await asyncio.sleep(lag[0] if messages == 1 else lag[1])
            read = await call.read()
            assert isinstance(read, rpb.RunnerStreamResponse) and read.code == 0, read
            assert read.push == messages  # the first message is step 1's answer
            messages += 1
            for step in StepOutputs.from_message(read.answer).steps():
                steps += 1
                for output in step:
                    assert not outputs[output.seq_id] or not outputs[output.seq_id][-1].finished
                    outputs[output.seq_id].append(output)
                    going -= output.finished
        await call.write(rpb.RunnerStreamRequest(
            step_id=2, pushes_read=messages - 1, step=rpb.RunnerStepRequest(
                session_id=session.session_id, release_seq_ids=range(len(PROMPTS)))))
        last = await call.read()
        assert isinstance(last, rpb.RunnerStreamResponse) and last.code == 0, last
        call.cancel()
    return outputs, messages - 1, steps - 1


async def test_a_lagging_client_gets_the_same_outputs_step_by_step(
        pool: PoolClient, stub: runner_pb2_grpc.RunnerStub) -> None:
    prompt, pushes, steps = await generate(pool, stub, "prompt", (0.0, 0.0))
    lagged, lagged_pushes, lagged_steps = await generate(pool, stub, "lagged",
                                                       (FIRST_LAG_S, LAG_S))
    assert lagged == prompt
    assert [len(outputs) for outputs in lagged.values()] == LIMITS
    assert steps == lagged_steps == max(LIMITS) - 1
    print(f"pushes {pushes} / lagged {lagged_pushes} for {steps} steps")
    assert pushes <= steps and lagged_pushes <= steps
