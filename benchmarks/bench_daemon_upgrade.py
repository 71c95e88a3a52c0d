"""`pagedkv serve`'s own daemon restarted under its clients (issue 34): the streams' pause when
the next daemon restores the pool (as shipped), beside the same restart when it starts cold.

Through the server: `pagedkv serve` (CPU) on the example model (`pagedkv example-model`, written
into the run's folder: max_model_len 512), with its own daemon and runner. Each round, STREAMS
greedy SSE streams (the `openai` package, async) of PROMPT_TOKENS-token prompts decode TOKENS
tokens each while the child daemon is restarted. Upgrade round: SIGHUP to serve (its planned
upgrade: the next daemon starts in standby, the current one gets SIGTERM once it is ready, and
the standby adopts the pool and restores the snapshot); the restart counts from the old daemon's
exit. SIGTERM round: SIGTERM to the daemon child; its supervisor starts the next one once it
exited, which restores the snapshot. In both, the streams pause and go on. Cold round: SIGTERM
to the daemon child, and the bench removes the snapshot once the old daemon has exited (before
the next one reads it, seconds later), so the next one starts cold: the streams fail with the
retryable 503 and the bench sends each again (as a client would, every RESEND_POLL_S) until it
streams. (Not the planned path: its standby reads the snapshot within milliseconds of the old
daemon's exit, too soon for the bench to remove it; so the cold gap includes the next daemon's
process start, as the SIGTERM one does.) Every round runs on one server, one after the other.

Figures:
    daemon_upgrade_gap_ms            the longest pause between two consecutive chunks of any
                                     stream across the planned upgrade (SIGHUP)
    daemon_sigterm_restart_gap_ms    the same across the SIGTERM restart
    daemon_cold_restart_gap_ms       the longest from a stream's last chunk before the restart to
                                     the first chunk of its resent stream
    daemon_upgrade_gap_ratio         upgrade / cold (goal <= 0.25)
    requests_failed_during_upgrade   streams that ended in an error in the upgrade and SIGTERM
                                     rounds (goal 0)
    prefix_hits_after_upgrade_frac   cached prompt tokens of the same prompts after both
                                     restored restarts over before them (goal >= 0.99)

Usage: python benchmarks/bench_daemon_upgrade.py [--streams 32] [--tokens 192] [--quick]
(about 40 s on a 2-core host; --quick: 4 streams of 24 tokens, a check of the script)
"""

import argparse
import asyncio
import itertools
import os
import random
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
from e2e import add_quick_flag, figure
from serve_process import DAEMON_MODULE, Server, served

from pagedkv.daemon.process.restart import SNAPSHOT_NAME
from pagedkv.llm.example_model import write_example_model

SERVER_ARGS = ("--num-blocks", "2048", "--device", "cpu", "--max-num-seqs", "64")
PROMPT_TOKENS = 256
# The example model's tokenizer has ~300 ids; prompts use ids below it.
VOCAB = 250
# How often a failed stream is sent again, and for how long at most.
RESEND_POLL_S = 0.05
RESEND_FOR_S = 120.0
# How long the bench waits for the old daemon to exit, and the server to be healthy.
WAIT_S = 120.0
# Serve's supervisor's line as it tells the old daemon of a planned upgrade to stop.
STANDBY_READY = "upgrade: standby ready, stopping the current child"


@dataclass
class Stream:
    """One stream's chunks: when each came, and whether (and when) it failed."""

    prompt: list[int]
    # time.monotonic() of each chunk with text, over every attempt.
    times: list[float] = field(default_factory=list)
    # Attempts that ended in an error.
    failures: int = 0
    # Set once it has a chunk (the restart waits for every stream's first).
    started: asyncio.Event = field(default_factory=asyncio.Event)
    # time.monotonic() of the daemon's SIGTERM.
    restart_at: float = 0.0

    def gap_s(self) -> float:
        """The longest wait between two consecutive chunks from the last before the restart
        (a resent stream's first chunk follows the failed one's last); 0.0 for a stream that
        ended before it."""
        last = max(i for i, t in enumerate(self.times) if t <= self.restart_at)
        return max((b - a for a, b in itertools.pairwise(self.times[last:])), default=0.0)


