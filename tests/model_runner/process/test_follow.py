"""The runner follows a session on Runner.StepStream (runner.proto's StepStream, "Following"),
against a real `pagedkvd` and a real `pagedkv runner` process, through the generated stub.

A message with `follow` set: after its answer the runner takes the session's implied step
itself (each decode_ahead sequence that sampled a token not finishing it, that token appended)
and pushes each answer, numbered, until no sequence is left, a push fails, the client's next
message arrives, or the runner drains. A message naming sequences that was planned before
pushes it had not read is refused (ABORTED, cause StalePlan), nothing changed; a release alone
never is. Tokens are transformers' greedy ones throughout.
"""

import signal
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from transformers import PreTrainedModel

from pagedkv.client import PoolClient, SamplingParams, SeqOutput, SeqStep, Session, StepOutputs
from pagedkv.model_runner.engine.steps import implied_step
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

from pagedkvd_process import Pagedkvd, pagedkv_runner
from served_model import hf_greedy

PROMPTS = [[(5 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate((6, 19, 30))]
# More tokens than any test follows (and than a drain takes to end a stream): the sequence goes
# on until the test stops following it.
ENDLESS = SamplingParams(temperature=0.0, max_tokens=200)

# The module fixtures config_path, daemon, metrics_port, reference and runner are conftest.py's.

Call = grpc.aio.StreamStreamCall[rpb.RunnerStreamRequest, rpb.RunnerStreamResponse]


@pytest.fixture
async def pool(daemon: Pagedkvd) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target) as client:
        yield client


@pytest.fixture
async def stub(runner: Pagedkvd) -> AsyncIterator[runner_pb2_grpc.RunnerStub]:
    """The generated stub, to write stream messages as any client would."""
    async with grpc.aio.insecure_channel(runner.unix_target,
                                         options=MESSAGE_SIZE_OPTIONS) as channel:
        yield runner_pb2_grpc.RunnerStub(channel)


def message(step_id: int, session: Session, seqs: list[SeqStep], release: tuple[int, ...] = (),
            *, follow: bool = False, pushes_read: int = 0) -> rpb.RunnerStreamRequest:
    return rpb.RunnerStreamRequest(
        step_id=step_id, follow=follow, pushes_read=pushes_read,
        step=rpb.RunnerStepRequest(session_id=session.session_id,
                                   seqs=[seq.message() for seq in seqs],
                                   release_seq_ids=release))


def new(seq_id: int, prompt: list[int], params: SamplingParams) -> SeqStep:
    return SeqStep(seq_id, prompt, True, params=params, decode_ahead=True)


async def answer(call: Call, step_id: int,
                 pushes: list[rpb.RunnerStreamResponse]) -> rpb.RunnerStreamResponse:
    """The answer to message `step_id`; the pushes read before it are added to `pushes`."""
    while (read := await call.read()).push:
        assert read.step_id == 0
        pushes.append(read)
    assert read.step_id == step_id
    return read


def tokens(response: rpb.RunnerStreamResponse) -> dict[int, list[int]]:
    """Each sequence's sampled tokens in an OK answer or push, in order (a push carries several
    steps when the stream lagged)."""
    assert response.code == 0, response.message
    sampled: dict[int, list[int]] = {}
    for output in StepOutputs.from_message(response.answer):
        sampled.setdefault(output.seq_id, []).append(output.token_id)
    return sampled


def steps(pushes: list[rpb.RunnerStreamResponse]) -> int:
    """The implied steps these OK pushes carry."""
    return sum(len(StepOutputs.from_message(push.answer).steps()) for push in pushes)


def pushes_total(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagedkv_runner:pushes_total{"))


def test_the_implied_step_is_the_next_step_of_the_sequences_that_go_on() -> None:
    """In step order, each decode_ahead sequence that sampled a token not finishing it and was
    not released: that token, decode_ahead again, the sampling kept (none sent)."""
    steps = [SeqStep(seq_id, [1], decode_ahead=seq_id != 2) for seq_id in range(6)]
    outputs = [SeqOutput(0, 9, 9, 0, True, 40), SeqOutput(1, 9, 9, 0, True, 41),
               SeqOutput(2, 9, 9, 0, True, 42),  # not marked decode_ahead
               SeqOutput(3, 9, 9, 0, True, 43, finished=True),
               SeqOutput(4, 9, 5, 0, False),  # a chunked prefill goes on
               SeqOutput(5, 9, 9, 0, True, 45)]  # released
    assert implied_step(steps, outputs, [5]) == [
        SeqStep(0, (40,), decode_ahead=True), SeqStep(1, (41,), decode_ahead=True)]


async def test_following_pushes_each_implied_step_until_no_sequence_is_left(
        pool: PoolClient, stub: runner_pb2_grpc.RunnerStub, reference: PreTrainedModel,
        metrics_port: int) -> None:
    """One message: three greedy sequences, followed. The pushes come numbered 1..k, each with
    the sequences that go on in order; a sequence that reaches max_tokens comes back finished
    and is gone from the next push; the tokens are transformers'; after the last sequence
    finishes nothing more is pushed."""
    limits = (4, 7, 10)
    before = pushes_total(metrics_port)
    async with await pool.open_session("followed") as session:
        call = stub.StepStream()
        await call.write(message(1, session, [
            new(i, prompt, SamplingParams(temperature=0.0, max_tokens=n))
            for i, (prompt, n) in enumerate(zip(PROMPTS, limits, strict=True))], follow=True))
        generated = tokens(await call.read())
        pushes: list[rpb.RunnerStreamResponse] = []
        going = [0, 1, 2]
        while going:
            push = await call.read()
            pushes.append(push)
            assert push.push == len(pushes) and push.step_id == 0
            for outputs in StepOutputs.from_message(push.answer).steps():
                assert [output.seq_id for output in outputs] == going
                for output in outputs:
                    generated[output.seq_id].append(output.token_id)
                    assert output.finished == (
                        len(generated[output.seq_id]) == limits[output.seq_id])
                going = [o.seq_id for o in outputs if not o.finished]
        assert steps(pushes) == max(limits) - 1
        # Following ended: the next message's answer is the next thing on the stream.
        await call.write(message(2, session, [], (0, 1, 2), pushes_read=len(pushes)))
        last = await call.read()
        assert last.push == 0 and last.step_id == 2 and last.code == 0
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    for seq_id, (prompt, n) in enumerate(zip(PROMPTS, limits, strict=True)):
        assert generated[seq_id] == hf_greedy(reference, prompt, n)
    assert pushes_total(metrics_port) - before == len(pushes)


async def test_a_step_planned_before_pushes_it_did_not_read_is_refused_as_stale(
        pool: PoolClient, stub: runner_pb2_grpc.RunnerStub, reference: PreTrainedModel) -> None:
    """After three pushes, a step planned after the first (pushes_read 1) is refused ABORTED,
    cause StalePlan, nothing changed; a step planned after every push (its pushes_read, the
    last pushed token) goes on with transformers' tokens."""
    prompt = PROMPTS[1]
    async with await pool.open_session("stale") as session:
        call = stub.StepStream()
        await call.write(message(1, session, [new(1, prompt, ENDLESS)], follow=True))
        generated = tokens(await call.read())[1]
        pushes = [await call.read() for _ in range(3)]
        stale_token = tokens(pushes[0])[1][0]  # what a client that read only push 1 names
        await call.write(message(2, session, [SeqStep(1, [stale_token], decode_ahead=True)],
                                 pushes_read=1))
        refused = await answer(call, 2, pushes)
        assert refused.code == grpc.StatusCode.ABORTED.value[0] and refused.cause == "StalePlan"
        assert (f"step 2 was planned after 1 pushed answers; the runner has pushed "
                f"{len(pushes)}: read them and plan again") == refused.message
        generated += [token for push in pushes for token in tokens(push)[1]]
        assert [push.push for push in pushes] == list(range(1, len(pushes) + 1))
        # Nothing changed: the step naming the last pushed token is answered from there.
        await call.write(message(3, session, [SeqStep(1, [generated[-1]])],
                                 pushes_read=len(pushes)))
        generated += tokens(await answer(call, 3, pushes))[1]
        assert steps(pushes) == len(generated) - 2  # nothing was pushed after the refusal
        await call.write(message(4, session, [], (1,)))
        assert (await answer(call, 4, pushes)).code == 0
        call.cancel()
    assert generated == hf_greedy(reference, prompt, len(generated))


async def test_pushes_read_past_the_pushes_sent_is_refused_and_changes_nothing(
        pool: PoolClient, stub: runner_pb2_grpc.RunnerStub, reference: PreTrainedModel) -> None:
    """A client claiming more pushes than the runner sent (a release alone too) is refused
    INVALID_ARGUMENT naming pushes_read; its release is not carried out."""
    async with await pool.open_session("overread") as session:
        call = stub.StepStream()
        await call.write(message(1, session, [new(1, PROMPTS[0], ENDLESS)], follow=True))
        generated = tokens(await call.read())[1]
        pushes = [await call.read()]
        await call.write(message(2, session, [], (1,), pushes_read=1000))
        refused = await answer(call, 2, pushes)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "pushes_read 1000" in refused.message
        stats = (await session.stats()).session
        assert stats is not None and stats.num_sequences == 1  # not released
        generated += [token for push in pushes for token in tokens(push)[1]]
        await call.write(message(3, session, [SeqStep(1, [generated[-1]])],
                                 pushes_read=len(pushes)))
        generated += tokens(await answer(call, 3, pushes))[1]
        await call.write(message(4, session, [], (1,), pushes_read=len(pushes)))
        assert (await answer(call, 4, pushes)).code == 0
        call.cancel()
    assert generated == hf_greedy(reference, PROMPTS[0], len(generated))


async def test_a_release_while_following_is_never_stale(
        pool: PoolClient, stub: runner_pb2_grpc.RunnerStub, reference: PreTrainedModel) -> None:
    """A release alone, planned before every push (pushes_read 0), is answered and frees its
    sequence in the daemon; the other one goes on from its last pushed token."""
    async with await pool.open_session("release") as session:
        call = stub.StepStream()
        await call.write(message(1, session, [new(0, PROMPTS[0], ENDLESS),
                                              new(1, PROMPTS[1], ENDLESS)], follow=True))
        generated = tokens(await call.read())[0]
        pushes = [await call.read() for _ in range(2)]
        await call.write(message(2, session, [], (1,)))
        released = await answer(call, 2, pushes)
        assert released.code == 0, released.message
        stats = (await session.stats()).session
        assert stats is not None and stats.num_sequences == 1  # sequence 1 is gone
        generated += [token for push in pushes for token in tokens(push)[0]]
        await call.write(message(3, session, [SeqStep(0, [generated[-1]])],
                                 pushes_read=len(pushes)))
        generated += tokens(await answer(call, 3, pushes))[0]
        assert steps(pushes) == len(generated) - 2
        await call.write(message(4, session, [], (0,)))
        assert (await answer(call, 4, pushes)).code == 0
        call.cancel()
    assert generated == hf_greedy(reference, PROMPTS[0], len(generated))


async def test_a_failed_push_carries_its_status_and_ends_following(
        pool: PoolClient, stub: runner_pb2_grpc.RunnerStub) -> None:
    """A session allowed two blocks, a prompt three tokens short of them: three pushes fill
    them, the fourth implied step's daemon Step needs a third block and is refused
    (RESOURCE_EXHAUSTED, PoolExhausted, nothing appended); it is pushed with that status and
    nothing more is pushed."""
    async with await pool.open_session("cramped", max_blocks=2) as session:
        room = 2 * session.block_size
        prompt = [(7 * j) % 128 for j in range(room - 3)]
        call = stub.StepStream()
        await call.write(message(1, session, [new(1, prompt, ENDLESS)], follow=True))
        tokens(await call.read())
        pushes = [await call.read()]
        while pushes[-1].code == 0:  # the room's steps, one push each or merged
            pushes.append(await call.read())
        assert steps(pushes[:-1]) == room - len(prompt)
        failed = pushes[-1]
        assert failed.push == len(pushes) and failed.step_id == 0
        assert not failed.HasField("answer")
        assert failed.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert failed.cause == "PoolExhausted"
        (table,) = await session.block_tables([1])
        assert table.num_tokens == room  # the failed step appended nothing
        await call.write(message(2, session, [], (1,), pushes_read=len(pushes)))
        last = await call.read()
        assert last.push == 0 and last.step_id == 2 and last.code == 0
        call.cancel()


async def test_a_stream_cancelled_while_following_leaves_its_session_usable(
        pool: PoolClient, stub: runner_pb2_grpc.RunnerStub) -> None:
    """The client cancels its stream mid-follow (the implied step in flight ends as a cancelled
    Step): a new stream releases the followed sequence, as runner.proto tells a client whose
    stream broke, and the session holds nothing."""
    async with await pool.open_session("broken") as session:
        call = stub.StepStream()
        await call.write(message(1, session, [new(1, PROMPTS[2], ENDLESS)], follow=True))
        tokens(await call.read())
        tokens(await call.read())
        call.cancel()
        again = stub.StepStream()
        await again.write(message(1, session, [], (1,)))
        released = await again.read()
        assert released.push == 0 and released.code == 0, released.message
        stats = (await session.stats()).session
        assert stats is not None and stats.num_sequences == 0
        await again.done_writing()
        assert await again.code() == grpc.StatusCode.OK


async def test_a_draining_runner_ends_a_following_stream(daemon: Pagedkvd,
                                                         config_path: Path) -> None:
    """SIGTERM while following a sequence with no end: the stream ends OK, every message on it
    a push (numbered on), the last one's sequence not finished: draining ended it."""
    with pagedkv_runner(daemon, "--random-init", str(config_path)) as draining:
        async with await PoolClient.connect(daemon.unix_target) as pool, \
                await pool.open_session("drained") as session, \
                grpc.aio.insecure_channel(draining.unix_target) as channel:
            call = runner_pb2_grpc.RunnerStub(channel).StepStream()
            await call.write(message(1, session, [new(1, PROMPTS[0], ENDLESS)], follow=True))
            tokens(await call.read())
            pushes = [await call.read()]
            draining.send(signal.SIGTERM)
            while (read := await call.read()) != grpc.aio.EOF:
                assert isinstance(read, rpb.RunnerStreamResponse)
                pushes.append(read)
            assert await call.code() == grpc.StatusCode.OK
            assert [push.push for push in pushes] == list(range(1, len(pushes) + 1))
            assert all(push.code == 0 for push in pushes)
            assert not StepOutputs.from_message(pushes[-1].answer)[-1].finished
        assert draining.wait_for_exit() == 0
