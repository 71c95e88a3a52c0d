"""The daemon of `pagedkv serve` SIGKILLed (issue 31): how long the server is down, what its
clients see meanwhile, and how fast an idle server stops.

Through the server: `pagedkv serve --model tiny-llama` (CPU) with its own daemon and runner.
Each round, STREAMS greedy streams are decoding when the daemon is SIGKILLed; its supervisor
(llm/supervisor.py) reaps it and starts it again, and the server's keeper (server/recovery.py)
opens a new engine on it. Meanwhile a probe reads /health every HEALTH_POLL_S and a client sends
a short completion every CLIENT_POLL_S, as a client that retries on 503 would. Checked: every
stream ends with the retryable 503 error, every request made while down gets 503 (none hangs
or gets another status), the killed daemon leaves no zombie, /metrics counts the restarts.

Figures (medians over the rounds, from the kill):
    daemon_down_seen_ms        /health first says 503
    daemon_recovered_ms        /health says 200 again
    daemon_first_answer_ms     the retrying client's first answer
    refused_while_down_ms_max  the slowest 503 while down (a refusal, not a wait)
    refused_while_down         requests refused while down (all rounds)
    serve_sigterm_exit_s       an idle server's exit after SIGTERM (its runner, then its daemon)
    teardown_s, exit_now_s     a process that imported what the runner imports, ending with the
                               interpreter's teardown, and with process/lifecycle.exit_now (why
                               the exit above was ~2.3 s): side by side, and their ratio

Usage: python benchmarks/bench_daemon_restart.py [--rounds 3] [--streams 4] [--quick]
"""

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from e2e import PRESET, add_quick_flag, figure
from serve_process import DAEMON_MODULE, Server, start_server

SERVER_ARGS = ("--num-blocks", "256", "--device", "cpu")
HEALTH_POLL_S = 0.01
CLIENT_POLL_S = 0.05
# Long enough to be decoding at the kill.
STREAM_TOKENS = 400
# How long a round may take (a restart on a loaded machine takes seconds).
ROUND_S = 120.0
# What a process that exits measures itself against: the runner's imports.
IMPORTS = "import pagedkv.model_runner.process.server"


@dataclass
class Round:
    """What one kill looked like from the clients, in seconds from the kill."""

    down_seen: float = 0.0
    recovered: float = 0.0
    first_answer: float = 0.0
    # Latency of each request refused (503) while down.
    refusals: list[float] = field(default_factory=list)


async def one_round(server: Server, streams: int) -> Round:
    """Kill the daemon under `streams` decoding streams; what the clients saw."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ROUND_S)) as http:
        started = [asyncio.Event() for _ in range(streams)]
        decoding = [asyncio.create_task(stream_until_error(http, server, event))
                    for event in started]
        await asyncio.gather(*(event.wait() for event in started))
        daemon = server.child_pid(DAEMON_MODULE)
        os.kill(daemon, signal.SIGKILL)
        killed = time.monotonic()
        result = Round()
        async with asyncio.timeout(ROUND_S):
            health = asyncio.create_task(watch_health(http, server, killed, result))
            await retrying_client(http, server, killed, result)
            await health
            errors = await asyncio.gather(*decoding)
        if not all("retry the request" in error for error in errors):
            raise SystemExit(f"a stream did not end with the retryable error: {errors}")
        if Path(f"/proc/{daemon}").exists():
            raise SystemExit(f"the killed daemon {daemon} was not reaped")
        return result


async def stream_until_error(http: aiohttp.ClientSession, server: Server,
                             started: asyncio.Event) -> str:
    """A long greedy stream; the error event that ends it ("" if it finished)."""
    body = {"model": server.model, "prompt": [1, 2, 3], "max_tokens": STREAM_TOKENS,
            "temperature": 0.0, "stream": True}
    async with http.post(f"{server.url}/v1/completions", json=body) as reply:
        async for line in reply.content:
            started.set()
            if b'"error"' in line:
                return line.decode()
    return ""


async def watch_health(http: aiohttp.ClientSession, server: Server, killed: float,
                       result: Round) -> None:
    """Poll /health: the first 503, then the first 200 after it."""
    while True:
        async with http.get(f"{server.url}/health") as reply:
            now = time.monotonic() - killed
            if reply.status == 503 and not result.down_seen:
                result.down_seen = now
            if reply.status == 200 and result.down_seen:
                result.recovered = now
                return
        await asyncio.sleep(HEALTH_POLL_S)


async def retrying_client(http: aiohttp.ClientSession, server: Server, killed: float,
                          result: Round) -> None:
    """A short completion every CLIENT_POLL_S until one is answered; each must be a 503."""
    body = {"model": server.model, "prompt": [4, 5, 6], "max_tokens": 4, "temperature": 0.0}
    while True:
        sent = time.monotonic()
        async with http.post(f"{server.url}/v1/completions", json=body) as reply:
            await reply.read()
            if reply.status == 200:
                result.first_answer = time.monotonic() - killed
                return
            if reply.status != 503:
                raise SystemExit(f"a request while the daemon was down got {reply.status}")
            result.refusals.append(time.monotonic() - sent)
        await asyncio.sleep(CLIENT_POLL_S)


def sigterm_exit_s(server: Server) -> float:
    """An idle server's exit after SIGTERM."""
    began = time.monotonic()
    code = server.launched.stop()
    if code != 0:
        raise SystemExit(f"the server exited with status {code} after SIGTERM")
    return time.monotonic() - began


def exit_s(ending: str) -> float:
    """From the end of a process that imported IMPORTS to its exit, ending with `ending`."""
    script = f"{IMPORTS}\nimport sys, time\nsys.stderr.write(repr(time.time()))\n{ending}\n"
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True,
                           text=True)
    return time.time() - float(ended.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    add_quick_flag(parser)
    args = parser.parse_args()
    rounds, streams = (1, 1) if args.quick else (args.rounds, args.streams)
    with tempfile.TemporaryDirectory(prefix="pkv-dr-") as name:
        server = start_server(Path(name), PRESET, *SERVER_ARGS)
        with server.launched:
            results = [asyncio.run(one_round(server, streams)) for _ in range(rounds)]
            restarts = server.metric("pagedkv:daemon_restarts")
            if restarts != rounds:
                raise SystemExit(f"/metrics counts {restarts} daemon restarts, not {rounds}")
            exit_after_sigterm = sigterm_exit_s(server)
    for name, values in (("daemon_down_seen_ms", [r.down_seen for r in results]),
                         ("daemon_recovered_ms", [r.recovered for r in results]),
                         ("daemon_first_answer_ms", [r.first_answer for r in results])):
        figure(name, statistics.median(values) * 1000, "ms", 0)
    refusals = [latency for r in results for latency in r.refusals]
    figure("refused_while_down_ms_max", max(refusals, default=0.0) * 1000, "ms", 1)
    figure("refused_while_down", len(refusals), "requests", 0)
    figure("serve_sigterm_exit_s", exit_after_sigterm, "s", 2)
    teardown = statistics.median(exit_s("") for _ in range(rounds))
    exit_now = statistics.median(exit_s("from pagedkv.process.lifecycle import exit_now\n"
                                        "exit_now(0)") for _ in range(rounds))
    figure("teardown_s", teardown, "s", 2)
    figure("exit_now_s", exit_now, "s", 3)
    figure("teardown_vs_exit_now_ratio", teardown / exit_now, "ratio", 1)


if __name__ == "__main__":
    main()
