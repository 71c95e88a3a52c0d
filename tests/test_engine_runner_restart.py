"""A runner restart under a client (`RunnerLink`, the engine): the KV stays in the daemon, a
runner killed with SIGKILL comes back on the same socket, and the client's sequences go on with
the tokens transformers gives, without recomputing them.

Real processes: a `pagedkvd` planned from the model's config.json and `pagedkv runner`s that
random-initialize the same config with the same seed, so this process builds the identical
model for the reference."""

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd, short_tmp_dir
from transformers import LlamaConfig, PreTrainedModel

from pagedkv.client import (
    DeadlineExceeded,
    Engine,
    NotFound,
    PoolClient,
    RunnerClient,
    SamplingParams,
    Session,
)
from pagedkv.client.runner_link import RunnerLink
from pagedkv.client.sequences import Seq
from pagedkv.model_runner.models import ModelSource, load_model

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                     pad_token_id=None)
NEW_TOKENS = 16
PROMPTS = [[(7 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate((5, 17, 33))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# The test's event loop blocks while a runner process starts: leases outlast that.
LEASE_MS = 300_000


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    CONFIG.save_pretrained(folder)
    return folder / "config.json"


@pytest.fixture(scope="module")
def reference(config_path: Path) -> PreTrainedModel:
    return load_model(ModelSource(random_init=str(config_path), seed=0))


@pytest.fixture(scope="module")
def daemon(config_path: Path) -> Iterator[Pagedkvd]:
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "128") as running:
        yield running


@pytest.fixture
def listen() -> Iterator[str]:
    """A runner socket path that outlives one runner process."""
    with short_tmp_dir() as folder:
        yield f"unix://{folder / 'runner.sock'}"


def expected(reference: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    output = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False)
    return list(output[0, len(prompt):].tolist())


async def test_engine_requests_finish_with_identical_tokens_across_a_runner_restart(
        daemon: Pagedkvd, config_path: Path, reference: PreTrainedModel, listen: str) -> None:
    """SIGKILL the runner while three requests decode (ahead), start another on the same
    socket: the engine's step fails without an answer, the link sees a new runner_id and
    resends it with histories; every request ends with transformers' tokens."""
    with contextlib.ExitStack() as runners:
        first = runners.enter_context(pagedkv_runner(daemon, "--random-init", str(config_path),
                                                     listen=listen))
        async with await Engine.connect(daemon.unix_target, listen,
                                        lease_ttl_ms=LEASE_MS) as engine:
            others = [asyncio.create_task(engine.generate(p, GREEDY)) for p in PROMPTS[1:]]
            restarted_at = 0
            async for output in engine.stream(PROMPTS[0], GREEDY):
                done = len(output.outputs[0].token_ids)
                if not restarted_at and done >= 4:
                    first.stop(signal.SIGKILL)
                    runners.enter_context(pagedkv_runner(daemon, "--random-init",
                                                         str(config_path), listen=listen))
                    restarted_at = done
                final = output
            results = [final, *await asyncio.gather(*others)]
            assert engine.link.restarts >= 1
            stats = (await engine.session.stats()).session
    assert 4 <= restarted_at < NEW_TOKENS
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert list(result.outputs[0].token_ids) == expected(reference, prompt, NEW_TOKENS)
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
        with pagedkv_runner(daemon, "--random-init", str(config_path), listen=listen) as first:
            async with await RunnerClient.connect(listen) as runner:
                link = RunnerLink(runner, session, (await runner.info()).runner_id)
                for _ in range(3):
                    await greedy_step(link, seqs)
            first.stop(signal.SIGKILL)
        with pagedkv_runner(daemon, "--random-init", str(config_path), listen=listen):
            async with await RunnerClient.connect(listen) as runner:
                # a new channel: the first call reaches the new runner
                link = RunnerLink(runner, session, link.runner_id)
                computed_before = [seq.computed for seq in seqs]
                await greedy_step(link, seqs)
                assert link.restarts == 1
                # the resent step computed one token per sequence, not the prompts again
                assert [seq.computed for seq in seqs] == [n + 1 for n in computed_before]
                for _ in range(NEW_TOKENS - 4):
                    await greedy_step(link, seqs)
                assert link.restarts == 1
            await release(session, seqs)
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        assert seq.generated == expected(reference, prompt, NEW_TOKENS)


async def test_a_step_lost_by_a_runner_that_still_runs_is_not_resent(
        daemon: Pagedkvd, config_path: Path, listen: str) -> None:
    """No answer, but the same runner_id answers its info: the runner may have applied the
    step and still knows the sequences, so the error stands and nothing is sent again."""
    seqs = new_seqs()
    async with await PoolClient.connect(daemon.unix_target) as pool, \
            await pool.open_session("same-runner", lease_ttl_ms=LEASE_MS) as session:
        with pagedkv_runner(daemon, "--random-init", str(config_path), listen=listen):
            async with await RunnerClient.connect(listen) as runner:
                link = RunnerLink(runner, session, (await runner.info()).runner_id)
                runner.timeout = 1e-6  # every step's deadline passes at once
                with pytest.raises(DeadlineExceeded):
                    await greedy_step(link, seqs)
                assert link.restarts == 0
            await release(session, seqs, missing_ok=True)  # the step may have allocated them


async def release(session: Session, seqs: list[Seq], missing_ok: bool = False) -> None:
    for seq in seqs:
        with contextlib.suppress(*((NotFound,) if missing_ok else ())):
            await session.free(seq.seq_id)
