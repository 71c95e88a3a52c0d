"""An Engine through a daemon restart with `restore = "auto"`: real processes (a `pagedkvd`
under a supervisor that emulates systemd's fd store, tests/support/fd_store_supervisor.py, and
a `pagedkv runner`). The daemon goes while several greedy streams generate and the supervisor
starts the next one on the same pool memory:

- SIGTERM: the next daemon restores the snapshot (the state exact); the runner keeps its
  sequences;
- SIGKILL: the next daemon replays the crash log (PoolInfo.recovered_from_crash_log); the runner
  forgets its sequences' progress, the engine resends their histories, and the runner recomputes
  exactly the tokens it had computed past the daemon's committed ones.

Either way every request finishes, with the tokens a run with no restart gives."""

import asyncio
import signal
import urllib.request
from pathlib import Path

import pytest
from fd_store_supervisor import FdStoreSupervisor, restoring_daemon_args

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine

from metrics_text import sample_value
from pagedkvd_process import free_tcp_port, pagedkv_runner, short_tmp_dir
from served_model import TINY, hf_greedy, reference_model, write_config

PROMPTS = [[5, 17, 33, 2, 9, 71], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8], [40, 41, 42, 43]]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# What the next daemon logs for each way the first one goes.
RESTORED = {signal.SIGTERM: '"event": "restart snapshot restored"',
            signal.SIGKILL: "restored from the crash log"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_streams_go_on_through_a_daemon_restart(
        sig: signal.Signals, tmp_path_factory: pytest.TempPathFactory) -> None:
    config = str(write_config(TINY, tmp_path_factory))
    port = free_tcp_port()
    with short_tmp_dir() as folder:
        args = restoring_daemon_args(config, folder)
        supervisor = FdStoreSupervisor(folder)
        daemons = [supervisor.start(*args)]
        try:
            with pagedkv_runner(daemons[0], "--random-init", config,
                                "--metrics-listen", f"127.0.0.1:{port}") as runner:
                async with await Engine.connect(daemons[0].unix_target, runner.unix_target,
                                                lease_ttl_ms=60_000) as engine:
                    started = [asyncio.Event() for _ in PROMPTS]
                    streams = [asyncio.create_task(_tokens(engine, prompt, event))
                               for prompt, event in zip(PROMPTS, started, strict=True)]
                    for event in started:  # mid-generation: every stream has a token
                        await event.wait()
                    assert not any(stream.done() for stream in streams)
                    supervisor.stop(daemons[0], sig)
                    daemons.append(supervisor.start(*args))
                    assert RESTORED[sig] in daemons[1].stderr()
                    outputs = await asyncio.gather(*streams)
                runner_log, metrics = runner.stderr(), _metrics(port)
                assert supervisor.stop(daemons[1]) == 0
        finally:
            for daemon in daemons:
                daemon.stop()
            supervisor.close()
    reference = reference_model(Path(config))
    assert outputs == [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    # After SIGTERM the state was exact; a step caught in the gap may still have been
    # recomputed (its daemon call's outcome was unknown), so only a crash's figures are checked.
    if sig == signal.SIGTERM:
        return
    assert "recovered from its crash log" in runner_log
    recomputed = sample_value(metrics, "pagedkv_runner:recomputed_tokens_total")
    prefill = sample_value(metrics, "pagedkv_runner:tokens_total", kind="prefill")
    prompts = sum(map(len, PROMPTS))
    # Every prefill token beyond the prompts is a recomputed one (past the committed tokens:
    # how many depends on where the kill fell), or a resent sequence's new token in the same
    # chunk: no request was preempted and computed again from its prompt.
    assert prompts + recomputed <= prefill <= prompts + recomputed + len(PROMPTS)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


async def _tokens(engine: Engine, prompt: list[int], started: asyncio.Event) -> list[int]:
    """The stream's tokens, `started` set at its first output."""
    tokens: list[int] = []
    async for output in engine.stream(prompt, GREEDY):
        tokens = list(output.outputs[0].token_ids)
        started.set()
    return tokens
