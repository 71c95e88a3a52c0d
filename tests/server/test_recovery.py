"""The server's engine across a daemon's death (server/recovery.py), with real processes:
`pagedkv serve` with its own daemon and runner, the daemon SIGKILLed while a stream decodes.
The dead daemon is reaped (no zombie, its pool file removed), the stream ends with a retryable
503, /health says 503 with the reason while the daemon is down and a request made then gets 503
at once (not a hang), the running counts are not stale, and once the supervisor restarted the
daemon the server serves again through the `openai` client. In process: a supervisor that gives
up ends the keeper's watch with its reason (the server then exits 1).
"""

import asyncio
import os
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.waiters import Waiters
from pagedkv.llm.supervisor import Supervisor
from pagedkv.process.launch import READY_STATE, Launched, free_tcp_port, start_process
from pagedkv.server.backend import Backend, ServeConfig
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.recovery import EngineKeeper

from failing_engine import FailingEngine
from pagedkvd_process import short_tmp_dir
from serve_children import DAEMON_MODULE, WAIT_S, children, health, wait_for

MODEL = "tiny-llama"
# The client's timeout for a request made while the daemon is down: a 503 comes at once.
DOWN_REQUEST_S = 10.0


@pytest.fixture(params=["", "sk-test"], ids=["no-keys", "api-key"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Launched, int, str]]:
    """A server with its own daemon and runner; its API key ("": none, one engine serves
    every request; else the key's cache group has an engine of its own: key_engines.py)."""
    key: str = request.param
    with short_tmp_dir() as folder:
        port = free_tcp_port()
        launched = start_process("server", [sys.executable, "-m", "pagedkv.cli", "serve",
                                            "--model", MODEL, "--num-blocks", "64", "--device",
                                            "cpu", "--port", str(port), "--log-format", "json",
                                            *(["--api-key", key] if key else [])],
                                 folder, f"http://127.0.0.1:{port}")
        with launched:
            launched.wait_for_notification(READY_STATE, WAIT_S)
            yield launched, port, key


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return {sample.name: sample.value for family in
                text_string_to_metric_families(reply.read().decode())
                for sample in family.samples}


def is_gone(pid: int) -> bool:
    """Reaped: no /proc entry (a zombie keeps one, in state Z)."""
    return not Path(f"/proc/{pid}").exists()


def test_a_killed_daemon_is_reaped_restarted_and_served_again(
        server: tuple[Launched, int, str]) -> None:
    launched, port, key = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key or "none",
                           max_retries=0, timeout=WAIT_S)
    assert health(port) == (200, "ok\n")
    [first] = children(launched, DAEMON_MODULE)
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=900,
                                       temperature=0, stream=True)
    next(iter(stream))  # the request decodes
    os.kill(first, signal.SIGKILL)
    with pytest.raises(openai.APIError) as failed:
        for _ in stream:
            pass
    assert "retry the request" in str(failed.value)

    # Hold the new daemon before its READY=1, so the server stays without one for the checks.
    wait_for("a new daemon", lambda: any(p != first for p in children(launched,
                                                                      DAEMON_MODULE)))
    [second] = children(launched, DAEMON_MODULE)
    os.kill(second, signal.SIGSTOP)
    try:
        wait_for("the killed daemon reaped", lambda: is_gone(first))
        status, reason = health(port)
        assert status == 503 and "pagedkvd exited" in reason
        with pytest.raises(openai.APIStatusError) as refused:
            client.with_options(timeout=DOWN_REQUEST_S).completions.create(
                model=MODEL, prompt=[1, 2, 3], max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["Retry-After"] == "1"
        figures = metrics(port)
        assert figures["pagedkv:num_requests_running"] == 0
        assert figures["pagedkv:num_requests_waiting"] == 0
    finally:
        os.kill(second, signal.SIGCONT)

    wait_for("/health 200 again", lambda: health(port)[0] == 200)
    answer = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4,
                                       temperature=0)
    assert answer.choices[0].finish_reason == "length"
    figures = metrics(port)
    assert figures["pagedkv:daemon_restarts"] == 1
    assert figures["pagedkv:num_requests_running"] == 0
    assert not list(Path("/dev/shm").glob(f"pagedkv-{first}-*.kv"))  # the new daemon's cleanup
    assert launched.stop() == 0
    assert is_gone(second)


class LostEngine(FailingEngine):
    """A stand-in engine with what the keeper uses of one its daemon took along."""

    def __init__(self) -> None:
        self.waiters = Waiters()
        self.closed = False
        self.pool_id = ""

    async def close(self) -> None:
        self.closed = True


async def test_a_supervisor_that_gives_up_ends_the_watch_with_its_reason() -> None:
    engine = LostEngine()
    backend = Backend(cast(Engine, engine), None, "a preset", ServeConfig("m"), ServerMetrics("m"))
    with short_tmp_dir() as folder:
        bad = start_process("pagedkvd", [sys.executable, "-c", "raise SystemExit(2)"], folder,
                            f"unix://{folder}/none.sock")
        supervisor = Supervisor(lambda: bad, bad, startup_timeout_s=WAIT_S)
        keeper = EngineKeeper(backend, lambda: asyncio.sleep(0, backend.engine), supervisor, None)
        supervisor.start()
        failed = await asyncio.wait_for(keeper.watch_until(asyncio.Event()), WAIT_S)
        supervisor.stop()
        await keeper.close()
    assert failed is not None and "status 2 (a bad setting)" in failed
    assert backend.down == failed
    assert backend.unhealthy() == failed
    assert engine.closed
    assert not supervisor.listeners
