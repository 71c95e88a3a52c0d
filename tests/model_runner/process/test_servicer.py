"""`pagedkv runner` as a process next to a real `pagedkvd`, driven by real client processes.

The daemon plans its pool from the model's config.json and the runner random-initializes the
same config with the same seed, so this process can build the identical model and compare the
runner's greedy tokens with transformers' own `generate`. A runner killed with SIGKILL and
restarted on the same socket loses nothing: clients (`RunnerLink`, the engine) go on with the
tokens transformers gives, without recomputing what the daemon holds.
"""

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaConfig, PreTrainedModel

from pagedkv.client import (
    DaemonUnavailable,
    DeadlineExceeded,
    Engine,
    History,
    InvalidArgument,
    NotFound,
    PagedKVError,
    PoolClient,
    RunnerClient,
    RunnerUnavailable,
    SamplingParams,
    SchedulerConfig,
    SeqStep,
    Session,
    SessionBusy,
    SessionExpired,
    UnknownSequence,
)
from pagedkv.client.engine.runner_link import RunnerLink
from pagedkv.client.engine.sequences import Seq
from pagedkv.model_runner.models import ModelSource, load_model

from pagedkvd_process import (
    Pagedkvd,
    pagedkv_runner,
    pagedkvd,
    restarted,
    short_tmp_dir,
)
from served_model import hf_greedy

NEW_TOKENS = 8
# The lease of sessions that outlive a runner: this test's event loop blocks while a runner
# process starts.
LEASE_MS = 300_000
PROMPTS = [[(7 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate((5, 17, 33))]
# Tests of a runner restart under a client generate longer, to restart mid-decode.
RESTART_NEW_TOKENS = 16
# Sent with each sequence's first step; the runner keeps it for the later steps.
GREEDY = SamplingParams(temperature=0.0, max_tokens=RESTART_NEW_TOKENS)
# Runners these tests kill (and their successors) hold a session for 1 s past their last renewal
# (default 5 s; renewed at half that while a forward waits and runs): a killed runner's hold
# lapses, and its session closes, that much sooner.
KILLED_RUNNER_ARGS = ("--hold-ms", "1000")


@pytest.fixture
async def clients(daemon: Pagedkvd,
                  runner: Pagedkvd) -> AsyncIterator[tuple[PoolClient, RunnerClient]]:
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await RunnerClient.connect(runner.unix_target) as compute:
        yield pool, compute


def expected(reference: PreTrainedModel, prompt: list[int]) -> list[int]:
    return hf_greedy(reference, prompt, NEW_TOKENS)


async def greedy(runner: RunnerClient, session: Session, prompts: Sequence[list[int]],
                 first_id: int = 0) -> list[list[int]]:
    """Prefill every prompt in one step, decode the rest one step each, release at the end."""
    ids = range(first_id, first_id + len(prompts))
    outs = await runner.step(session, [SeqStep(i, p, new_sequence=True, params=GREEDY)
                                       for i, p in zip(ids, prompts, strict=True)])
    tokens = [[out.token_id] for out in outs]
    for step in range(NEW_TOKENS - 1):
        last = step == NEW_TOKENS - 2
        outs = await runner.step(session, [SeqStep(i, [t[-1]]) for i, t in zip(ids, tokens,
                                                                              strict=True)],
                                 release=list(ids) if last else [])
        for out, toks in zip(outs, tokens, strict=True):
            toks.append(out.token_id)
    return tokens


async def test_greedy_tokens_match_transformers(
        clients: tuple[PoolClient, RunnerClient], reference: PreTrainedModel) -> None:
    pool, runner = clients
    info = await runner.info()
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.dtype) == (2, 2, 16,
                                                                               "float32")
    async with await pool.open_session("greedy") as session:
        tokens = await greedy(runner, session, PROMPTS)
        assert tokens == [expected(reference, prompt) for prompt in PROMPTS]
        stats = await session.stats()
        assert stats.session is not None and stats.session.num_sequences == 0  # released


async def test_a_bad_step_fails_alone_and_changes_nothing(
        clients: tuple[PoolClient, RunnerClient], reference: PreTrainedModel) -> None:
    pool, runner = clients
    async with await pool.open_session("careless") as careless, \
            await pool.open_session("careful") as careful:
        await runner.step(careless, [SeqStep(1, PROMPTS[0], new_sequence=True, params=GREEDY)])
        bad = runner.step(careless, [SeqStep(1, [5]),
                                     SeqStep(2, [999], new_sequence=True, params=GREEDY)])
        good = greedy(runner, careful, PROMPTS[1:2])
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], InvalidArgument) and "token_ids must be in" in str(
            results[0])
        assert results[1] == [expected(reference, PROMPTS[1])]
        (table,) = await careless.block_tables([1])
        assert table.num_tokens == len(PROMPTS[0])  # the refused step appended nothing


