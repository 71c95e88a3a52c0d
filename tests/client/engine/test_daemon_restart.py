"""An Engine through a daemon restart with `restore = "auto"`: real processes (a `pagedkvd`
under a supervisor that emulates systemd's fd store, tests/support/fd_store_supervisor.py, and
a `pagedkv runner`). The daemon is stopped with SIGTERM while several greedy streams generate
and the supervisor starts the next one, which adopts the pool memory and restores the session:
every request finishes, with the tokens a run with no restart gives."""

import asyncio
from pathlib import Path

import pytest
from fd_store_supervisor import FdStoreSupervisor, restoring_daemon_args

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine

from pagedkvd_process import pagedkv_runner, short_tmp_dir
from served_model import TINY, hf_greedy, reference_model, write_config

PROMPTS = [[5, 17, 33, 2, 9, 71], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8], [40, 41, 42, 43]]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


async def test_streams_go_on_through_a_restored_daemon_restart(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config = str(write_config(TINY, tmp_path_factory))
    with short_tmp_dir() as folder:
        args = restoring_daemon_args(config, folder)
        supervisor = FdStoreSupervisor(folder)
        daemons = [supervisor.start(*args)]
        try:
            with pagedkv_runner(daemons[0], "--random-init", config) as runner:
                async with await Engine.connect(daemons[0].unix_target, runner.unix_target,
                                                lease_ttl_ms=60_000) as engine:
                    started = [asyncio.Event() for _ in PROMPTS]
                    streams = [asyncio.create_task(_tokens(engine, prompt, event))
                               for prompt, event in zip(PROMPTS, started, strict=True)]
                    for event in started:  # mid-generation: every stream has a token
                        await event.wait()
                    assert not any(stream.done() for stream in streams)
                    assert supervisor.stop(daemons[0]) == 0
                    daemons.append(supervisor.start(*args))
                    assert '"event": "restart snapshot restored"' in daemons[1].stderr()
                    outputs = await asyncio.gather(*streams)
                assert supervisor.stop(daemons[1]) == 0
        finally:
            for daemon in daemons:
                daemon.stop()
            supervisor.close()
    reference = reference_model(Path(config))
    assert outputs == [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]


async def _tokens(engine: Engine, prompt: list[int], started: asyncio.Event) -> list[int]:
    """The stream's tokens, `started` set at its first output."""
    tokens: list[int] = []
    async for output in engine.stream(prompt, GREEDY):
        tokens = list(output.outputs[0].token_ids)
        started.set()
    return tokens
