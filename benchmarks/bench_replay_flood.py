"""KV-event replay flood (issue 31): what one DEALER that sends FLOOD replay-from-0 requests of 8
bytes and never reads costs a daemon whose replay buffer is full, and whether a legitimate
replay is answered meanwhile.

A real pagedkvd with the default kv_events_buffer (10,000 batches) and every salt published;
one client fills the buffer (Batch calls: Allocate fresh tokens, Commit, Free, on a small pool,
so each call stores one batch and, once the pool is full, removes another); the daemon's RSS
is read from /proc every SAMPLE_S.

Figures: replay_buffered_batches (what a replay from 0 returns once the buffer is full),
replay_legit_latency_s_idle (a replay from 0, request to end marker, with no flood),
replay_rss_mib_before (the daemon's RSS then), replay_rss_mib_max (its peak from the flood's
first request until HOLD_S later: past the sender's STALL_S, the flooder is dropped),
replay_legit_latency_s_flood (the same replay sent during the flood; 90 s: no answer),
replay_rss_mib_after (RSS at the end).

Usage: python benchmarks/bench_replay_flood.py [--quick]
"""

import argparse
import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import zmq
from daemon_process import running_pagedkvd
from e2e import add_quick_flag, figure

from pagedkv.client import Allocate, Commit, Free, PoolClient
from pagedkv.daemon.events.wire import END_SEQ, seq_bytes
from pagedkv.process.launch import free_tcp_port

FLOOD = 3000
# Blocks of the pool, and blocks each fill call commits.
POOL_BLOCKS, CALL_BLOCKS = 256, 4
BUFFER = 10_000
# How long the flooder stays connected, reading nothing.
HOLD_S = 15.0
# How long a replay may take before it counts as unanswered.
ANSWER_TIMEOUT_S = 90.0
SAMPLE_S = 0.05


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@contextmanager
def peak_rss(pid: int) -> Iterator[list[float]]:
    """The daemon's RSS, sampled on a thread while the block runs: [peak] once it ends."""
    peak = [rss_mib(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            peak[0] = max(peak[0], rss_mib(pid))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


async def fill(target: str, calls: int) -> None:
    """`calls` Batch calls of fresh tokens: each stores a batch (and evicts, once full)."""
    tokens = itertools.count(1000)
    async with await PoolClient.connect(target) as client:
        block_size = (await client.pool_info()).block_size
        session = await client.open_session("fill")
        for seq in range(calls):
            ids = [next(tokens) for _ in range(CALL_BLOCKS * block_size)]
            await session.batch([Allocate(seq, token_ids=ids), Commit([seq]), Free(seq)])


def replay_seconds(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> tuple[float, int]:
    """Seconds from a replay-from-0 request to its end marker (ANSWER_TIMEOUT_S: none), and
    the batches it returned."""
    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    start = time.monotonic()
    socket.send_multipart([b"", seq_bytes(0)])
    batches = 0
    while (left := ANSWER_TIMEOUT_S - (time.monotonic() - start)) > 0:
        if not socket.poll(int(left * 1000)):
            break
        _, seq, _ = socket.recv_multipart()
        if seq == END_SEQ:
            socket.close(linger=0)
            return time.monotonic() - start, batches
        batches += 1
    socket.close(linger=0)
    return ANSWER_TIMEOUT_S, batches


def flood(context: zmq.Context[zmq.Socket[bytes]], endpoint: str,
          requests: int) -> zmq.Socket[bytes]:
    """A DEALER that sends `requests` replay-from-0 requests and will read nothing."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.RCVBUF, 4096)
    socket.setsockopt(zmq.SNDHWM, requests)
    socket.connect(endpoint)
    for _ in range(requests):
        socket.send_multipart([b"", seq_bytes(0)])
    return socket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_flag(parser)
    args = parser.parse_args()
    calls, requests, hold_s = (200, 300, 1.0) if args.quick else (BUFFER // 2 + 100, FLOOD,
                                                                 HOLD_S)
    pub, replay = free_tcp_port(), free_tcp_port()
    endpoint = f"tcp://127.0.0.1:{replay}"
    with running_pagedkvd("--num-blocks", str(POOL_BLOCKS), "--kv-events-all-salts",
                          "--kv-events-endpoint", f"tcp://*:{pub}",
                          "--kv-events-replay-endpoint", f"tcp://*:{replay}",
                          "--kv-events-buffer", str(BUFFER)) as daemon:
        pid = daemon.launched.process.pid
        asyncio.run(fill(daemon.target, calls))
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        idle_s, buffered = replay_seconds(context, endpoint)
        figure("replay_buffered_batches", buffered, "batches", 0)
        figure("replay_legit_latency_s_idle", idle_s, "s")
        figure("replay_rss_mib_before", rss_mib(pid), "MiB", 1)
        with peak_rss(pid) as peak:
            flooder = flood(context, endpoint, requests)
            time.sleep(1.0)  # the daemon reads the flood first
            flood_s, _ = replay_seconds(context, endpoint)
            time.sleep(max(0.0, hold_s - flood_s))
        figure("replay_rss_mib_max", peak[0], "MiB", 1)
        figure("replay_legit_latency_s_flood", flood_s, "s")
        figure("replay_rss_mib_after", rss_mib(pid), "MiB", 1)
        flooder.close(linger=0)
        context.destroy(linger=0)


if __name__ == "__main__":
    main()
