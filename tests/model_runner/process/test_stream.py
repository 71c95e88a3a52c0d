"""Runner.StepStream: a session's steps on one long-lived stream, against a real `pagedkvd` and a
real `pagedkv runner` process.

Each message is handled as a Step call with the same request and answered in order with its
step id; a failed step carries its status while the stream goes on; a message naming another
session than the stream's is INVALID_ARGUMENT for that step alone. A `RunnerClient` with
`stream_steps` (the engine's) reopens its stream after a break (a runner restarted under it, a
step cancelled by its caller or past its deadline), and the engine's `RunnerLink` recovers over
it with transformers' tokens. A session the runner follows is pushed transformers' tokens
(`RunnerClient.next_push`; the client plumbing alone: test_pushes.py). The daemon, runner,
config_path and reference fixtures are this folder's conftest.py's.
"""

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from transformers import PreTrainedModel

from pagedkv.client import (
    DeadlineExceeded,
    InvalidArgument,
    PoolClient,
    RunnerClient,
    SamplingParams,
    SeqStep,
    Session,
    StepOutputs,
)
from pagedkv.client.engine.runner_link import RunnerLink
from pagedkv.client.engine.sequences import Seq
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

from pagedkvd_process import Pagedkvd, pagedkv_runner, short_tmp_dir
from served_model import hf_greedy

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
PROMPTS = [[(5 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate((6, 19, 30))]
# Sessions that outlive a runner process: this test's event loop blocks while one starts.
LEASE_MS = 300_000


@pytest.fixture
async def clients(daemon: Pagedkvd,
                  runner: Pagedkvd) -> AsyncIterator[tuple[PoolClient, RunnerClient]]:
    """A daemon client, and a runner client whose steps go on streams (as the engine's)."""
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await RunnerClient.connect(runner.unix_target, stream_steps=True) as compute:
        yield pool, compute


@pytest.fixture
async def stub(runner: Pagedkvd) -> AsyncIterator[runner_pb2_grpc.RunnerStub]:
    """The generated stub, to write stream messages as any client would."""
    async with grpc.aio.insecure_channel(runner.unix_target,
                                         options=MESSAGE_SIZE_OPTIONS) as channel:
        yield runner_pb2_grpc.RunnerStub(channel)


def message(step_id: int, session: Session, seqs: list[SeqStep],
            release: tuple[int, ...] = ()) -> rpb.RunnerStreamRequest:
    return rpb.RunnerStreamRequest(step_id=step_id, step=rpb.RunnerStepRequest(
        session_id=session.session_id, seqs=[seq.message() for seq in seqs],
        release_seq_ids=release))


def first_token(answer: rpb.RunnerStreamResponse) -> int:
    assert answer.code == 0, answer.message
    (output,) = StepOutputs.from_message(answer.answer)
    return output.token_id


async def test_steps_written_together_are_answered_in_order_with_their_step_ids(
        clients: tuple[PoolClient, RunnerClient], stub: runner_pb2_grpc.RunnerStub,
        reference: PreTrainedModel) -> None:
    """Three prefills written back to back before any answer is read: three answers, in the
    order written, each with its step id and transformers' first token."""
    pool, _ = clients
    async with await pool.open_session("in-order") as session:
        call = stub.StepStream()
        ids = [7, 3, 11]  # any distinct ids: the answers follow the writes, not the ids
        for step_id, (seq_id, prompt) in zip(ids, enumerate(PROMPTS), strict=True):
            await call.write(message(step_id, session, [SeqStep(seq_id, prompt, True,
                                                                params=GREEDY)]))
        answers = [await call.read() for _ in ids]
        assert [answer.step_id for answer in answers] == ids
        assert [first_token(answer) for answer in answers] == [
            hf_greedy(reference, prompt, 1)[0] for prompt in PROMPTS]
        await call.write(message(12, session, [], (0, 1, 2)))
        assert (await call.read()).code == 0
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


async def test_a_failed_step_carries_its_status_and_the_stream_goes_on(
        clients: tuple[PoolClient, RunnerClient], stub: runner_pb2_grpc.RunnerStub,
        reference: PreTrainedModel) -> None:
    """An out-of-vocabulary token fails its step alone (the status a Step call gets, nothing
    appended); the next step on the same stream decodes as if it never happened."""
    pool, runner = clients
    async with await pool.open_session("careless") as session:
        call = stub.StepStream()
        await call.write(message(1, session, [SeqStep(1, PROMPTS[0], True, params=GREEDY)]))
        token = first_token(await call.read())
        await call.write(message(2, session, [SeqStep(1, [999])]))
        failed = await call.read()
        assert failed.step_id == 2 and not failed.HasField("answer")
        assert failed.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert failed.cause == "InvalidArgument" and "token_ids must be in" in failed.message
        (table,) = await session.block_tables([1])
        assert table.num_tokens == len(PROMPTS[0])  # the refused step appended nothing
        await call.write(message(3, session, [SeqStep(1, [token])], (1,)))
        assert first_token(await call.read()) == hf_greedy(reference, PROMPTS[0], 2)[1]
        call.cancel()
        # The same through the client: the failure is its class, and the stream stays open.
        await runner.step(session, [SeqStep(2, PROMPTS[1], True, params=GREEDY)])
        with pytest.raises(InvalidArgument, match="token_ids must be in"):
            await runner.step(session, [SeqStep(2, [-1])])
        await runner.step(session, [], [2])
        assert opened(runner, session) == 1


async def test_a_step_naming_another_session_is_refused_alone(
        clients: tuple[PoolClient, RunnerClient], stub: runner_pb2_grpc.RunnerStub) -> None:
    """The stream serves its first message's session: a step of another session is
    INVALID_ARGUMENT (naming neither: session ids are never echoed), that session gets
    nothing, and the stream goes on."""
    pool, _ = clients
    async with await pool.open_session("owner") as owner, \
            await pool.open_session("other") as other:
        call = stub.StepStream()
        await call.write(message(1, owner, [SeqStep(1, PROMPTS[0], True, params=GREEDY)]))
        first_token(await call.read())
        await call.write(message(2, other, [SeqStep(1, PROMPTS[1], True, params=GREEDY)]))
        refused = await call.read()
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "step 2 names another session than the one this stream serves" in refused.message
        stats = (await other.stats()).session
        assert stats is not None and stats.num_sequences == 0  # nothing was allocated for it
        await call.write(message(3, owner, [], (1,)))
        assert (await call.read()).code == 0
        call.cancel()


async def test_a_step_cancelled_by_its_caller_ends_the_stream(
        clients: tuple[PoolClient, RunnerClient]) -> None:
    """A step cancelled in flight cancels its stream (the runner computes it, unanswered): the
    next step opens another stream and reads its own answer, not the cancelled one's."""
    pool, runner = clients
    async with await pool.open_session("impatient") as session:
        pending = asyncio.create_task(runner.step(session, [SeqStep(1, PROMPTS[2], True,
                                                                    params=GREEDY)]))
        await asyncio.sleep(0)  # the step opened its stream and is writing to it
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        (output,) = await runner.step(session, [SeqStep(2, PROMPTS[0], True, params=GREEDY)])
        assert output.seq_id == 2 and output.num_tokens == len(PROMPTS[0])
        assert opened(runner, session) == 2
        await runner.step(session, [], [1, 2])  # the cancelled step's sequence, if applied
        stats = (await session.stats()).session
        assert stats is not None and stats.num_sequences == 0


async def test_a_step_past_its_deadline_is_one_without_an_answer(
        clients: tuple[PoolClient, RunnerClient]) -> None:
    """No answer in time: DeadlineExceeded (the outcome is unknown), the stream cancelled, and
    the next step goes on a new stream."""
    pool, runner = clients
    async with await pool.open_session("hurried", lease_ttl_ms=LEASE_MS) as session:
        timeout, runner.timeout = runner.timeout, 1e-6  # every answer comes too late
        with pytest.raises(DeadlineExceeded, match="no answer to step 1 within"):
            await runner.step(session, [SeqStep(1, PROMPTS[0], True, params=GREEDY)])
        runner.timeout = timeout
        await runner.step(session, [], [1])  # after the lost step's forward, if it was applied
        (output,) = await runner.step(session, [SeqStep(1, PROMPTS[0], True, params=GREEDY)])
        assert output.num_tokens == len(PROMPTS[0])
        assert opened(runner, session) == 2  # the first cancelled, the second serves the rest
        await runner.step(session, [], [1])


async def test_the_link_reopens_its_stream_on_a_restarted_runner_with_identical_tokens(
        daemon: Pagedkvd, config_path: Path, reference: PreTrainedModel) -> None:
    """One runner channel across a SIGKILL and a restart on the same socket: the stream the
    old runner served is replaced, the new runner's UnknownSequence is answered with each
    sequence's history, and the tokens are transformers'."""
    seqs = [Seq(i, list(p), len(p), GREEDY) for i, p in enumerate(PROMPTS)]
    with short_tmp_dir() as folder:
        listen = f"unix://{folder / 'runner.sock'}"
        async with await PoolClient.connect(daemon.unix_target) as pool, \
                await pool.open_session("survivor", lease_ttl_ms=LEASE_MS) as session:
            with pagedkv_runner(daemon, "--random-init", str(config_path),
                                listen=listen) as first:
                runner = await RunnerClient.connect(listen, stream_steps=True)
                link = RunnerLink(runner, session, (await runner.info()).runner_id)
                for _ in range(3):
                    await step(link, seqs)
                first.stop(signal.SIGKILL)
            async with runner:
                with pagedkv_runner(daemon, "--random-init", str(config_path), listen=listen):
                    while len(seqs[0].generated) < NEW_TOKENS:
                        await step(link, seqs)
                    assert link.restarts == 1 and opened(runner, session) == 2
                    await runner.step(session, [], [seq.seq_id for seq in seqs])
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        assert seq.generated == hf_greedy(reference, prompt, NEW_TOKENS)


async def test_a_followed_session_is_pushed_transformers_tokens(
        clients: tuple[PoolClient, RunnerClient], reference: PreTrainedModel) -> None:
    """A step with follow, then only pushes until the sequence finishes: transformers' tokens,
    in order; the next step naming a sequence carries the pushes read, so it is not stale."""
    pool, runner = clients
    async with await pool.open_session("followed") as session:
        (out,) = await runner.step(session, [SeqStep(1, PROMPTS[1], True, params=GREEDY,
                                                     decode_ahead=True)], follow=True)
        tokens = [out.token_id]
        while not out.finished:  # a push may carry several steps (the stream lagged)
            for out in await runner.next_push(session):
                tokens.append(out.token_id)
        assert tokens == hf_greedy(reference, PROMPTS[1], NEW_TOKENS)
        assert runner.take_push(session) is None
        (out,) = await runner.step(session, [SeqStep(2, PROMPTS[0], True, params=GREEDY)], [1])
        assert out.token_id == hf_greedy(reference, PROMPTS[0], 1)[0]
        await runner.step(session, [], [2])
        assert opened(runner, session) == 1


async def test_a_release_without_an_answer_is_sent_again_to_the_same_runner(
        daemon: Pagedkvd, config_path: Path) -> None:
    """A release alone (a preemption) whose answer is lost (the runner stopped past the
    client's timeout, then goes on): once the same runner answers, the link sends it again
    (freeing a freed sequence is ignored) instead of failing the engine's loop; the sequence is
    gone and nothing restarted."""
    seqs = [Seq(0, list(PROMPTS[0]), len(PROMPTS[0]), GREEDY)]
    with pagedkv_runner(daemon, "--random-init", str(config_path)) as paused:
        async with await PoolClient.connect(daemon.unix_target) as pool, \
                await pool.open_session("lost-release", lease_ttl_ms=LEASE_MS) as session, \
                await RunnerClient.connect(paused.unix_target, timeout=1.0,
                                           stream_steps=True) as runner:
            link = RunnerLink(runner, session, (await runner.info()).runner_id)
            await step(link, seqs)
            paused.send(signal.SIGSTOP)  # the release's answer comes after the client's 1 s
            asyncio.get_running_loop().call_later(2.0, paused.send, signal.SIGCONT)
            await link.step([], [], [0])
            stats = (await session.stats()).session
    assert stats is not None and stats.num_sequences == 0
    assert link.restarts == 0 and opened(runner, session) == 2


async def test_a_draining_runner_ends_an_idle_stream(daemon: Pagedkvd,
                                                     config_path: Path) -> None:
    """SIGTERM: a stream waiting for its next step ends at once with OK, instead of holding
    the drain for its grace period and being cancelled at its end."""
    with pagedkv_runner(daemon, "--random-init", str(config_path)) as draining:
        async with await PoolClient.connect(daemon.unix_target) as pool, \
                await pool.open_session("drained") as session, \
                grpc.aio.insecure_channel(draining.unix_target) as channel:
            call = runner_pb2_grpc.RunnerStub(channel).StepStream()
            await call.write(message(1, session, [SeqStep(1, PROMPTS[0], True, params=GREEDY)],
                                     (1,)))
            first_token(await call.read())
            draining.send(signal.SIGTERM)
            assert await call.code() == grpc.StatusCode.OK
            assert await call.read() == grpc.aio.EOF
        assert draining.wait_for_exit() == 0


def opened(runner: RunnerClient, session: Session) -> int:
    """How many streams the runner client opened for the session's steps."""
    assert runner.streams is not None
    return runner.streams[session.session_id].opened


async def step(link: RunnerLink, seqs: list[Seq]) -> None:
    """One step of every sequence, as the engine's scheduler sends it."""
    outputs = await link.step(seqs, [seq.step() for seq in seqs], ())
    for seq, out in zip(seqs, outputs, strict=True):
        seq.stepped(out)
        seq.record(out, None)
