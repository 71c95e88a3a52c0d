"""The client's side of a runner that follows a session (runner.proto's StepStream, "Following"):
`RunnerClient.step(..., follow=True)`, `next_push`, `take_push` (client/pool/runner_stream.py),
against a scripted Runner servicer on a real grpc.aio server: the test writes each answer,
push and end of the stream itself, and reads what the client wrote.

Pushes come in the runner's order, those written before an answer queued by the time its step
returns; each step says how many pushes of its stream were taken (pushes_read); a pushed
failure raises its class; the stream's end raises RunnerUnreachable once the pushes before it
are taken; a cancelled `next_push` loses nothing; a push not in time cancels the stream; a
stream reopened after a break counts from 0, the old stream's queued pushes gone.
"""

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from pagedkv.client import (
    DeadlineExceeded,
    PoolExhausted,
    RunnerClient,
    RunnerUnreachable,
    SeqOutput,
    SeqStep,
    Session,
    StalePlan,
    StepOutputs,
)
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

# The client's session: only its id travels.
SESSION = cast(Session, SimpleNamespace(session_id="followed"))
# One decoding sequence, the runner asked to follow it.
DECODE = [SeqStep(1, [5], decode_ahead=True)]
# Long enough never to pass in a test that expects an answer or a push.
PATIENT_S = 30.0
# What the scripted servicer writes next: a message, a status to end the stream with (abort),
# or None to end it OK.
Script = rpb.RunnerStreamResponse | grpc.StatusCode | None


class ScriptedStream:
    """One StepStream call as the servicer sees it."""

    def __init__(self) -> None:
        # What the client wrote, in order.
        self.inbox: asyncio.Queue[rpb.RunnerStreamRequest] = asyncio.Queue()
        # What the test has the servicer write.
        self.outbox: asyncio.Queue[Script] = asyncio.Queue()
        # Set when the client cancelled the call.
        self.cancelled = asyncio.Event()

    async def received(self) -> rpb.RunnerStreamRequest:
        return await asyncio.wait_for(self.inbox.get(), PATIENT_S)

    def send(self, *scripts: Script) -> None:
        for script in scripts:
            self.outbox.put_nowait(script)


class ScriptedRunner(runner_pb2_grpc.RunnerServicer):
    """A Runner whose StepStream writes what the test scripts."""

    def __init__(self) -> None:
        # Each StepStream call, as it opens.
        self.streams: asyncio.Queue[ScriptedStream] = asyncio.Queue()

    async def next_stream(self) -> ScriptedStream:
        return await asyncio.wait_for(self.streams.get(), PATIENT_S)

    async def StepStream(self, request_iterator: Any, context: Any) -> None:
        stream = ScriptedStream()
        self.streams.put_nowait(stream)
        reading = asyncio.create_task(read_into(context, stream.inbox))
        try:
            while (script := await stream.outbox.get()) is not None:
                if isinstance(script, grpc.StatusCode):
                    await context.abort(script, "scripted end")
                await context.write(script)
        except asyncio.CancelledError:
            stream.cancelled.set()
            raise
        finally:
            reading.cancel()


async def read_into(context: Any, inbox: asyncio.Queue[rpb.RunnerStreamRequest]) -> None:
    while (message := await context.read()) is not grpc.aio.EOF:
        inbox.put_nowait(message)


def answer(step_id: int, token: int, push: int = 0) -> rpb.RunnerStreamResponse:
    """An answer to step `step_id` (push 0), or push number `push` (step_id 0)."""
    output = SeqOutput(1, num_tokens=token, num_computed=token - 1, num_cached=0, sampled=True,
                       token_id=token)
    return rpb.RunnerStreamResponse(step_id=step_id, push=push,
                                    answer=StepOutputs([output], 100 - token).message())


