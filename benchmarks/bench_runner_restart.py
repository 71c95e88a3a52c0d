"""A runner crash under greedy streams, against a cold restart of everything (issue 20).

Through the server: `pagedkv serve --model tiny-llama` (CPU), STREAMS greedy streams as HTTP
server-sent events from aiohttp's client to /v1/completions (token-id prompts). Hot: once every
stream has half its tokens, the server's runner is SIGKILLed; its supervisor
(llm/supervisor.py) starts it again on the same socket, the engine resends each
sequence's history, and the K/V stays in the daemon. Cold: the same streams on a fresh server;
at the same point the server, its daemon and its runner are SIGKILLed, a new server is started,
and each stream's prompt plus its tokens so far is submitted again (what a client must do when
the daemon's K/V is gone).

Through the engine (restart_engine.py): the same two runs on a daemon and a runner started here
with the runner's /metrics, where the new runner's computed tokens are counted.

Every stream must end with the tokens of an uninterrupted run of the same prompts (checked).
A stream's gap: the longest wait between two of its tokens from its last token before the
kill on (tokens computed before the kill may reach the client after it).

Figures (gaps: p50 and max over the streams):
    runner_restart_gap_ms_p50, _max            hot, through the server
    cold_restart_gap_ms_p50, _max              cold, through the server
    runner_restart_vs_cold_gap_ratio           the two p50s
    runner_restarts                            the server's /metrics (1)
    engine_runner_restart_gap_ms_p50, _max     hot, through the engine
    engine_cold_restart_gap_ms_p50, _max       cold, through the engine
    runner_restart_ready_ms, cold_restart_ready_ms   from the kill to the new processes'
                                 READY=1 (engine runs): the part of the gaps that is start-up
    recomputed_tokens_after_runner_restart     what the new runner computed beyond one position
                                 per token generated after the kill (engine run)
    uncommitted_tokens_at_kill   the goal: computed positions past each sequence's committed
                                 tokens (the daemon's figure, read right after the kill)
    partial_block_tokens_at_kill those past each sequence's last full block
    recomputed_tokens_after_cold_restart       cold (every token held)

Usage: python benchmarks/bench_runner_restart.py [--streams 32] [--new-tokens 64] [--quick]
"""

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import restart_engine
from e2e import PRESET, VOCAB, add_quick_flag, figure
from restart_streams import Crash, StreamLog, check, kill_midway, partial_block_tokens
from serve_process import (
    DAEMON_MODULE,
    RUNNER_MODULE,
    Server,
    served,
    start_server,
    stream_completion,
)

from pagedkv.client import SamplingParams

# Prompt lengths cycle through these (tokens), so the streams' tails differ.
PROMPT_LENS = (24, 37, 50, 63, 76, 89)
SERVER_ARGS = ("--num-blocks", str(restart_engine.NUM_BLOCKS), "--device", "cpu")


async def http_stream(http: aiohttp.ClientSession, server: Server, log: StreamLog,
                      prompt: list[int], max_tokens: int) -> None:
    """A streamed completion of `prompt` through `server`, its tokens added to `log`."""
    async for token_ids in stream_completion(http, server, prompt, max_tokens):
        log.extend(token_ids)


async def http_hot(folder: Path, prompts: list[list[int]],
                   new_tokens: int) -> tuple[Crash, list[list[int]], int]:
    """Through `pagedkv serve`, its runner killed midway: the crash, the tokens of an
    uninterrupted run on the same server, and the server's count of runner restarts."""
    with served(folder, PRESET, *SERVER_ARGS) as server:
        async with aiohttp.ClientSession() as http:
            logs = [StreamLog(p) for p in prompts]
            tasks = [asyncio.create_task(http_stream(http, server, log, log.prompt, new_tokens))
                     for log in logs]
            runner = server.child_pid(RUNNER_MODULE)
            kill_at = await kill_midway(logs, new_tokens, lambda: os.kill(runner, signal.SIGKILL))
            await asyncio.gather(*tasks)
            expected = [StreamLog(p) for p in prompts]
            await asyncio.gather(*(http_stream(http, server, log, log.prompt, new_tokens)
                                   for log in expected))
        restarts = round(server.metric("pagedkv:runner_restarts"))
    return Crash(logs, kill_at), [log.tokens for log in expected], restarts


