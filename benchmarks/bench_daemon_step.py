"""Decode-step round trips through a real pagedkvd on a unix socket.

The daemon runs as its own process (`python -m pagedkv.daemon`), so the client and
the server never share an event loop, as in production. Figures, one per line:

    step_p50_ms_N, step_p99_ms_N   one Step RPC appending one token (with its id) to N sequences
    unary_step_ms_256              the same 256 appends as Append RPCs, 64 in flight (mean)
    step_speedup_vs_unary_256      unary time / Step p50 for those 256 appends
    appends_per_s_Pproc            tokens appended per second by P client processes together,
                                   each stepping 128 sequences of its own session

Sequences are freed and re-allocated every RECYCLE_STEPS steps (outside the timed calls) so a
modest pool holds every run. With two or more CPUs the daemon is pinned to one of its own and
the clients to the rest (the first output line says how).
Usage: python benchmarks/bench_daemon_step.py
"""

import argparse
import asyncio
import subprocess
import sys
import time

import numpy as np
from daemon_process import pin, running_pagedkvd

from pagedkv.client import Allocate, Free, PoolClient, Session

STEP_SIZES = (64, 256, 1024)
TIMED_STEPS = 1000  # p99 is then the 10th worst step, not the 3rd
WARMUP_STEPS = 20
UNARY_SEQS = 256
UNARY_IN_FLIGHT = 64
UNARY_STEPS = 20
PROCESS_COUNTS = (1, 4, 8)
SEQS_PER_PROCESS = 128
PROCESS_SECONDS = 2.0
# Steps between re-allocations: 64 tokens on a 16-token block size is at most 5 blocks a seq.
RECYCLE_STEPS = 64
BLOCK_SIZE = 16
NUM_BLOCKS = 8192


async def allocate_all(session: Session, seq_ids: list[int]) -> None:
    """One prompt token per sequence, in batches of at most 1024 ops."""
    for start in range(0, len(seq_ids), 1024):
        chunk = seq_ids[start:start + 1024]
        await session.batch([Allocate(seq_id, token_ids=[seq_id]) for seq_id in chunk])


async def recycle(session: Session, seq_ids: list[int]) -> None:
    for start in range(0, len(seq_ids), 1024):
        await session.batch([Free(seq_id) for seq_id in seq_ids[start:start + 1024]])
    await allocate_all(session, seq_ids)


async def step_latencies_ms(session: Session, num_seqs: int) -> list[float]:
    """Latency of each timed Step over num_seqs sequences, one token with its id each."""
    seq_ids = list(range(num_seqs))
    tokens = [7] * num_seqs
    await allocate_all(session, seq_ids)
    latencies = []
    for index in range(WARMUP_STEPS + TIMED_STEPS):
        if index and index % RECYCLE_STEPS == 0:
            await recycle(session, seq_ids)
        start = time.perf_counter()
        await session.step(seq_ids, tokens)
        if index >= WARMUP_STEPS:
            latencies.append((time.perf_counter() - start) * 1000)
    for start in range(0, num_seqs, 1024):
        await session.batch([Free(seq_id) for seq_id in seq_ids[start:start + 1024]])
    return latencies


async def unary_step_ms(session: Session) -> float:
    """Mean time to append one token to UNARY_SEQS sequences with one Append RPC each."""
    seq_ids = list(range(UNARY_SEQS))
    await allocate_all(session, seq_ids)
    gate = asyncio.Semaphore(UNARY_IN_FLIGHT)

    async def append(seq_id: int) -> None:
        async with gate:
            await session.append(seq_id, token_ids=[7])

    times = []
    for _ in range(UNARY_STEPS):
        start = time.perf_counter()
        await asyncio.gather(*(append(seq_id) for seq_id in seq_ids))
        times.append((time.perf_counter() - start) * 1000)
    await session.batch([Free(seq_id) for seq_id in seq_ids])
    return float(np.mean(times))


async def measure_single_client(target: str) -> None:
    async with await PoolClient.connect(target, timeout=30) as client, \
            await client.open_session("bench") as session:
        p50_256 = 0.0
        for num_seqs in STEP_SIZES:
            latencies = await step_latencies_ms(session, num_seqs)
            p50, p99 = np.percentile(latencies, [50, 99])
            print(f"step_p50_ms_{num_seqs}: {p50:.3f} ms")
            print(f"step_p99_ms_{num_seqs}: {p99:.3f} ms")
            if num_seqs == UNARY_SEQS:
                p50_256 = float(p50)
        unary = await unary_step_ms(session)
        print(f"unary_step_ms_{UNARY_SEQS}: {unary:.3f} ms")
        print(f"step_speedup_vs_unary_{UNARY_SEQS}: {unary / p50_256:.1f} ratio")


async def worker(target: str, start_at: float, seconds: float) -> int:
    """Step SEQS_PER_PROCESS sequences from start_at for `seconds`; returns tokens appended."""
    async with await PoolClient.connect(target, timeout=30) as client, \
            await client.open_session("bench-worker") as session:
        seq_ids = list(range(SEQS_PER_PROCESS))
        tokens = [7] * SEQS_PER_PROCESS
        await allocate_all(session, seq_ids)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        appended, steps = 0, 0
        while time.time() < start_at + seconds:
            await session.step(seq_ids, tokens)
            appended += SEQS_PER_PROCESS
            steps += 1
            if steps % RECYCLE_STEPS == 0:
                await recycle(session, seq_ids)
        return appended


def measure_processes(target: str) -> None:
    for count in PROCESS_COUNTS:
        # Start together once every process has had time to import and connect.
        start_at = time.time() + 2.0 + 0.25 * count
        workers = [subprocess.Popen(
            [sys.executable, __file__, "--worker", target, str(start_at), str(PROCESS_SECONDS)],
            stdout=subprocess.PIPE) for _ in range(count)]
        appended = sum(int(w.communicate(timeout=60)[0]) for w in workers)
        print(f"appends_per_s_{count}proc: {appended / PROCESS_SECONDS:.0f} tokens/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("TARGET", "START_AT", "SECONDS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        target, start_at, seconds = args.worker
        print(asyncio.run(worker(target, float(start_at), float(seconds))))
        return 0
    with running_pagedkvd("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                          "--dtype", "float16") as daemon:
        print(f"# {pin(daemon.launched.process)}")
        asyncio.run(measure_single_client(daemon.target))
        measure_processes(daemon.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
