"""KV events under load: how many events a subscriber receives per second at most, and what
publishing them costs the daemon's decode step.

events_per_s_max: a real pagedkvd publishing KV events (`--kv-events-endpoint`, every salt)
with one pyzmq SUB subscriber (its own process, counting as fast as it reads; it unpacks the
msgpack batch to count events and blocks, but builds no records), driven by CHURN_WORKERS client
processes that each loop one Batch call: Allocate sequences of fresh random tokens, Commit them,
Free them. On a pool of CHURN_BLOCKS blocks every call evicts as many committed blocks as it
commits, so each call makes BlockStored and BlockRemoved events. Two shapes (CHURN_SHAPES):
"chains", 16 prompts of 16 blocks (an event names a chain of blocks), and "blocks", 64 prompts
of one block (an event per block). Per shape: events_per_s_SHAPE and event_blocks_per_s_SHAPE
(what the subscriber received over the timed window, events and the blocks they name),
churn_blocks_per_s_SHAPE (blocks committed by the workers meanwhile),
events_dropped_batches_SHAPE (gaps in the publisher's seq numbers the subscriber saw: batches
the publisher dropped as its queue was full; 0 means it kept up); events_per_s_max, the larger
events_per_s.

step_p50_ms_256 with and without events: the Step of bench_daemon_step.py (one token with its
id to 256 sequences per call, freed and re-allocated every RECYCLE_STEPS steps), but with
`commit` and fresh random ids, so every 16th step fills and commits a block per sequence and
re-allocations evict cached blocks: the steps make events. Two daemons, one with events and the
subscriber attached, one without, both pinned (every thread) to the same CPU and stepped in
alternating rounds. Figures: step_p50_ms_256_events, step_p50_ms_256_no_events, their p99s,
step_p50_events_ratio (with / without; the goal is <= 1.10), step_events_received (events
the subscriber got during the timed steps: the steps did publish).

Usage: python benchmarks/bench_kv_events_load.py [--seconds 5] [--rounds 10] [--quick]
"""

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import numpy as np
import zmq
from bench_daemon_step import BLOCK_SIZE, RECYCLE_STEPS, allocate_all, recycle
from daemon_process import DaemonProcess, running_pagedkvd
from e2e import VOCAB, add_quick_flag, figure

from pagedkv.client import Allocate, Commit, Free, PoolClient, Session
from pagedkv.daemon.events.wire import seq_of

CHURN_WORKERS = 2
# (sequences, tokens each) of one churn call: chains of 16 blocks (one BlockStored event names
# 16 blocks), or single blocks (an event per block: the most events for the work).
CHURN_SHAPES = {"chains": (16, 256), "blocks": (64, 16)}
CHURN_BLOCKS = 2048
STEP_SEQS = 256
STEP_BLOCKS = 8192
TIMED_STEPS = 250  # per round
WARMUP_STEPS = 20
# Seconds the subscriber waits after the window for the last batches in flight.
DRAIN_S = 1.0


# ----------------------------------------------------------------- the subscriber process


def subscribe(endpoint: str, start_at: float, stop_at: float) -> str:
    """Read every batch until the window ends (at `stop_at`, or earlier when stdin closes)
    and DRAIN_S more; count the events and blocks of the batches received in the window, and
    the seq gaps. Returns "events blocks gaps"."""
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(endpoint)
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    events = blocks = gaps = 0
    last_seq: int | None = None
    while (now := time.time()) < stop_at + DRAIN_S:
        ready = dict(poller.poll(100))
        # stdin closed: the window ends now.
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 64):
            poller.unregister(sys.stdin.fileno())
            stop_at = min(stop_at, now)
        if socket not in ready:
            continue
        _topic, seq, payload = socket.recv_multipart()
        number = seq_of(seq)
        if last_seq is not None and number > last_seq + 1:
            gaps += number - last_seq - 1
        last_seq = number
        if start_at <= now < stop_at:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events += len(batch[1])
            blocks += sum(len(event["block_hashes"]) for event in batch[1]
                          if isinstance(event, dict) and "block_hashes" in event)
    socket.close(linger=0)
    context.term()
    return f"{events} {blocks} {gaps}"


