"""The supervisor (llm/supervisor.py) of a runner, with real processes: a daemon and a runner
started by `start_services(..., supervise=True)`, an engine that waits for a restarted
runner, and the runner SIGKILLed while the engine's requests decode. Every request ends with
the tokens of an uninterrupted run; the supervisor counts the restart. The same through
`pagedkv serve` (its streams through the openai client, its /metrics). Children that exit with
a bad setting, or keep dying, are not started again forever; the listeners hear each change.
A daemon's supervision through `pagedkv serve`: tests/server/test_recovery.py.
"""

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.client import Engine, SamplingParams
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.model_ref import resolve_model
from pagedkv.llm.services import Services, start_services
from pagedkv.llm.supervisor import RestartPolicy, Supervisor
from pagedkv.process.launch import READY_STATE, Launched, free_tcp_port, start_process

from pagedkvd_process import short_tmp_dir

PROMPTS = [[(7 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate((5, 17, 33))]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# Tokens of the first request at which its runner is killed.
KILL_AT = 4
# How long a test waits for the supervisor's thread to decide (a process start and exit).
DECIDE_S = 60.0


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    config = LLMConfig(model="tiny-llama", num_blocks=64, device="cpu")
    with contextlib.ExitStack() as resources:
        yield start_services(config, resolve_model("tiny-llama"), resources, supervise=True)


async def test_requests_finish_with_identical_tokens_across_a_killed_runner(
        services: Services) -> None:
    supervisor = services.runner_supervisor
    assert supervisor is not None
    first_pid = supervisor.pid
    async with await Engine.connect(services.daemon_target, services.runner_target,
                                    runner_restart_wait_s=RESTART_WAIT_S) as engine:
        uninterrupted = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
        others = [asyncio.create_task(engine.generate(p, GREEDY)) for p in PROMPTS[1:]]
        killed_at = 0
        async for output in engine.stream(PROMPTS[0], GREEDY):
            done = len(output.outputs[0].token_ids)
            if not killed_at and done >= KILL_AT:
                os.kill(first_pid, signal.SIGKILL)
                killed_at = done
            final = output
        results = [final, *await asyncio.gather(*others)]
    assert KILL_AT <= killed_at < NEW_TOKENS  # killed mid-generation
    for before, after in zip(uninterrupted, results, strict=True):
        assert len(after.outputs[0].token_ids) == NEW_TOKENS
        assert list(after.outputs[0].token_ids) == list(before.outputs[0].token_ids)
    assert supervisor.restarts == 1
    assert supervisor.pid != first_pid
    assert supervisor.failed is None


def runner_of(server: Launched) -> int:
    """The pid of the runner `pagedkv serve` started (its child running the runner module)."""
    # Any thread's children: the supervisor's thread starts the runners after the first.
    for children in Path(f"/proc/{server.process.pid}/task").glob("*/children"):
        for child in children.read_text().split():
            command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"pagedkv.model_runner" in command:
                return int(child)
    raise LookupError("the server has no runner child")


def test_pagedkv_serve_streams_finish_with_identical_tokens_across_a_killed_runner() -> None:
    with short_tmp_dir() as folder:
        port = free_tcp_port()
        server = start_process("server", [sys.executable, "-m", "pagedkv.cli", "serve", "--model",
                                          "tiny-llama", "--num-blocks", "128", "--device", "cpu",
                                          "--port", str(port), "--log-format", "json"],
                               folder, f"http://127.0.0.1:{port}")
        with server:
            server.wait_for_notification(READY_STATE, DECIDE_S)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                   max_retries=0, timeout=DECIDE_S)
            uninterrupted = [client.completions.create(
                model="tiny-llama", prompt=p, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
                for p in PROMPTS]
            first_runner = runner_of(server)
            tokens: list[list[int]] = [[] for _ in PROMPTS]
            at_kill: list[int] = []
            lock = threading.Lock()

            def stream(index: int) -> None:
                chunks = client.completions.create(
                    model="tiny-llama", prompt=PROMPTS[index], max_tokens=NEW_TOKENS,
                    temperature=0, stream=True, extra_body={"return_token_ids": True})
                for chunk in chunks:
                    with lock:
                        tokens[index] += chunk.choices[0].model_extra["token_ids"]
                        if not at_kill and all(len(t) >= KILL_AT for t in tokens):
                            os.kill(first_runner, signal.SIGKILL)  # every stream is going
                            at_kill.extend(len(t) for t in tokens)

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                for done in [pool.submit(stream, i) for i in range(len(PROMPTS))]:
                    done.result()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as reply:
                samples = {sample.name: sample.value for family in
                           text_string_to_metric_families(reply.read().decode())
                           for sample in family.samples}
            new_runner = runner_of(server)
            assert server.stop() == 0
    assert all(KILL_AT <= n < NEW_TOKENS for n in at_kill)  # killed mid-generation
    assert tokens == uninterrupted
    assert samples["pagedkv:runner_restarts"] == 1
    assert new_runner != first_runner


def exiting(folder: Path, status: int) -> Launched:
    """A process that exits with `status` at once, in place of a runner."""
    return start_process("runner", [sys.executable, "-c", f"raise SystemExit({status})"],
                         folder, f"unix://{folder}/none.sock")


def wait_until_given_up(supervisor: Supervisor) -> str:
    deadline = time.monotonic() + DECIDE_S
    while supervisor.failed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert supervisor.failed is not None, "the supervisor never gave up"
    return supervisor.failed


def test_a_runner_that_exits_with_a_bad_setting_is_not_started_again() -> None:
    with short_tmp_dir() as folder:
        started: list[Launched] = []

        def start() -> Launched:
            started.append(exiting(folder, 2))
            return started[-1]

        supervisor = Supervisor(start, exiting(folder, 2), startup_timeout_s=DECIDE_S)
        told: list[tuple[bool, str | None]] = []
        supervisor.listeners.append(lambda: told.append((supervisor.up, supervisor.failed)))
        assert supervisor.up  # the child given is ready
        supervisor.start()
        assert "status 2" in wait_until_given_up(supervisor)
        assert supervisor.stop() == 2
    assert started == []
    assert supervisor.restarts == 0
    assert not supervisor.up and supervisor.last_exit == 2
    assert told == [(False, None), (False, supervisor.failed)]  # down, then given up


def test_a_runner_that_keeps_dying_is_restarted_up_to_the_bound() -> None:
    with short_tmp_dir() as folder:
        supervisor = Supervisor(lambda: exiting(folder, 1), exiting(folder, 1),
                                startup_timeout_s=DECIDE_S,
                                policy=RestartPolicy(max_per_minute=2, backoff_base_s=0.01))
        supervisor.start()
        assert "3 times within 60 s" in wait_until_given_up(supervisor)
        assert supervisor.stop() == 1
    assert supervisor.restarts == 2


def test_the_backoff_grows_with_the_restarts_in_the_window() -> None:
    policy = RestartPolicy(backoff_base_s=0.1, backoff_max_s=2.0)
    assert [policy.backoff_s(n) for n in range(5)] == [0.0, 0.1, 0.4, 1.6, 2.0]