async def test_metrics_count_steps_and_tokens(
        clients: tuple[PoolClient, RunnerClient], metrics_port: int) -> None:
    pool, runner = clients
    async with await pool.open_session("metrics") as session:
        await greedy(runner, session, PROMPTS[:2])
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read())
    text = body.decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines()
                   if line and not line.startswith("#"))
    assert float(samples["pagedkv_runner:step_duration_seconds_count"]) >= NEW_TOKENS
    assert float(samples['pagedkv_runner:tokens_total{kind="prefill"}']) >= sum(
        map(len, PROMPTS[:2]))
    assert float(samples['pagedkv_runner:tokens_total{kind="decode"}']) >= NEW_TOKENS - 1


async def test_another_sessions_sequence_is_not_found(
        clients: tuple[PoolClient, RunnerClient]) -> None:
    pool, runner = clients
    async with await pool.open_session("owner") as owner, \
            await pool.open_session("intruder") as intruder:
        await runner.step(owner, [SeqStep(1, PROMPTS[0], new_sequence=True, params=GREEDY)])
        with pytest.raises(NotFound) as failure:
            await runner.step(intruder, [SeqStep(1, [5], parent_seq_id=None)])
        assert failure.value.code == grpc.StatusCode.NOT_FOUND
        (out,) = await runner.step(owner, [SeqStep(1, [5])])  # the owner's is untouched
        assert out.num_tokens == len(PROMPTS[0]) + 1


CLIENT = """
import asyncio, json, sys
from pagedkv.client import PoolClient, RunnerClient, SamplingParams, SeqStep
daemon, target, prompts, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
async def main():
    async with await PoolClient.connect(daemon) as pool, \\
            await RunnerClient.connect(target) as runner:
        session = await pool.open_session("client-process")
        sys.stdin.readline()  # start together
        new = [SeqStep(i, p, new_sequence=True, params=SamplingParams(temperature=0))
               for i, p in enumerate(prompts)]
        outs = await runner.step(session, new)
        tokens = [[o.token_id] for o in outs]
        for _ in range(steps - 1):
            outs = await runner.step(session, [SeqStep(i, [t[-1]]) for i, t in enumerate(tokens)])
            for o, t in zip(outs, tokens): t.append(o.token_id)
        print(json.dumps(tokens))
        await session.close()
asyncio.run(main())
"""