@contextmanager
def subscriber(endpoint: str, start_at: float, stop_at: float) -> Iterator[list[int]]:
    """A subscriber process for the window from `start_at` to `stop_at` or the end of the
    `with` block, whichever comes first; the list gets [events, blocks, gaps] at its end."""
    process = subprocess.Popen([sys.executable, __file__, "--subscribe", endpoint,
                                str(start_at), str(stop_at)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    counts: list[int] = []
    try:
        yield counts
    finally:
        out, _ = process.communicate(timeout=DRAIN_S + 30)  # closes its stdin first
        counts.extend(int(word) for word in out.split())


def events_args(endpoint: str) -> tuple[str, ...]:
    return ("--kv-events-endpoint", endpoint, "--kv-events-all-salts")


@contextmanager
def events_endpoint() -> Iterator[str]:
    """An ipc:// endpoint in a private folder: the daemon binds it (a tcp:// host would be
    connected to, kvpool.proto's KV events), the subscriber connects, no port is opened."""
    with tempfile.TemporaryDirectory(prefix="pkv-events-") as folder:
        yield f"ipc://{folder}/events"


# Every CPU this process may use, read before `pin_all` narrows it.
CPUS = sorted(os.sched_getaffinity(0))


def pin_all(daemons: list[DaemonProcess]) -> str:
    """Every thread of the daemons on the last CPU, this process (and what it starts) on the
    others: bench_daemon_step's `pin`, but for every thread (the events sender included)."""
    cpus = CPUS
    if len(cpus) < 2:
        return "unpinned (one CPU)"
    for daemon in daemons:
        pid = daemon.launched.process.pid
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {cpus[-1]})
    os.sched_setaffinity(0, set(cpus[:-1]))
    return f"daemons on CPU {cpus[-1]}, clients and subscriber on CPUs {cpus[:-1]}"


# ----------------------------------------------------------------- events_per_s_max


async def churn(target: str, start_at: float, stop_at: float, seed: int, shape: str) -> int:
    """Allocate, commit, free fresh prompts (of CHURN_SHAPES[shape]) in one Batch call each
    from `start_at` to `stop_at`; returns the blocks committed in the window."""
    rng = np.random.default_rng(seed)
    num_seqs, num_tokens = CHURN_SHAPES[shape]
    seq_ids = list(range(num_seqs))
    async with await PoolClient.connect(target, timeout=30) as client, \
            await client.open_session("bench-events-churn") as session:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        committed = 0
        while time.time() < stop_at:
            tokens = rng.integers(0, VOCAB, (num_seqs, num_tokens)).tolist()
            await session.batch([*(Allocate(s, token_ids=tokens[s]) for s in seq_ids),
                                 Commit(seq_ids), *(Free(s) for s in seq_ids)])
            committed += num_seqs * num_tokens // BLOCK_SIZE
        return committed


def measure_events_max(seconds: float) -> None:
    """events_per_s_max over the churn shapes, and each shape's figures."""
    rates = [measure_events(seconds, shape) for shape in CHURN_SHAPES]
    figure("events_per_s_max", max(rates), "events/s", 0)


def measure_events(seconds: float, shape: str) -> float:
    """One churn shape's figures; returns its events per second."""
    pool = ("--num-blocks", str(CHURN_BLOCKS), "--block-size", str(BLOCK_SIZE),
            "--dtype", "float16")
    with events_endpoint() as endpoint, \
            running_pagedkvd(*pool, *events_args(endpoint)) as daemon:
        print(f"# {pin_all([daemon])}", flush=True)
        start_at = time.time() + 3.0  # the subscriber and the workers started and connected
        stop_at = start_at + seconds
        with subscriber(endpoint, start_at, stop_at) as counts:
            workers = [subprocess.Popen(
                [sys.executable, __file__, "--churn", daemon.target, str(start_at),
                 str(stop_at), str(index), shape], stdout=subprocess.PIPE)
                for index in range(CHURN_WORKERS)]
            committed = sum(int(w.communicate(timeout=seconds + 60)[0]) for w in workers)
    events, blocks, gaps = counts
    figure(f"events_per_s_{shape}", events / seconds, "events/s", 0)
    figure(f"event_blocks_per_s_{shape}", blocks / seconds, "blocks/s", 0)
    figure(f"churn_blocks_per_s_{shape}", committed / seconds, "blocks/s", 0)
    figure(f"events_dropped_batches_{shape}", gaps, "batches", 0)
    return events / seconds


# ----------------------------------------------------------------- step_p50_ms_256


async def committing_steps(session: Session, rng: np.random.Generator, steps: int) -> list[float]:
    """Latency (ms) of each of `steps` timed committing Steps over STEP_SEQS sequences."""
    seq_ids = list(range(STEP_SEQS))
    await allocate_all(session, seq_ids)
    latencies = []
    for index in range(WARMUP_STEPS + steps):
        if index and index % RECYCLE_STEPS == 0:
            await recycle(session, seq_ids)
        tokens = rng.integers(0, VOCAB, STEP_SEQS).tolist()
        start = time.perf_counter()
        await session.step(seq_ids, tokens, commit=True)
        if index >= WARMUP_STEPS:
            latencies.append((time.perf_counter() - start) * 1000)
    await session.batch([Free(seq_id) for seq_id in seq_ids])
    return latencies


async def step_round(target: str, seed: int, steps: int) -> list[float]:
    async with await PoolClient.connect(target, timeout=30) as client, \
            await client.open_session("bench-events-step") as session:
        return await committing_steps(session, np.random.default_rng(seed), steps)


def measure_step_cost(rounds: int, steps: int) -> None:
    pool = ("--num-blocks", str(STEP_BLOCKS), "--block-size", str(BLOCK_SIZE),
            "--dtype", "float16")
    latencies: dict[str, list[float]] = {"events": [], "no_events": []}
    with events_endpoint() as endpoint, \
            running_pagedkvd(*pool, *events_args(endpoint)) as on, running_pagedkvd(*pool) as off:
        print(f"# {pin_all([on, off])}", flush=True)
        # The subscriber stays for every round; its window is the whole measurement.
        start_at = time.time() + 2.0
        with subscriber(endpoint, start_at, start_at + 24 * 3600) as counts:
            time.sleep(2.0)
            for index in range(rounds):
                sides = [("events", on), ("no_events", off)]
                for name, daemon in sides if index % 2 == 0 else sides[::-1]:
                    latencies[name] += asyncio.run(step_round(daemon.target, index, steps))
    p50 = {name: float(np.percentile(found, 50)) for name, found in latencies.items()}
    for name, found in latencies.items():
        figure(f"step_p50_ms_{STEP_SEQS}_{name}", p50[name], "ms")
        figure(f"step_p99_ms_{STEP_SEQS}_{name}", float(np.percentile(found, 99)), "ms")
    figure("step_p50_events_ratio", p50["events"] / p50["no_events"], "ratio")
    figure("step_events_received", counts[0], "events", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="of the events_per_s window")
    parser.add_argument("--rounds", type=int, default=10, help="step rounds per daemon")
    parser.add_argument("--subscribe", nargs=3, metavar=("ENDPOINT", "START_AT", "STOP_AT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--churn", nargs=5,
                        metavar=("TARGET", "START_AT", "STOP_AT", "SEED", "SHAPE"),
                        help=argparse.SUPPRESS)
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.subscribe:
        endpoint, start_at, stop_at = args.subscribe
        print(subscribe(endpoint, float(start_at), float(stop_at)))
        return 0
    if args.churn:
        target, start_at, stop_at, seed, shape = args.churn
        print(asyncio.run(churn(target, float(start_at), float(stop_at), int(seed), shape)))
        return 0
    measure_events_max(1.0 if args.quick else args.seconds)
    measure_step_cost(2 if args.quick else args.rounds, 40 if args.quick else TIMED_STEPS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
