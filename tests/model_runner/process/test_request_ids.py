"""Request ids through a real `pagedkv runner` to a real `pagedkvd`, both logging at debug: the
id a step's new sequence carries is on the runner's lines (admitted, finished, released) and
the daemon's (allocated, forked, freed), a fork's child inheriting it; a bad id is refused with
INVALID_ARGUMENT naming request_id, before anything changes."""

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from pagedkv.client import InvalidArgument, PoolClient, RunnerClient, SamplingParams, SeqStep
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc

from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd

PROMPT = [5, 9, 17, 33, 2, 8]
# Finished after two tokens: the first step samples one, the next one the second.
TWO_TOKENS = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def daemon(config_path: Path) -> Iterator[Pagedkvd]:
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "64",
                  "--log-level", "debug") as running:
        yield running


@pytest.fixture(scope="module")
def runner(daemon: Pagedkvd, config_path: Path) -> Iterator[Pagedkvd]:
    with pagedkv_runner(daemon, "--random-init", str(config_path), "--log-level",
                        "debug") as running:
        yield running


@pytest.fixture
async def clients(daemon: Pagedkvd,
                  runner: Pagedkvd) -> AsyncIterator[tuple[PoolClient, RunnerClient]]:
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await RunnerClient.connect(runner.unix_target) as compute:
        yield pool, compute


def lines(process: Pagedkvd, event: str) -> list[dict[str, object]]:
    """The process's JSON log lines of `event` (other lines, e.g. a traceback, skipped)."""
    found = []
    for text in process.stderr().splitlines():
        if text.startswith("{") and (line := json.loads(text))["event"] == event:
            found.append(line)
    return found


def of(found: list[dict[str, object]], request_id: str) -> list[tuple[object, ...]]:
    return [(line["seq_id"], line["request_id"]) for line in found
            if line["request_id"] == request_id]


async def test_the_id_is_on_the_runner_and_daemon_lines_of_its_sequences(
        clients: tuple[PoolClient, RunnerClient], daemon: Pagedkvd, runner: Pagedkvd) -> None:
    pool, compute = clients
    async with await pool.open_session("ids") as session:
        await compute.step(session, [SeqStep(1, PROMPT, True, params=TWO_TOKENS,
                                             request_id="abc-123")])
        out = await compute.step(session, [SeqStep(1, [3]), SeqStep(2, (), True,
                                                                     params=TWO_TOKENS,
                                                                     parent_seq_id=1)])
        assert out[0].finished  # seq 1's second token
        await compute.step(session, [], release=[1, 2])
    assert of(lines(runner, "sequence admitted"), "abc-123") == [(1, "abc-123"),
                                                                 (2, "abc-123")]
    assert of(lines(runner, "sequence finished"), "abc-123")[0] == (1, "abc-123")
    assert sorted(of(lines(runner, "sequence released"), "abc-123")) == [(1, "abc-123"),
                                                                         (2, "abc-123")]
    assert of(lines(daemon, "sequence allocated"), "abc-123") == [(1, "abc-123")]
    assert of(lines(daemon, "sequence forked"), "abc-123") == [(2, "abc-123")]
    assert sorted(of(lines(daemon, "sequence freed"), "abc-123")) == [(1, "abc-123"),
                                                                      (2, "abc-123")]


@pytest.mark.parametrize("bad", ["r" * 200, "abc-123\n{\"event\": \"forged\"}"])
async def test_a_bad_id_is_invalid_argument_naming_request_id_and_changes_nothing(
        clients: tuple[PoolClient, RunnerClient], daemon: Pagedkvd, runner: Pagedkvd,
        bad: str) -> None:
    pool, compute = clients
    async with await pool.open_session("bad-ids") as session:
        # A hand-made message, as any client of runner.proto may send.
        sampling = rpb.SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1)
        message = rpb.RunnerStepRequest(session_id=session.session_id, seqs=[
            rpb.SequenceStep(seq_id=1, new_sequence=True, token_ids=PROMPT, sampling=sampling,
                             request_id=bad)])
        async with grpc.aio.insecure_channel(runner.unix_target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await runner_pb2_grpc.RunnerStub(channel).Step(message, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id must be 1 to 128" in (refused.value.details() or "")
        # Through the bundled client too, with a good sequence beside it: the step fails whole.
        with pytest.raises(InvalidArgument, match="request_id"):
            await compute.step(session, [SeqStep(1, PROMPT, True, params=TWO_TOKENS),
                                         SeqStep(2, PROMPT, True, params=TWO_TOKENS,
                                                 request_id=bad)])
        stats = (await session.stats()).session
        assert stats is not None and stats.num_sequences == 0 and stats.blocks_held == 0
        # On an existing sequence (no Allocate: the daemon never sees it) the runner refuses
        # it itself, and keeps the sequence as it was.
        first = await compute.step(session, [SeqStep(3, PROMPT, True, params=TWO_TOKENS)])
        with pytest.raises(InvalidArgument, match="sequence 3: request_id must be 1 to 128"):
            await compute.step(session, [SeqStep(3, [first[0].token_id], request_id=bad)])
        again = await compute.step(session, [SeqStep(3, [first[0].token_id])])
        assert again[0].num_tokens == len(PROMPT) + 1
    assert "forged" not in runner.stderr() and "forged" not in daemon.stderr()
