"""`pagedkv serve`'s own daemon restarted under its clients (issue 34): the streams' pause when
the next daemon restores the pool (as shipped), beside the same restart when it starts cold.

Through the server: `pagedkv serve` (CPU) on the example model (`pagedkv example-model`, written
into the run's folder), with its own daemon and runner. Each round, STREAMS greedy SSE streams
(the `openai` package, async) decode when the child daemon gets SIGTERM; its supervisor starts it
again. Upgrade round: the daemon wrote its snapshot and the next one restores it, so the streams
pause and go on. Cold round: the bench removes the snapshot once the old daemon has exited (before
the next one reads it, seconds later), so the next one starts cold: the streams fail with the
retryable 503 and the bench sends each again (as a client would, every RESEND_POLL_S) until it
streams. Both rounds run on one server, side by side.

Figures:
    daemon_upgrade_gap_ms            the longest pause between two consecutive chunks of any
                                     stream across the restored restart
    daemon_cold_restart_gap_ms       the longest from a stream's last chunk before the restart to
                                     the first chunk of its resent stream
    daemon_upgrade_gap_ratio         upgrade / cold (goal <= 0.25)
    requests_failed_during_upgrade   streams that ended in an error in the upgrade round (goal 0)
    prefix_hits_after_upgrade_frac   cached prompt tokens of the same prompts after the restored
                                     restart over before it (goal >= 0.99)

Usage: python benchmarks/bench_daemon_upgrade.py [--streams 32] [--quick]
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
PROMPT_TOKENS = 64
# The example model's tokenizer has ~300 ids; prompts use ids below it.
VOCAB = 250
# How often a failed stream is sent again, and for how long at most.
RESEND_POLL_S = 0.05
RESEND_FOR_S = 120.0
# How long the bench waits for the old daemon to exit, and the server to be healthy.
WAIT_S = 120.0


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
        (a resent stream's first chunk follows the failed one's last)."""
        last = max(i for i, t in enumerate(self.times) if t <= self.restart_at)
        return max(b - a for a, b in itertools.pairwise(self.times[last:]))


async def run_stream(api: openai.AsyncOpenAI, model: str, stream: Stream, tokens: int,
                     resend: bool) -> None:
    """Stream a greedy completion; with `resend`, send it again after an error (from the
    start: the client's view of a failed request) until it completes."""
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
            return
        except openai.APIError:
            stream.failures += 1
            if not resend or time.monotonic() > deadline:
                return
            await asyncio.sleep(RESEND_POLL_S)


async def restart_round(server: Server, api: openai.AsyncOpenAI, prompts: list[list[int]],
                        tokens: int, cold: bool) -> list[Stream]:
    """One stream per prompt, the child daemon SIGTERMed once each has a chunk (cold: its
    snapshot removed once it exited); the streams once all ended."""
    streams = [Stream(prompt) for prompt in prompts]
    tasks = [asyncio.create_task(run_stream(api, server.model, stream, tokens, resend=cold))
             for stream in streams]
    for stream in streams:
        await stream.started.wait()
    daemon = server.child_pid(DAEMON_MODULE)
    snapshot = _state_dir(daemon) / SNAPSHOT_NAME
    restart_at = time.monotonic()
    os.kill(daemon, signal.SIGTERM)
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
    upgrade = await restart_round(server, api, prompts, tokens, cold=False)
    await wait_healthy(server)
    after = await cached_tokens(api, server.model, prompts)
    cold = await restart_round(server, api, prompts, tokens, cold=True)
    await wait_healthy(server)
    upgrade_gap = max(stream.gap_s() for stream in upgrade)
    cold_gap = max(stream.gap_s() for stream in cold)
    figure("daemon_upgrade_gap_ms", 1000 * upgrade_gap, "ms", 1)
    figure("daemon_cold_restart_gap_ms", 1000 * cold_gap, "ms", 1)
    figure("daemon_upgrade_gap_ratio", upgrade_gap / cold_gap, "x")
    figure("requests_failed_during_upgrade", sum(s.failures for s in upgrade), "requests", 0)
    figure("cold_restart_streams_resent", sum(1 for s in cold if s.failures), "streams", 0)
    figure("prefix_hits_after_upgrade_frac", after / before if before else 0.0, "frac")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=96, help="tokens per stream")
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