def start_client(daemon: Pagedkvd, runner: Pagedkvd,
                 prompts: list[list[int]]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CLIENT, daemon.unix_target, runner.unix_target,
                             json.dumps(prompts), str(NEW_TOKENS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_two_client_processes_stepping_together_get_what_each_gets_alone(
        daemon: Pagedkvd, runner: Pagedkvd, reference: PreTrainedModel) -> None:
    clients = [start_client(daemon, runner, PROMPTS[:2]), start_client(daemon, runner,
                                                                        PROMPTS[1:])]
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
    results = [json.loads(client.communicate(timeout=120)[0]) for client in clients]
    assert all(client.returncode == 0 for client in clients)
    assert results[0] == [expected(reference, p) for p in PROMPTS[:2]]
    assert results[1] == [expected(reference, p) for p in PROMPTS[1:]]


def test_a_model_that_does_not_fit_the_pool_is_refused_at_start(
        daemon: Pagedkvd, tmp_path: Path) -> None:
    """A model of another geometry is welcome if its blocks divide the pool's pages (one of
    three layers does not: 1.5 of the daemon's own blocks); the daemon refuses to register it,
    and the runner exits 2."""
    other = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    other.save_pretrained(tmp_path)
    with pagedkv_runner(daemon, "--random-init", str(tmp_path / "config.json"),
                        wait_ready=False) as refused:
        assert refused.process.wait(120) == 2
        message = refused.stderr()
    assert f"refused to register model {tmp_path.name!r}" in message, message


async def test_a_killed_runner_restarted_continues_with_identical_tokens(
        daemon: Pagedkvd, config_path: Path, reference: PreTrainedModel) -> None:
    prompt = PROMPTS[2]
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await pool.open_session("survivor", lease_ttl_ms=LEASE_MS) as session:
        with pagedkv_runner(daemon, "--random-init", str(config_path),
                            *KILLED_RUNNER_ARGS) as first:
            async with await RunnerClient.connect(first.unix_target) as runner:
                (out,) = await runner.step(session, [SeqStep(1, prompt, new_sequence=True,
                                                             params=GREEDY)])
                tokens = [out.token_id]
                (out,) = await runner.step(session, [SeqStep(1, [tokens[-1]])])
                tokens.append(out.token_id)
            first.stop(signal.SIGKILL)
        with pagedkv_runner(daemon, "--random-init", str(config_path),
                            *KILLED_RUNNER_ARGS) as second:
            async with await RunnerClient.connect(second.unix_target) as runner:
                step = SeqStep(1, [tokens[-1]])
                with pytest.raises(UnknownSequence, match="resend it with its history"):
                    await runner.step(session, [step])
                held = [*prompt, *tokens[:-1]]  # the last token is not appended yet
                resumed = SeqStep(1, [tokens[-1]], history=History(held, len(prompt), len(held)),
                                  params=GREEDY)
                while len(tokens) < NEW_TOKENS:
                    (out,) = await runner.step(session, [resumed])
                    tokens.append(out.token_id)
                    resumed = SeqStep(1, [tokens[-1]])
    assert tokens == expected(reference, prompt)


async def test_a_daemon_restart_answers_unavailable_then_the_runner_maps_the_new_pool(
        config_path: Path, reference: PreTrainedModel) -> None:
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "64") as first, \
            pagedkv_runner(first, "--random-init", str(config_path)) as runner_process:
        async with await RunnerClient.connect(runner_process.unix_target) as runner, \
                await PoolClient.connect(first.unix_target) as pool:
            old_pool = (await runner.info()).pool_id
            stale = await pool.open_session("before-restart", keep_alive=False)
            assert first.stop() == 0
            refusal = await refusal_once_noticed(
                runner, stale, SeqStep(1, PROMPTS[0], new_sequence=True, params=GREEDY))
            assert isinstance(refusal, RunnerUnavailable), refusal
            assert refusal.code == grpc.StatusCode.UNAVAILABLE
            assert "daemon is unavailable" in refusal.message
            async with restarted(first, runner, old_pool, "--model-config", str(config_path),
                                 "--num-blocks", "64"):
                with pytest.raises(SessionExpired, match="before a daemon restart"):
                    await runner.step(stale, [SeqStep(1, PROMPTS[0], new_sequence=True,
                                                 params=GREEDY)])
                async with await pool.open_session("after-restart") as session:
                    tokens = await greedy(runner, session, PROMPTS[:1])
    assert tokens == [expected(reference, PROMPTS[0])]


async def refusal_once_noticed(runner: RunnerClient, session: Session,
                               step: SeqStep) -> PagedKVError:
    """The runner's answer to `step` once it noticed that its daemon is gone: until its watcher
    does, the runner's own call to the daemon fails, relayed as DaemonUnavailable."""
    for _ in range(100):  # the watcher asks the daemon every second
        with pytest.raises(PagedKVError) as failure:
            await runner.step(session, [step])
        if not isinstance(failure.value, DaemonUnavailable):
            return failure.value
        await asyncio.sleep(0.1)
    raise AssertionError("the runner never noticed that its daemon is gone")


async def test_stop_tokens_and_max_tokens_finish_a_sequence(
        clients: tuple[PoolClient, RunnerClient], reference: PreTrainedModel) -> None:
    pool, runner = clients
    want = expected(reference, PROMPTS[1])
    stop = SamplingParams(temperature=0.0, stop_token_ids=(want[2],), max_tokens=100)
    short = SamplingParams(temperature=0.0, max_tokens=2)
    async with await pool.open_session("stops") as session:
        outs = await runner.step(session, [SeqStep(1, PROMPTS[1], True, params=stop),
                                           SeqStep(2, PROMPTS[1], True, params=short)])
        finished = [[out.finished for out in outs]]
        for _ in range(2):
            outs = await runner.step(session, [SeqStep(o.seq_id, [o.token_id],
                                                       params=stop if o.seq_id == 1 else short)
                                               for o in outs])
            finished.append([out.finished for out in outs])
    first_stop = want.index(want[2])  # the stop token may also come earlier
    assert [row[0] for row in finished] == [i >= first_stop for i in range(3)]
    assert [row[1] for row in finished] == [False, True, True]


def test_a_local_model_directory_is_served(daemon: Pagedkvd, reference: PreTrainedModel,
                                           config_path: Path, tmp_path: Path) -> None:
    """--model PATH: config and safetensors weights from a local folder, nothing downloaded. A
    folder of the name of the daemon's model folder registers as the daemon's own model (the
    clients' sessions name none)."""
    folder = tmp_path / config_path.parent.name
    reference.save_pretrained(folder)
    assert (folder / "model.safetensors").exists()
    with pagedkv_runner(daemon, "--model", str(folder)) as served:
        client = start_client(daemon, served, PROMPTS[:1])
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
        tokens = json.loads(client.communicate(timeout=120)[0])
    assert tokens == [expected(reference, PROMPTS[0])]


def test_the_weights_load_in_the_dtype_asked_for(config_path: Path) -> None:
    """--dtype overrides the config's dtype (the daemon's pool is started with the same)."""
    assert load_model(ModelSource(random_init=str(config_path))).dtype == torch.float32
    assert load_model(ModelSource(random_init=str(config_path),
                                  dtype="bfloat16")).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model(ModelSource(random_init=str(config_path), dtype="int8"))


# ------------------------------------------------ a runner restart under a client

# How often a direct Free asks again while a runner holds the session (0.05 s apart; a hold
# lasts 5 s at most past the runner's last forward).
HOLD_POLLS = 200


@pytest.fixture
def listen() -> Iterator[str]:
    """A runner socket path that outlives one runner process."""
    with short_tmp_dir() as folder:
        yield f"unix://{folder / 'runner.sock'}"


async def test_engine_requests_finish_with_identical_tokens_across_a_runner_restart(
        daemon: Pagedkvd, config_path: Path, reference: PreTrainedModel, listen: str) -> None:
    """SIGKILL the runner while three requests decode (ahead), start another on the same
    socket: the engine's step fails without an answer, the link sees a new runner_id and
    resends it with histories; every request ends with transformers' tokens. (The engine
    sends every step here: a runner killed while it follows the session is
    tests/client/engine/test_follow.py's.)"""
    with contextlib.ExitStack() as runners:
        first = runners.enter_context(pagedkv_runner(daemon, "--random-init", str(config_path),
                                                     *KILLED_RUNNER_ARGS, listen=listen))
        async with await Engine.connect(daemon.unix_target, listen, lease_ttl_ms=LEASE_MS,
                                        config=SchedulerConfig(follow=False)) as engine:
            others = [asyncio.create_task(engine.generate(p, GREEDY)) for p in PROMPTS[1:]]
            restarted_at = 0
            async for output in engine.stream(PROMPTS[0], GREEDY):
                done = len(output.outputs[0].token_ids)
                if not restarted_at and done >= 4:
                    first.stop(signal.SIGKILL)
                    runners.enter_context(pagedkv_runner(daemon, "--random-init",
                                                         str(config_path), *KILLED_RUNNER_ARGS,
                                                         listen=listen))
                    restarted_at = done
                final = output
            results = [final, *await asyncio.gather(*others)]
            assert engine.link.restarts >= 1
            # its steps ran on a stream, reopened on the new runner
            assert engine.runner.streams[engine.session.session_id].opened >= 2
            stats = (await engine.session.stats()).session
    assert 4 <= restarted_at < RESTART_NEW_TOKENS
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert list(result.outputs[0].token_ids) == hf_greedy(reference, prompt, RESTART_NEW_TOKENS)
    assert stats is not None
    assert stats.num_sequences == 0  # every sequence released, none left behind by the restart


async def greedy_step(link: RunnerLink, seqs: list[Seq]) -> None:
    """One step of every sequence (a prefill first), as the engine's scheduler sends it."""
    outputs = await link.step(seqs, [seq.step() for seq in seqs], ())
    for seq, out in zip(seqs, outputs, strict=True):
        seq.stepped(out)
        seq.record(out, None)


def new_seqs() -> list[Seq]:
    return [Seq(i, list(p), len(p), GREEDY) for i, p in enumerate(PROMPTS)]


async def test_a_restarted_runner_that_does_not_know_the_sequences_gets_their_history(
        daemon: Pagedkvd, config_path: Path, reference: PreTrainedModel, listen: str) -> None:
    """The new runner answers the next step UnknownSequence (nothing changed); the link
    resends it with each sequence's history, and the tokens go on as before, with the K/V of
    the prompts read from the daemon's pool (computed once: the new runner computes only the
    decode tokens)."""
    seqs = new_seqs()
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await pool.open_session("link", lease_ttl_ms=LEASE_MS) as session:
        with pagedkv_runner(daemon, "--random-init", str(config_path), *KILLED_RUNNER_ARGS,
                            listen=listen) as first:
            async with await RunnerClient.connect(listen) as runner:
                link = RunnerLink(runner, session, (await runner.info()).runner_id)
                for _ in range(3):
                    await greedy_step(link, seqs)
            first.stop(signal.SIGKILL)
        with pagedkv_runner(daemon, "--random-init", str(config_path), *KILLED_RUNNER_ARGS,
                            listen=listen):
            async with await RunnerClient.connect(listen) as runner:
                # a new channel: the first call reaches the new runner
                link = RunnerLink(runner, session, link.runner_id)
                computed_before = [seq.computed for seq in seqs]
                await greedy_step(link, seqs)
                assert link.restarts == 1
                # the resent step computed one token per sequence, not the prompts again
                assert [seq.computed for seq in seqs] == [n + 1 for n in computed_before]
                for _ in range(RESTART_NEW_TOKENS - 4):
                    await greedy_step(link, seqs)
                assert link.restarts == 1
            await release(session, seqs)
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        assert seq.generated == hf_greedy(reference, prompt, RESTART_NEW_TOKENS)


@pytest.mark.parametrize("known_id", [True, False], ids=["same-id", "unknown-id"])
async def test_a_step_lost_by_a_runner_that_still_runs_is_not_resent(
        daemon: Pagedkvd, runner: Pagedkvd, known_id: bool) -> None:
    """No answer, but the same runner_id answers its info (or the link never knew one): the
    runner may have applied the step and still knows the sequences, so the error stands and
    nothing is sent again. (The module's runner, which keeps running: a session of its own.)"""
    seqs = new_seqs()
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await pool.open_session(f"same-runner-{known_id}", lease_ttl_ms=LEASE_MS) as session:
        async with await RunnerClient.connect(runner.unix_target) as compute:
            runner_id = (await compute.info()).runner_id if known_id else ""
            link = RunnerLink(compute, session, runner_id)
            compute.timeout = 1e-6  # every step's deadline passes at once
            with pytest.raises(DeadlineExceeded):
                await greedy_step(link, seqs)
            assert link.restarts == 0
        await release(session, seqs, missing_ok=True)  # the step may have allocated them


async def release(session: Session, seqs: list[Seq], missing_ok: bool = False) -> None:
    """Free the sequences directly in the daemon, once the runner's hold on the session is
    over (SessionBusy until then: a step's forward may still write their blocks)."""
    for seq in seqs:
        for _ in range(HOLD_POLLS):
            try:
                with contextlib.suppress(*((NotFound,) if missing_ok else ())):
                    await session.free(seq.seq_id)
                break
            except SessionBusy:
                await asyncio.sleep(0.05)
