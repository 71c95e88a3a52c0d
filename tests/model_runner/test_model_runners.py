"""Two runners of one geometry and different weights on one daemon, as real processes: a base
model and a "fine-tune" (the same config, another seed), registered under two names
(kvpool.proto's "Models and pages"). Each gives transformers' greedy tokens for its own weights;
a prompt one model cached is no hit for the other; clients find a runner by model name; a
session of one model is refused by the other's runner; a restarted runner registers again.
"""

import json
import signal
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from pagedkv.client import (
    Engine,
    InvalidArgument,
    ModelNotFound,
    PoolClient,
    RunnerClient,
    SamplingParams,
    SeqStep,
    Session,
)
from pagedkv.llm import LLM
from pagedkv.model_runner.models import ModelSource, load_model
from pagedkv.process.launch import READY_STATE, free_tcp_port, start_process
from pagedkv.vocab.geometry import model_name

from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd, restarted, short_tmp_dir
from served_model import TINY, hf_greedy, write_config

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# Two full blocks of 16 and a token: what a later prompt can find cached.
PROMPT = [(5 * j + 1) % 128 for j in range(33)]
CACHED = 32
# The fine-tune's seed (the base's is 0).
TUNED_SEED = 1


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(TINY, tmp_path_factory)


def model_of(config_path: Path, seed: int) -> PreTrainedModel:
    return load_model(ModelSource(random_init=str(config_path), seed=seed))


@pytest.fixture(scope="module")
def references(config_path: Path) -> dict[str, PreTrainedModel]:
    return {"base": model_of(config_path, 0), "tuned": model_of(config_path, TUNED_SEED)}


@pytest.fixture(scope="module")
def daemon(config_path: Path) -> Iterator[Pagedkvd]:
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "128") as running:
        yield running


@pytest.fixture(scope="module")
def tuned_listen() -> Iterator[str]:
    with short_tmp_dir() as folder:
        yield f"unix://{folder}/tuned.sock"


@pytest.fixture(scope="module")
def runners(daemon: Pagedkvd, config_path: Path,
            tuned_listen: str) -> Iterator[dict[str, Pagedkvd]]:
    with pagedkv_runner(daemon, "--random-init", str(config_path), "--model-name",
                        "base") as base, \
            pagedkv_runner(daemon, "--random-init", str(config_path), "--seed",
                           str(TUNED_SEED), "--model-name", "tuned",
                           listen=tuned_listen) as tuned:
        yield {"base": base, "tuned": tuned}


@pytest.fixture
async def pool(daemon: Pagedkvd) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target) as client:
        yield client


async def generate(runner: RunnerClient, session: Session, seq_id: int = 1) -> list[int]:
    """Greedy tokens of PROMPT, the sequence released at the end."""
    (out,) = await runner.step(session, [SeqStep(seq_id, PROMPT, new_sequence=True,
                                                 params=GREEDY)])
    tokens = [out.token_id]
    while len(tokens) < NEW_TOKENS:
        last = len(tokens) == NEW_TOKENS - 1
        (out,) = await runner.step(session, [SeqStep(seq_id, [tokens[-1]])],
                                   release=[seq_id] if last else [])
        tokens.append(out.token_id)
    return tokens


async def cache_hits(session: Session) -> int:
    stats = (await session.stats()).session
    assert stats is not None
    return stats.prefix_cache_hits


def test_a_model_is_named_after_its_preset_or_folder(config_path: Path) -> None:
    assert model_name("tiny-llama") == "tiny-llama"
    assert model_name(str(config_path)) == config_path.parent.name
    assert model_name(str(config_path.parent)) == config_path.parent.name


