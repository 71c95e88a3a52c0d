"""`pagedkv serve` keeps its KV across a restart of its own daemon (server/recovery.py,
llm/services.py: the supervisor keeps the daemon's fd store, the daemon runs with restore =
auto), with real processes and the `openai` package: greedy SSE streams decode, the child
daemon gets SIGTERM (the supervisor starts the next one once it exited), or serve gets SIGHUP
(a planned upgrade: the next daemon starts in standby first and adopts once the old one
exited); the new daemon restores the pool, and every stream completes with the tokens of a run
without the restart; the prefix cache answers a prompt sent again as it did before the restart."""

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedkv.process.launch import Launched

from pagedkvd_process import short_tmp_dir, start_serve
from serve_children import DAEMON_MODULE, WAIT_S, children, health, wait_for

MODEL = "tiny-llama"
PROMPTS = [[5, 17, 33, 2, 9, 71, 4, 4], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8, 30, 31]]
# Enough that a stream outlasts the standby's start in the runner's slices (below).
NEW_TOKENS = 200
RUNNER_MODULE = b"pagedkv.model_runner"
# The supervisor's line as it SIGTERMs the old daemon of a planned upgrade.
STANDBY_READY = "upgrade: standby ready, stopping the current child"
# The runner's stops and slices while the standby starts (a few tokens a slice). A stop far
# shorter than the runner's holds (5 s, renewed at half): a standby that takes seconds to start
# (a loaded machine) must not let them lapse (HoldMayHaveLapsed: the step fails).
PAUSE_S, SLICE_S = 0.25, 0.01
# A prompt of several full blocks, sent before and after the restart: its cached share.
CACHED_PROMPT = list(range(10, 80))


@pytest.fixture
def serve() -> Iterator[tuple[Launched, int]]:
    """The server and its port; stopped cleanly at the end, leaving no pool file behind."""
    with short_tmp_dir() as folder:
        server, port = start_serve(folder, "--model", MODEL, "--num-blocks", "64", "--device",
                                   "cpu")
        with server:
            daemons = children(server, DAEMON_MODULE)
            yield server, port
            daemons += children(server, DAEMON_MODULE)
            assert server.stop() == 0, server.stderr()
    for pid in daemons:
        assert not list(Path("/dev/shm").glob(f"pagedkv-{pid}-*.kv"))


def client(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                              max_retries=0, timeout=120)


async def stream_tokens(api: openai.AsyncOpenAI, prompt: list[int],
                        first: asyncio.Event | None = None) -> str:
    """The stream's text, `first` set at its first chunk."""
    text = ""
    stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS,
                                          temperature=0, stream=True)
    async for chunk in stream:
        text += chunk.choices[0].text
        if first is not None:
            first.set()
    return text


async def cached_tokens(api: openai.AsyncOpenAI) -> int:
    answer = await api.completions.create(model=MODEL, prompt=CACHED_PROMPT, max_tokens=1,
                                          temperature=0)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


def restart_daemon(how: str, server: Launched, daemon: int) -> None:
    """A plain restart (SIGTERM to the daemon: the supervisor starts the next one once it
    exited) or a planned one (SIGHUP to serve: the next one first, in standby). The standby's
    imports take longer than the streams: until it is ready and the old daemon told to stop,
    the runner runs in short slices (stopped PAUSE_S at a time, far less than its holds last),
    so the streams are still running when the old daemon leaves."""
    if how == "sigterm":
        os.kill(daemon, signal.SIGTERM)
        return
    [runner] = children(server, RUNNER_MODULE)
    server.send(signal.SIGHUP)
    deadline = time.monotonic() + WAIT_S
    while STANDBY_READY not in server.stderr():
        assert time.monotonic() < deadline, "never: the old daemon told to stop"
        os.kill(runner, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(runner, signal.SIGCONT)
        time.sleep(SLICE_S)


@pytest.mark.parametrize("how", ["sigterm", "sighup"])
async def test_streams_go_on_through_a_daemon_upgrade(serve: tuple[Launched, int],
                                                       how: str) -> None:
    server, port = serve
    api = client(port)
    expected = [await stream_tokens(api, prompt) for prompt in PROMPTS]
    await cached_tokens(api)
    cached_before = await cached_tokens(api)
    assert cached_before > 0

    [first] = children(server, DAEMON_MODULE)
    started = [asyncio.Event() for _ in PROMPTS]
    streams = [asyncio.create_task(stream_tokens(api, prompt, event))
               for prompt, event in zip(PROMPTS, started, strict=True)]
    for event in started:
        await event.wait()
    await asyncio.to_thread(restart_daemon, how, server, first)
    assert not any(stream.done() for stream in streams)
    outputs = await asyncio.gather(*streams)  # raises if any failed
    assert outputs == expected
    # The runner may decode the last tokens within its reservations, with no daemon call:
    # the streams can end before the new daemon is up.
    await asyncio.to_thread(wait_for, "the new daemon alone", lambda: len(
        children(server, DAEMON_MODULE)) == 1 and children(server, DAEMON_MODULE) != [first])
    await asyncio.to_thread(wait_for, "/health 200", lambda: health(port)[0] == 200)
    await asyncio.to_thread(wait_for, "the engine kept",
                            lambda: '"event": "engine_kept"' in server.stderr())
    log = server.stderr()
    assert '"event": "restart snapshot restored"' in log and '"event": "engine_kept"' in log
    assert ('"event": "child upgraded"' in log) == (how == "sighup")
    assert await cached_tokens(api) == cached_before

