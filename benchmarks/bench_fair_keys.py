"""Key B's time to first token while key A floods `pagedkv serve`, beside B alone (issue 31).

One `pagedkv serve` (tiny-llama, CPU, its own daemon and runner, --max-num-seqs 8, keys sk-a and
sk-b). B sends PROBES one-token streamed completions one after another, first alone, then while
A holds FLOOD long streams (8 running, the rest waiting). Before issue 31, B's request waited
behind A's queue (first in, first out) and timed out; now each key has its own engine and
waiting requests take turns by key (server/key_engines.py).

    fair_ttft_p99_ms_alone    B's p99 TTFT with nothing else running
    fair_ttft_p99_ms_flood    B's p99 TTFT while A floods
    fair_ttft_p99_ratio       flood / alone (target: at most 2)

Usage: python benchmarks/bench_fair_keys.py [--flood 48] [--probes 30]
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
from serve_process import Server, served, stream_completion

FLOOD = 48
PROBES = 30
# A's streams are long enough to outlast B's probes; B's prompt is short and new each time.
FLOOD_TOKENS = 1500
SERVE_ARGS = ("--num-blocks", "2048", "--max-num-seqs", "8", "--api-key", "sk-a",
              "--api-key", "sk-b", "--max-waiting-per-key", "64")


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def ttft_ms(http: aiohttp.ClientSession, server: Server, index: int) -> float:
    """One one-token completion of B: milliseconds from the request to its first token."""
    started = time.monotonic()
    async for _ in stream_completion(http, server, [7, index % 90 + 5, 11], max_tokens=1):
        return (time.monotonic() - started) * 1000
    raise AssertionError("no token")


async def probes(server: Server, count: int) -> list[float]:
    async with aiohttp.ClientSession(headers=headers("sk-b")) as http:
        return [await ttft_ms(http, server, index) for index in range(count)]


async def flood_stream(http: aiohttp.ClientSession, server: Server, index: int) -> None:
    async for _ in stream_completion(http, server, [index % 90 + 3] * 8, FLOOD_TOKENS):
        pass


async def flooded_probes(server: Server, flood: int, count: int) -> list[float]:
    """B's probes once A's `flood` streams are in (8 running, the rest waiting)."""
    limit = aiohttp.TCPConnector(limit=flood + 4)
    async with aiohttp.ClientSession(headers=headers("sk-a"), connector=limit) as http:
        streams = [asyncio.create_task(flood_stream(http, server, i)) for i in range(flood)]
        deadline = time.monotonic() + 60
        while server.metric("pagedkv:num_requests_waiting") < flood - 8:
            assert time.monotonic() < deadline, "A's flood never queued"
            await asyncio.sleep(0.05)
        try:
            return await probes(server, count)
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--flood", type=int, default=FLOOD)
    cli.add_argument("--probes", type=int, default=PROBES)
    args = cli.parse_args()
    with tempfile.TemporaryDirectory(prefix="bfk-") as folder, \
            served(Path(folder), "tiny-llama", *SERVE_ARGS) as server:
        asyncio.run(probes(server, 3))  # warm: B's engine opened, the runner's paths compiled
        alone = p99(asyncio.run(probes(server, args.probes)))
        flooded = p99(asyncio.run(flooded_probes(server, args.flood, args.probes)))
    print(f"fair_ttft_p99_ms_alone: {alone:.1f} ms")
    print(f"fair_ttft_p99_ms_flood: {flooded:.1f} ms")
    print(f"fair_ttft_p99_ratio: {flooded / alone:.2f} ratio")


if __name__ == "__main__":
    main()