async def test_each_runner_gives_its_own_weights_tokens(
        pool: PoolClient, runners: dict[str, Pagedkvd],
        references: dict[str, PreTrainedModel]) -> None:
    expected = {name: hf_greedy(model, PROMPT, NEW_TOKENS) for name, model in references.items()}
    assert expected["base"] != expected["tuned"]  # else this test could not tell them apart
    info = await pool.pool_info()
    registered = {m.name: m for m in info.models}
    assert {"base", "tuned", info.model} <= set(registered)  # and the daemon's own
    assert {"base", "tuned"} <= {m.name for m in (await pool.stats()).models}
    assert registered["base"].runner_target == runners["base"].unix_target
    assert registered["base"].bytes_per_block == registered["tuned"].bytes_per_block
    for name, process in runners.items():
        async with await RunnerClient.connect(process.unix_target) as runner:
            assert (await runner.info()).model_name == name
            async with await pool.open_session(name, model=name) as session:
                assert session.model == name
                assert await generate(runner, session) == expected[name]


async def test_one_models_cached_prompt_is_no_hit_for_the_other(
        pool: PoolClient, runners: dict[str, Pagedkvd],
        references: dict[str, PreTrainedModel]) -> None:
    """The same prompt under the same cache salt: computed by base, then asked by tuned, it is
    computed again with tuned's weights (a hit would give tuned base's K/V); asked by tuned
    again, it hits tuned's own blocks."""
    expected = hf_greedy(references["tuned"], PROMPT, NEW_TOKENS)
    salt = "shared-prefix"
    async with await RunnerClient.connect(runners["base"].unix_target) as base, \
            await RunnerClient.connect(runners["tuned"].unix_target) as tuned:
        async with await pool.open_session("b", cache_salt=salt, model="base") as session:
            await generate(base, session)
        async with await pool.open_session("t1", cache_salt=salt, model="tuned") as session:
            assert await generate(tuned, session) == expected
            assert await cache_hits(session) == 0
        async with await pool.open_session("t2", cache_salt=salt, model="tuned") as session:
            assert await generate(tuned, session) == expected
            assert await cache_hits(session) == CACHED


async def test_a_session_of_another_model_is_refused_before_anything_changes(
        pool: PoolClient, runners: dict[str, Pagedkvd]) -> None:
    """The attack: a client opens a session of model base and steps it on tuned's runner,
    which would write tuned's K/V into base's blocks (under base's prefix keys, once
    committed). The runner asks the daemon for the session's model and refuses."""
    async with await RunnerClient.connect(runners["tuned"].unix_target) as tuned:
        for model in ("base", ""):  # "" = the daemon's own model
            async with await pool.open_session("intruder", model=model) as session:
                with pytest.raises(InvalidArgument) as refused:
                    await tuned.step(session, [SeqStep(1, PROMPT, new_sequence=True,
                                                       params=GREEDY)])
                assert f"holds model {session.model!r}'s K/V" in refused.value.message
                assert "computes model 'tuned'" in refused.value.message
                stats = (await session.stats()).session
                assert stats is not None and stats.num_sequences == 0  # nothing allocated


async def test_engine_finds_the_runner_by_model_name(
        daemon: Pagedkvd, runners: dict[str, Pagedkvd],
        references: dict[str, PreTrainedModel]) -> None:
    async with await Engine.connect(daemon.unix_target, model="tuned") as engine:
        assert engine.session.model == "tuned"
        output = await engine.generate(PROMPT, GREEDY)
    assert list(output.outputs[0].token_ids) == hf_greedy(references["tuned"], PROMPT,
                                                          NEW_TOKENS)
    async with await Engine.connect(daemon.unix_target, runners["base"].unix_target) as engine:
        assert engine.session.model == "base"  # the runner's model, not the daemon's own
    with pytest.raises(ValueError, match=r"'nobody' is not registered.*'base', 'tuned'"):
        await Engine.connect(daemon.unix_target, model="nobody")
    with pytest.raises(ValueError, match="serves model 'base', not 'tuned'"):
        await Engine.connect(daemon.unix_target, runners["base"].unix_target, model="tuned")
    async with await PoolClient.connect(daemon.unix_target) as pool:
        with pytest.raises(ModelNotFound, match="nobody"):
            await pool.open_session(model="nobody")