async def run_stream(api: openai.AsyncOpenAI, model: str, stream: Stream, tokens: int,
                     resend: bool, until: asyncio.Event) -> None:
    """Stream greedy completions one after the other until `until` is set (at least one); with
    `resend`, send one again after an error (from the start: the client's view of a failed
    request) until it completes."""
    deadline = time.monotonic() + RESEND_FOR_S
    while True:
        try:
            reply = await api.completions.create(model=model, prompt=stream.prompt,
                                                 max_tokens=tokens, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
            async for chunk in reply:
                if chunk.choices and chunk.choices[0].text:
                    stream.times.append(time.monotonic())
                    stream.started.set()
            if until.is_set():
                return
        except openai.APIError:
            stream.failures += 1
            if not resend or time.monotonic() > deadline:
                return
            await asyncio.sleep(RESEND_POLL_S)


async def restart_round(server: Server, api: openai.AsyncOpenAI, prompts: list[list[int]],
                        tokens: int, how: str) -> list[Stream]:
    """One client per prompt, each streaming, the child daemon restarted once each has a
    chunk ("upgrade": SIGHUP to serve, counted from the old daemon's exit; "sigterm": SIGTERM to
    the daemon; "cold": that, its snapshot removed once it exited); the streams once all ended.
    The clients send no new request once the old daemon is told to stop; until then (the
    standby's start: seconds, longer than a stream) each sends its next once one ends."""
    cold = how == "cold"
    streams = [Stream(prompt) for prompt in prompts]
    stopping = asyncio.Event()
    tasks = [asyncio.create_task(run_stream(api, server.model, stream, tokens, cold, stopping))
             for stream in streams]
    for stream in streams:
        await stream.started.wait()
    daemon = server.child_pid(DAEMON_MODULE)
    snapshot = _state_dir(daemon) / SNAPSHOT_NAME
    if how == "upgrade":
        server.launched.send(signal.SIGHUP)
        await _wait_logged(server, STANDBY_READY)
        stopping.set()
        await _wait_gone(daemon)
    else:
        stopping.set()
        os.kill(daemon, signal.SIGTERM)
    restart_at = time.monotonic()
    if all(task.done() for task in tasks):
        raise SystemExit(f"{how}: every stream ended before the old daemon exited: raise "
                         "--tokens")
    for stream in streams:
        stream.restart_at = restart_at
    if cold:
        await _wait_gone(daemon)
        snapshot.unlink(missing_ok=True)
    await asyncio.gather(*tasks)
    return streams


async def cached_tokens(api: openai.AsyncOpenAI, model: str, prompts: list[list[int]]) -> int:
    """The prefix cache's share of `prompts` sent once each (one token each)."""
    total = 0
    for prompt in prompts:
        answer = await api.completions.create(model=model, prompt=prompt, max_tokens=1,
                                              temperature=0)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        total += answer.usage.prompt_tokens_details.cached_tokens or 0
    return total


def _state_dir(daemon: int) -> Path:
    """The daemon's --state-dir, read from its command line."""
    args = Path(f"/proc/{daemon}/cmdline").read_bytes().decode().split("\0")
    return Path(args[args.index("--state-dir") + 1])


async def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        assert time.monotonic() < deadline, f"the daemon (pid {pid}) did not exit"
        await asyncio.sleep(0.005)


async def _wait_logged(server: Server, line: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while line not in server.launched.stderr():
        assert time.monotonic() < deadline, f"the server never logged {line!r}"
        await asyncio.sleep(0.005)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


async def wait_healthy(server: Server) -> None:
    """Until the server serves again (its engine kept or reopened); AssertionError with
    /health's reason past WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while (reason := await asyncio.to_thread(_unhealthy, server)) is not None:
        assert time.monotonic() < deadline, f"the server did not serve again: {reason}"
        await asyncio.sleep(0.05)


def _unhealthy(server: Server) -> str | None:
    """/health's reason for a 503 (None: 200)."""
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=10):
            return None
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


async def bench(server: Server, streams: int, tokens: int) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(streams)]
    api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                             timeout=WAIT_S)
    await cached_tokens(api, server.model, prompts)  # fills the prefix cache
    before = await cached_tokens(api, server.model, prompts)
    rounds = {}
    for how in ("upgrade", "sigterm"):
        rounds[how] = await restart_round(server, api, prompts, tokens, how)
        await wait_healthy(server)
    after = await cached_tokens(api, server.model, prompts)
    cold = await restart_round(server, api, prompts, tokens, "cold")
    await wait_healthy(server)
    gaps = {how: max(stream.gap_s() for stream in streams)
            for how, streams in [*rounds.items(), ("cold", cold)]}
    figure("daemon_upgrade_gap_ms", 1000 * gaps["upgrade"], "ms", 1)
    figure("daemon_sigterm_restart_gap_ms", 1000 * gaps["sigterm"], "ms", 1)
    figure("daemon_cold_restart_gap_ms", 1000 * gaps["cold"], "ms", 1)
    figure("daemon_upgrade_gap_ratio", gaps["upgrade"] / gaps["cold"], "x")
    figure("requests_failed_during_upgrade",
           sum(s.failures for streams in rounds.values() for s in streams), "requests", 0)
    figure("cold_restart_streams_resent", sum(1 for s in cold if s.failures), "streams", 0)
    figure("prefix_hits_after_upgrade_frac", after / before if before else 0.0, "frac")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=192, help="tokens per stream")
    add_quick_flag(parser)
    args = parser.parse_args()
    streams, tokens = (4, 24) if args.quick else (args.streams, args.tokens)
    with tempfile.TemporaryDirectory(prefix="pkv-up-", dir="/tmp") as tmp:
        folder = Path(tmp)
        write_example_model(folder / "model")
        with served(folder, str(folder / "model"), *SERVER_ARGS) as server:
            asyncio.run(bench(server, streams, tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
