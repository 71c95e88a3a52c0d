"""A legitimate request's latency through `pagedkv serve` while one address holds half-open
connections (slowloris, issue 31), beside the same latency with no attack.

The server (`pagedkv serve --model tiny-llama`, CPU, its default connection bounds) is asked
--requests small completions (a 4-token prompt, 1 new token) one after another, each on a new
connection from 127.0.0.2, first with no attack, then while attacker processes open --attack
connections (default 20,000) from 127.0.0.1, each sending part of a request head and one more
header line every TRICKLE_S, and opening again, every --reopen-s, those the server reset (as
slowloris does). Each process raises its soft RLIMIT_NOFILE to the hard limit (the server does
so itself); an attacker process opens at most PER_ATTACKER connections, below the hard limit
of this machine (20,000), so the attack is split across processes.

Figures:
    slowloris_half_open: N connections     the connections the attackers opened (the server
                                           resets all but --max-connections-per-address)
    slowloris_server_open_max: N connections  the most socket descriptors the server held at
                                           once beyond those before the attack (/proc)
    slowloris_legit_failures: N requests   requests that got no answer during the attack
    slowloris_baseline_p50_ms, slowloris_baseline_p99_ms   no attack
    slowloris_legit_p50_ms, slowloris_legit_p99_ms         during the attack
    slowloris_p99_ratio: X x               legit p99 / baseline p99
Usage: python benchmarks/bench_slowloris.py [--attack N] [--requests N] [--reopen-s S] [--quick]
"""

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import tempfile
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import aiohttp
import numpy as np
from e2e import PRESET, add_quick_flag, figure
from serve_process import Server, served

from pagedkv.server.listener import raise_fd_limit

ATTACKER = "127.0.0.1"
LEGIT = "127.0.0.2"
# The head an attacker starts and never finishes, and the line it adds now and then.
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
TRICKLE_LINE = b"X-a: b\r\n"
TRICKLE_S = 5.0
# How often an attacker opens again the connections the server reset (--reopen-s).
REOPEN_S = 5.0
# Connections one attacker process opens (below this machine's hard limit of descriptors).
PER_ATTACKER = 10_000
# Connections an attacker opens at once (the server's listen backlog is 128).
CONNECT_AT_ONCE = 256
BODY = {"model": PRESET, "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0.0}


class _Half(asyncio.Protocol):
    """One attacking connection: part of a head, then nothing; `open` while it lasts."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(PARTIAL_HEAD)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def _attack(port: int, count: int, reopen_s: float,
                  opened: "Synchronized[int]") -> None:
    loop = asyncio.get_running_loop()
    halves: list[_Half] = []
    gate = asyncio.Semaphore(CONNECT_AT_ONCE)

    async def one() -> None:
        half = _Half()
        async with gate:
            try:
                await loop.create_connection(lambda: half, "127.0.0.1", port,
                                             local_addr=(ATTACKER, 0))
            except OSError:
                return
        halves.append(half)
        with opened.get_lock():
            opened.value += 1

    await asyncio.gather(*(one() for _ in range(count)))
    next_trickle = next_reopen = time.monotonic()
    while True:
        await asyncio.sleep(0.5)
        now = time.monotonic()
        if now >= next_trickle:
            for half in halves:
                if half.transport is not None:
                    half.transport.write(TRICKLE_LINE)
            next_trickle = now + TRICKLE_S
        if now >= next_reopen:
            closed = sum(half.transport is None for half in halves)
            halves = [half for half in halves if half.transport is not None]
            await asyncio.gather(*(one() for _ in range(closed)))
            next_reopen = time.monotonic() + reopen_s


def attacker(port: int, count: int, reopen_s: float, opened: "Synchronized[int]") -> None:
    """An attacker process: `count` half-open connections, kept up until it is terminated."""
    raise_fd_limit()
    asyncio.run(_attack(port, count, reopen_s, opened))


def open_sockets(pid: int) -> int:
    """The socket descriptors process `pid` holds."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            count += os.readlink(fd).startswith("socket:")
    return count


async def latencies(server: Server, requests: int) -> tuple[list[float], int]:
    """REQUESTS completions, each on a new connection from LEGIT: their latencies (ms) and how
    many failed."""
    timings: list[float] = []
    failures = 0
    connector = aiohttp.TCPConnector(local_addr=(LEGIT, 0), force_close=True)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        for _ in range(requests):
            started = time.perf_counter()
            try:
                async with http.post(f"{server.url}/v1/completions", json=BODY) as reply:
                    reply.raise_for_status()
                    await reply.read()
            except (aiohttp.ClientError, TimeoutError):
                failures += 1
                continue
            timings.append((time.perf_counter() - started) * 1000)
    return timings, failures


async def under_attack(server: Server, attack: int, reopen_s: float,
                       requests: int) -> list[float]:
    pid = server.launched.process.pid
    before = open_sockets(pid)
    spawn = multiprocessing.get_context("spawn")  # not a fork of this process's running loop
    opened: Synchronized[int] = spawn.Value("q", 0)
    sizes = [min(PER_ATTACKER, attack - start) for start in range(0, attack, PER_ATTACKER)]
    attackers = [spawn.Process(target=attacker, args=(server.port, size, reopen_s,
                                                                 opened))
                 for size in sizes]
    for process in attackers:
        process.start()
    try:
        deadline = time.monotonic() + 120
        while opened.value < attack and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        figure("slowloris_half_open", opened.value, "connections", 0)
        held = [open_sockets(pid) - before]
        task = asyncio.create_task(latencies(server, requests))
        while not task.done():
            held.append(open_sockets(pid) - before)
            await asyncio.sleep(0.5)
        timings, failures = task.result()
    finally:
        for process in attackers:
            process.terminate()
            process.join()
    figure("slowloris_server_open_max", max(held), "connections", 0)
    figure("slowloris_legit_failures", failures, "requests", 0)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attack", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--reopen-s", type=float, default=REOPEN_S)
    add_quick_flag(parser)
    args = parser.parse_args()
    attack, requests = (500, 20) if args.quick else (args.attack, args.requests)
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="pkv-slowloris-") as folder, \
            served(Path(folder), PRESET, "--num-blocks", "64", "--device", "cpu") as server:
        baseline, _ = asyncio.run(latencies(server, requests))
        attacked = asyncio.run(under_attack(server, attack, args.reopen_s, requests))
    base_p99 = float(np.percentile(baseline, 99))
    figure("slowloris_baseline_p50_ms", float(np.median(baseline)), "ms", 2)
    figure("slowloris_baseline_p99_ms", base_p99, "ms", 2)
    if attacked:
        p99 = float(np.percentile(attacked, 99))
        figure("slowloris_legit_p50_ms", float(np.median(attacked)), "ms", 2)
        figure("slowloris_legit_p99_ms", p99, "ms", 2)
        figure("slowloris_p99_ratio", p99 / base_p99, "x", 2)


if __name__ == "__main__":
    main()