async def http_cold(folder: Path, prompts: list[list[int]], new_tokens: int) -> Crash:
    """Through `pagedkv serve`: the server and its children killed midway, a new server
    started, each stream submitted again with its tokens so far."""
    server = start_server(folder, PRESET, *SERVER_ARGS)
    try:
        async with aiohttp.ClientSession() as http:
            logs = [StreamLog(p) for p in prompts]
            tasks = [asyncio.create_task(http_stream(http, server, log, log.prompt, new_tokens))
                     for log in logs]
            children = [server.child_pid(RUNNER_MODULE), server.child_pid(DAEMON_MODULE)]

            def kill_all() -> None:
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                server.launched.send(signal.SIGKILL)

            kill_at = await kill_midway(logs, new_tokens, kill_all)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            server.launched.stop()
            server = await asyncio.to_thread(start_server, folder, PRESET, *SERVER_ARGS)
            ready_at = time.monotonic()
            await asyncio.gather(*(http_stream(http, server, log, [*log.prompt, *log.tokens],
                                               new_tokens - len(log.tokens)) for log in logs))
    finally:
        server.launched.stop()
    return Crash(logs, kill_at, ready_at - kill_at)


def gap_figures(prefix: str, crash: Crash) -> float:
    """Print the p50 and max of a crash's gaps; the p50."""
    gaps = crash.gaps_ms()
    figure(f"{prefix}_gap_ms_p50", statistics.median(gaps), "ms", 1)
    figure(f"{prefix}_gap_ms_max", max(gaps), "ms", 1)
    return statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    add_quick_flag(parser)
    args = parser.parse_args()
    streams, new_tokens = (4, 16) if args.quick else (args.streams, args.new_tokens)
    prompts = [[(31 * i + 7 * j + 1) % VOCAB for j in range(PROMPT_LENS[i % len(PROMPT_LENS)])]
               for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    with tempfile.TemporaryDirectory(prefix="pkv-rr-") as name:
        folders = [Path(name) / kind for kind in ("eh", "ec", "sh", "sc")]
        for folder in folders:
            folder.mkdir()
        with restart_engine.supervised(folders[0]) as (processes, supervisor):
            engine_hot = asyncio.run(restart_engine.hot(processes, supervisor, prompts, params))
            expected = asyncio.run(restart_engine.uninterrupted(processes, prompts, params))
        with restart_engine.unsupervised(folders[1]) as processes:
            engine_cold = asyncio.run(restart_engine.cold(processes, folders[1], prompts, params))
        served_hot, served_expected, restarts = asyncio.run(http_hot(folders[2], prompts,
                                                                     new_tokens))
        served_cold = asyncio.run(http_cold(folders[3], prompts, new_tokens))
    check(engine_hot.logs, expected, "engine, runner restart")
    check(engine_cold.logs, expected, "engine, cold restart")
    check(served_hot.logs, served_expected, "server, runner restart")
    check(served_cold.logs, served_expected, "server, cold restart")
    hot_p50 = gap_figures("runner_restart", served_hot)
    cold_p50 = gap_figures("cold_restart", served_cold)
    figure("runner_restart_vs_cold_gap_ratio", hot_p50 / cold_p50, "ratio", 2)
    figure("runner_restarts", restarts, "restarts", 0)
    gap_figures("engine_runner_restart", engine_hot)
    gap_figures("engine_cold_restart", engine_cold)
    assert engine_hot.ready_s is not None and engine_cold.ready_s is not None
    figure("runner_restart_ready_ms", 1000 * engine_hot.ready_s, "ms", 1)
    figure("cold_restart_ready_ms", 1000 * engine_cold.ready_s, "ms", 1)
    figure("recomputed_tokens_after_runner_restart", engine_hot.recomputed or 0, "tokens", 0)
    figure("uncommitted_tokens_at_kill", engine_hot.uncommitted or 0, "tokens", 0)
    figure("partial_block_tokens_at_kill", partial_block_tokens(engine_hot.logs), "tokens", 0)
    figure("recomputed_tokens_after_cold_restart", engine_cold.recomputed or 0, "tokens", 0)


if __name__ == "__main__":
    main()