def failure(step_id: int, push: int, code: grpc.StatusCode,
            cause: str) -> rpb.RunnerStreamResponse:
    return rpb.RunnerStreamResponse(step_id=step_id, push=push, code=code.value[0],
                                    cause=cause, message=f"scripted {cause}")


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedRunner, RunnerClient]]:
    """A scripted runner on a real grpc.aio server, and a client whose steps go on streams."""
    runner = ScriptedRunner()
    server = grpc.aio.server(options=MESSAGE_SIZE_OPTIONS)
    runner_pb2_grpc.add_RunnerServicer_to_server(runner, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with await RunnerClient.connect(f"127.0.0.1:{port}", timeout=PATIENT_S,
                                              stream_steps=True) as client:
            yield runner, client
    finally:
        await server.stop(None)


async def followed(runner: ScriptedRunner, client: RunnerClient) -> ScriptedStream:
    """A first step with follow, answered: the stream it opened."""
    stepping = asyncio.create_task(client.step(SESSION, DECODE, follow=True))
    stream = await runner.next_stream()
    first = await stream.received()
    assert first.follow and first.pushes_read == 0 and first.step_id != 0
    stream.send(answer(first.step_id, 10))
    (output,) = await stepping
    assert output.token_id == 10
    return stream


async def read_the_end(client: RunnerClient) -> None:
    """Wait until the client's reader has read its stream's end (every push before it queued)."""
    assert client.streams is not None
    call = client.streams[SESSION.session_id]._stream
    assert call is not None
    await asyncio.wait_for(call.ended_here(), PATIENT_S)


def opened(client: RunnerClient) -> int:
    assert client.streams is not None
    return client.streams[SESSION.session_id].opened


async def test_pushes_come_in_order_and_each_step_says_how_many_were_taken(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """Two pushes read in order (as StepOutputs); the next step carries pushes_read 2; a push
    the runner wrote before that step's answer is queued when the step returns."""
    runner, client = scripted
    stream = await followed(runner, client)
    stream.send(answer(0, 11, push=1), answer(0, 12, push=2))
    pushed = [await client.next_push(SESSION), await client.next_push(SESSION)]
    assert [out[0].token_id for out in pushed] == [11, 12]
    assert pushed[1].free_blocks == 88 and pushed[1][0].num_computed == 11
    assert client.take_push(SESSION) is None
    stepping = asyncio.create_task(client.step(SESSION, [], [1]))
    release = await stream.received()
    assert release.pushes_read == 2 and not release.follow
    stream.send(answer(0, 13, push=3), answer(release.step_id, 13))
    await stepping
    late = client.take_push(SESSION)  # no wait: the reader queued it before the answer
    assert late is not None and late[0].token_id == 13
    assert opened(client) == 1


async def test_a_pushed_failure_raises_its_class_and_counts_as_read(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """A push carrying PoolExhausted raises it; a step then refused StalePlan raises that; the
    failed push counts in the next pushes_read; the stream goes on."""
    runner, client = scripted
    stream = await followed(runner, client)
    stream.send(failure(0, 1, grpc.StatusCode.RESOURCE_EXHAUSTED, "PoolExhausted"))
    with pytest.raises(PoolExhausted, match="scripted PoolExhausted"):
        await client.next_push(SESSION)
    stepping = asyncio.create_task(client.step(SESSION, DECODE, follow=True))
    stale = await stream.received()
    assert stale.pushes_read == 1
    stream.send(failure(stale.step_id, 0, grpc.StatusCode.ABORTED, "StalePlan"))
    with pytest.raises(StalePlan):
        await stepping
    stream.send(answer(0, 20, push=2))
    assert (await client.next_push(SESSION))[0].token_id == 20
    assert opened(client) == 1


@pytest.mark.parametrize("end", [None, grpc.StatusCode.UNAVAILABLE], ids=["ok", "broken"])
async def test_the_streams_end_is_raised_once_after_the_pushes_before_it(
        scripted: tuple[ScriptedRunner, RunnerClient], end: grpc.StatusCode | None) -> None:
    """Two pushes, then the runner ends the stream (OK, or with a status without a cause), all
    read by the client before it takes any: the pushes are taken first, then RunnerUnreachable,
    once; then no stream is open."""
    runner, client = scripted
    stream = await followed(runner, client)
    stream.send(answer(0, 11, push=1), answer(0, 12, push=2), end)
    await read_the_end(client)
    assert (await client.next_push(SESSION))[0].token_id == 11
    push = client.take_push(SESSION)
    assert push is not None and push[0].token_id == 12
    with pytest.raises(RunnerUnreachable):
        await client.next_push(SESSION)
    assert client.take_push(SESSION) is None
    with pytest.raises(RunnerUnreachable, match="no step stream is open"):
        await client.next_push(SESSION)


async def test_steps_after_an_end_not_yet_taken_go_on_a_new_stream_counting_from_zero(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """A push taken, then the runner ends the stream (drained); two steps planned on the ended
    stream (the second waits for the first's answer) both go on a new one, pushes_read 0: the
    plan saw none of its pushes. The old stream's untaken push is gone with it."""
    runner, client = scripted
    stream = await followed(runner, client)
    stream.send(answer(0, 11, push=1))
    await client.next_push(SESSION)
    stream.send(answer(0, 12, push=2), None)
    await read_the_end(client)
    first = asyncio.create_task(client.step(SESSION, DECODE, follow=True))
    second = asyncio.create_task(client.step(SESSION, [], [1]))
    reopened = await runner.next_stream()
    for task in (first, second):
        message = await reopened.received()
        assert message.pushes_read == 0
        reopened.send(answer(message.step_id, 12))
        await task
    assert opened(client) == 2 and client.take_push(SESSION) is None


async def test_a_cancelled_next_push_loses_nothing(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """The engine races next_push against its own wake-up: cancelling the wait keeps the
    stream open, and the push written after it is the next one read."""
    runner, client = scripted
    stream = await followed(runner, client)
    waiting = asyncio.create_task(client.next_push(SESSION))
    await asyncio.sleep(0.01)  # the wait is under way
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    stream.send(answer(0, 11, push=1))
    assert (await client.next_push(SESSION))[0].token_id == 11
    assert not stream.cancelled.is_set() and opened(client) == 1


async def test_no_push_in_time_cancels_the_stream(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """next_push past its timeout: DeadlineExceeded, the runner sees the stream cancelled, and
    the next step opens another, counting from 0."""
    runner, client = scripted
    stream = await followed(runner, client)
    stream.send(answer(0, 11, push=1))
    await client.next_push(SESSION)
    with pytest.raises(DeadlineExceeded, match="no pushed answer within"):
        await client.next_push(SESSION, timeout=0.05)
    await asyncio.wait_for(stream.cancelled.wait(), PATIENT_S)
    with pytest.raises(RunnerUnreachable, match="no step stream is open"):
        await client.next_push(SESSION)
    stepping = asyncio.create_task(client.step(SESSION, [], [1]))
    reopened = await runner.next_stream()
    release = await reopened.received()
    assert release.pushes_read == 0 and opened(client) == 2
    reopened.send(answer(release.step_id, 12))
    await stepping


async def test_a_stream_broken_under_a_step_drops_its_pushes_and_the_next_counts_from_zero(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """One push taken, one queued, a step written (pushes_read 1), then the stream breaks:
    the step is RunnerUnreachable, the queued push gone with its stream, and the next step
    goes on a new stream with pushes_read 0."""
    runner, client = scripted
    stream = await followed(runner, client)
    stream.send(answer(0, 11, push=1))
    await client.next_push(SESSION)
    stream.send(answer(0, 12, push=2))
    stepping = asyncio.create_task(client.step(SESSION, DECODE, follow=True))
    assert (await stream.received()).pushes_read == 1
    stream.send(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(RunnerUnreachable):
        await stepping
    assert client.take_push(SESSION) is None
    stepping = asyncio.create_task(client.step(SESSION, [], [1]))
    reopened = await runner.next_stream()
    release = await reopened.received()
    assert release.pushes_read == 0 and opened(client) == 2
    reopened.send(answer(release.step_id, 13))
    await stepping
    assert client.take_push(SESSION) is None


async def test_an_answer_no_step_awaits_ends_the_stream(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """A runner answering another step id than the one in flight (not a push): the step fails
    as one without an answer, and the stream is cancelled."""
    runner, client = scripted
    stepping = asyncio.create_task(client.step(SESSION, DECODE))
    stream = await runner.next_stream()
    stream.send(answer((await stream.received()).step_id + 1, 10))
    with pytest.raises(RunnerUnreachable, match="which no step awaits"):
        await stepping
    await asyncio.wait_for(stream.cancelled.wait(), PATIENT_S)


async def test_pushes_need_a_client_with_streams(
        scripted: tuple[ScriptedRunner, RunnerClient]) -> None:
    """follow, next_push and take_push on a client of unary Steps: ValueError naming them,
    nothing sent."""
    unary = RunnerClient(scripted[1]._channel, PATIENT_S)
    with pytest.raises(ValueError, match="follow needs a RunnerClient made with stream_steps"):
        await unary.step(SESSION, DECODE, follow=True)
    with pytest.raises(ValueError, match="next_push needs"):
        await unary.next_push(SESSION)
    with pytest.raises(ValueError, match="take_push needs"):
        unary.take_push(SESSION)
    assert scripted[0].streams.empty()
