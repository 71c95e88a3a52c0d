"""`pagedkv serve` as a process for the benchmarks, and a streaming client of its completions.

    with served(folder, "--model", "tiny-llama", "--num-blocks", "2048") as server:
        async with aiohttp.ClientSession() as http:
            async for token_ids in stream_completion(http, server, prompt, max_tokens=64):
                ...                                  # each SSE chunk's new token ids
        os.kill(server.child_pid(RUNNER_MODULE), signal.SIGKILL)   # its runner, for instance
        server.metric("pagedkv:runner_restarts")

The server starts its own daemon and runner (children of its process) and says READY=1 once
its port listens (process/launch.py waits for it, as for the daemon and the runner).
"""

import contextlib
import json
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.process.launch import (
    READY_STATE,
    START_TIMEOUT_S,
    Launched,
    free_tcp_port,
    start_process,
)

SERVE_COMMAND = (sys.executable, "-m", "pagedkv.cli", "serve")
# The module names in the command lines of the server's children.
RUNNER_MODULE = "pagedkv.model_runner"
DAEMON_MODULE = "pagedkv.daemon"


@dataclass(frozen=True)
class Server:
    """A started `pagedkv serve`."""

    launched: Launched
    port: int
    # The `model` requests name (the server's --model).
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def child_pid(self, module: str) -> int:
        """The pid of the server's child process running `module` (its daemon or runner)."""
        pid = self.launched.process.pid
        # Any thread's children: its runner supervisor's thread starts the restarted runners.
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            for child in children.read_text().split():
                command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                if module.encode() in command:
                    return int(child)
        raise LookupError(f"the server (pid {pid}) has no {module} child")

    def metric(self, name: str) -> float:
        """The sum of the samples named `name` on the server's /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == name)


def start_server(folder: Path, model: str, *args: str,
                 timeout: float = START_TIMEOUT_S) -> Server:
    """`pagedkv serve --model MODEL ARGS` on a free loopback port, logging warnings and up, its
    log and notify socket in `folder`, and its children's private folder there too (so that
    removing `folder` removes it, even after a SIGKILL); once its port listens (NoNotification,
    the server stopped, when it does not within `timeout` seconds)."""
    port = free_tcp_port()
    launched = start_process("pagedkv-serve", [*SERVE_COMMAND, "--model", model, "--port",
                                               str(port), "--log-level", "warning",
                                               "--log-format", "json", *args],
                             folder, f"http://127.0.0.1:{port}", env={"TMPDIR": str(folder)})
    try:
        launched.wait_for_notification(READY_STATE, timeout)
    except BaseException:
        launched.stop()  # SIGTERM (SIGKILL if it lingers): it stops what it started, if it can
        raise
    return Server(launched, port, model)


@contextlib.contextmanager
def served(folder: Path, model: str, *args: str,
           timeout: float = START_TIMEOUT_S) -> Iterator[Server]:
    """`start_server`, stopped (SIGTERM: it drains, then stops its runner and daemon) on exit."""
    server = start_server(folder, model, *args, timeout=timeout)
    with server.launched:
        yield server
        server.launched.stop()


async def stream_completion(http: aiohttp.ClientSession, server: Server, prompt: Sequence[int],
                            max_tokens: int) -> AsyncIterator[list[int]]:
    """A greedy streamed completion of the token ids `prompt`: each chunk's token ids."""
    body = {"model": server.model, "prompt": list(prompt), "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "return_token_ids": True}
    async with http.post(f"{server.url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            data = line.strip().removeprefix(b"data: ")
            if data == b"[DONE]":
                return
            if data:
                for choice in json.loads(data)["choices"]:
                    yield choice["token_ids"]