def test_a_taken_name_with_another_geometry_is_refused_at_start(
        daemon: Pagedkvd, config_path: Path, runners: dict[str, Pagedkvd]) -> None:
    with pagedkv_runner(daemon, "--random-init", str(config_path), "--dtype", "float16",
                        "--model-name", "base", wait_ready=False) as refused:
        assert refused.process.wait(120) == 2
        message = refused.stderr()
    assert "refused to register model 'base'" in message, message


def test_llm_and_serve_find_the_runner_of_a_model_name(
        daemon: Pagedkvd, runners: dict[str, Pagedkvd],
        references: dict[str, PreTrainedModel]) -> None:
    """`LLM(daemon=..., model_name=...)` and `pagedkv serve --daemon ...` without --runner use
    the runner that registered the name (the served name, for the server)."""
    expected = hf_greedy(references["tuned"], PROMPT, NEW_TOKENS)
    with LLM(daemon=daemon.unix_target, model_name="tuned") as llm:
        (output,) = llm.generate([PROMPT], GREEDY, progress=False)
    assert list(output.outputs[0].token_ids) == expected
    with short_tmp_dir() as folder:
        port = free_tcp_port()
        server = start_process("server", [
            sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--model", "tiny",
            "--served-model-name", "tuned", "--daemon", daemon.unix_target], folder,
            f"http://127.0.0.1:{port}")
        try:
            server.wait_for_notification(READY_STATE, 120)
            body = {"model": "tuned", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "return_token_ids": True}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                             json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        finally:
            assert server.stop() == 0, server.stderr()
    assert answer["choices"][0]["token_ids"] == expected


async def test_a_restarted_runner_registers_again(
        daemon: Pagedkvd, config_path: Path, runners: dict[str, Pagedkvd], tuned_listen: str,
        references: dict[str, PreTrainedModel]) -> None:
    """SIGKILL tuned's runner and start it again on its socket: it registers the same name
    and geometry again (idempotent), and its clients go on by name."""
    runners["tuned"].stop(signal.SIGKILL)
    with pagedkv_runner(daemon, "--random-init", str(config_path), "--seed", str(TUNED_SEED),
                        "--model-name", "tuned", listen=tuned_listen):
        async with await PoolClient.connect(daemon.unix_target) as pool:
            names = [m.name for m in (await pool.pool_info()).models]
            assert names.count("tuned") == 1
        async with await Engine.connect(daemon.unix_target, model="tuned") as engine:
            output = await engine.generate(PROMPT, GREEDY)
    assert list(output.outputs[0].token_ids) == hf_greedy(references["tuned"], PROMPT,
                                                          NEW_TOKENS)


async def test_a_runner_registers_again_with_a_restarted_daemon(
        config_path: Path, references: dict[str, PreTrainedModel]) -> None:
    """A new daemon knows only its own model: the runner's watcher registers "tuned" again
    with the new pool, so its clients open sessions of it as before (ModelNotFound else)."""
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "64") as first, \
            pagedkv_runner(first, "--random-init", str(config_path), "--seed", str(TUNED_SEED),
                           "--model-name", "tuned") as process:
        async with await RunnerClient.connect(process.unix_target) as runner, \
                await PoolClient.connect(first.unix_target) as pool:
            old_pool = (await runner.info()).pool_id
            assert first.stop() == 0
            async with restarted(first, runner, old_pool, "--model-config", str(config_path),
                                 "--num-blocks", "64"):
                assert "tuned" in {m.name for m in (await pool.pool_info()).models}
                async with await pool.open_session("after", model="tuned") as session:
                    tokens = await generate(runner, session)
    assert tokens == hf_greedy(references["tuned"], PROMPT, NEW_TOKENS)
