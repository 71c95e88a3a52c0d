"""Load on a pagedkvd: client processes with a serving mix, and one that is SIGKILLed.

Healthy clients (one process and one session each, the default lease kept alive by the client's
background task) run a scheduler loop for `seconds`: admit requests (prompts of 20-300 tokens
with their ids, half behind a shared system prompt so committed blocks are found in the cache),
Step every live sequence by one token with commit=True, fork some for parallel sampling,
copy-on-write a block now and then (a beam rewriting its tail), and finish requests with
Batch[Commit, Free] so their blocks stay cached. A request that finds no room preempts the
longest sequence, as a scheduler would. Meanwhile a victim process opens short-lease sessions
(500 ms), allocates and steps, and is SIGKILLed every few seconds and started again.

At the end every healthy client closes its session; once the victims' leases lapse the pool
must hold no used block. Figures: ops/s (RPCs of the healthy clients), Step p50/p99, healthy
sessions that expired (0), blocks leaked (0).

Usage: python benchmarks/load_daemon.py [--clients 8] [--seconds 60] [--seed 1]
"""

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from daemon_process import running_pagedkvd
from pool_metrics import pool_figures

from pagedkv.client import (
    Commit,
    Free,
    PagedKVError,
    PoolClient,
    PoolExhausted,
    Session,
    SessionExpired,
    SessionNotFound,
)
from pagedkv.proto import kvpool_pb2 as pb

T = TypeVar("T")
# A pool the full run fits: 8 clients x 12 live requests x ~20 blocks, plus the cache.
DAEMON_ARGS = ("--num-blocks", "4096", "--block-size", "16")
VICTIM_LEASE_MS = 500
# Seconds between a victim's start and its SIGKILL.
VICTIM_LIFE_S = (1.5, 4.0)
VOCAB = 32_000
SYSTEM_PROMPT = list(range(1000, 1064))  # 4 full blocks shared by half the requests


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 8
    seconds: float = 60.0
    seed: int = 1
    # Requests each client keeps in flight.
    max_live: int = 12
    # Kill victims at all.
    victims: bool = True
    # Time for client processes to import and connect before the timed run starts.
    warmup_s: float = 4.0


@dataclass
class WorkerResult:
    """What one healthy client reports (JSON on its stdout)."""

    # RPCs sent, over this many seconds of the timed run.
    ops: int = 0
    seconds: float = 0.0
    # Latency of every successful Step.
    step_ms: list[float] = field(default_factory=list)
    # Failed calls by exception name (PoolExhausted is expected: a full pool preempts).
    errors: dict[str, int] = field(default_factory=dict)
    expired: bool = False


@dataclass
class LoadReport:
    # RPCs per second of the healthy clients together, and their Step latencies.
    ops_per_s: float
    step_p50_ms: float
    step_p99_ms: float
    # Healthy clients whose session the daemon expired (must be 0).
    healthy_sessions_expired: int
    # Used blocks and sequences once every session closed or lapsed (must be 0).
    blocks_leaked: int
    sequences_leaked: int
    # Victim processes SIGKILLed, and their allocations that succeeded (so the kills had
    # blocks to leak).
    victim_kills: int
    victim_allocations: int
    # Failed calls of the healthy clients by exception name ("PoolExhausted" is expected).
    errors: Counter[str]

    def figures(self) -> list[str]:
        unexpected = sum(n for name, n in self.errors.items() if name != "PoolExhausted")
        return [f"load_ops_per_s: {self.ops_per_s:.0f} ops/s",
                f"load_step_p50_ms: {self.step_p50_ms:.3f} ms",
                f"load_step_p99_ms: {self.step_p99_ms:.3f} ms",
                f"load_healthy_sessions_expired: {self.healthy_sessions_expired} sessions",
                f"load_blocks_leaked: {self.blocks_leaked} blocks",
                f"load_victim_kills: {self.victim_kills} kills",
                f"load_victim_allocations: {self.victim_allocations} allocations",
                f"load_pool_exhausted: {self.errors['PoolExhausted']} calls",
                f"load_unexpected_errors: {unexpected} calls"]


# ---------------------------------------------------------------- healthy client

class Scheduler:
    """One client's request mix over its session; counts every RPC."""

    def __init__(self, session: Session, rng: random.Random, max_live: int) -> None:
        self.session = session
        self.rng = rng
        self.max_live = max_live
        # seq id -> decode tokens still to generate.
        self.live: dict[int, int] = {}
        self.next_id = 0
        self.result = WorkerResult()

    async def call(self, what: Awaitable[T]) -> T:
        self.result.ops += 1
        try:
            return await what
        except PagedKVError as exc:
            name = type(exc).__name__
            self.result.errors[name] = self.result.errors.get(name, 0) + 1
            if isinstance(exc, SessionExpired | SessionNotFound):
                self.result.expired = True
            raise

    async def tick(self) -> None:
        rng, session = self.rng, self.session
        if len(self.live) < self.max_live and rng.random() < 0.5:
            await self.admit()
        if self.live and len(self.live) < self.max_live and rng.random() < 0.05:
            parent = rng.choice(list(self.live))
            child = self.new_id()
            await self.call(session.fork(parent, child))
            self.live[child] = self.live[parent]
        if self.live and rng.random() < 0.03:
            seq_id = rng.choice(list(self.live))
            table = (await self.call(session.block_tables([seq_id])))[0]
            if table.block_ids:
                await self.call(session.copy_on_write(seq_id, len(table.block_ids) - 1))
        if self.live:
            await self.step()
        for seq_id in [s for s, left in self.live.items() if left <= 0]:
            await self.finish(seq_id)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    async def admit(self) -> None:
        n = self.rng.randint(20, 300)
        prompt = [self.rng.randrange(VOCAB) for _ in range(n)]
        if self.rng.random() < 0.5:
            prompt = (SYSTEM_PROMPT + prompt)[:n]
        seq_id = self.new_id()
        try:
            await self.call(self.session.allocate(seq_id, token_ids=prompt))
        except PoolExhausted:
            await self.preempt()
            return
        self.live[seq_id] = self.rng.randint(16, 160)

    async def step(self) -> None:
        seq_ids = list(self.live)
        tokens = [self.rng.randrange(VOCAB) for _ in seq_ids]
        start = time.perf_counter()
        try:
            await self.call(self.session.step(seq_ids, tokens, commit=True))
        except PoolExhausted:
            await self.preempt()
            return
        self.result.step_ms.append((time.perf_counter() - start) * 1000)
        for seq_id in seq_ids:
            self.live[seq_id] -= 1

    async def finish(self, seq_id: int) -> None:
        """Commit then free: the request's full blocks stay cached for later prompts."""
        await self.call(self.session.batch([Commit([seq_id]), Free(seq_id)]))
        del self.live[seq_id]

    async def preempt(self) -> None:
        """No room: drop the sequence with the most tokens left (it would be recomputed)."""
        if self.live:
            victim = max(self.live, key=lambda s: self.live[s])
            await self.call(self.session.free(victim))
            del self.live[victim]


async def healthy_client(target: str, seed: int, start_at: float, seconds: float,
                         max_live: int) -> WorkerResult:
    async with await PoolClient.connect(target, timeout=30) as client:
        session = await client.open_session(f"load-{seed}", cache_salt=b"load")
        scheduler = Scheduler(session, random.Random(seed), max_live)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        began = time.monotonic()
        while time.time() < start_at + seconds and not scheduler.result.expired:
            try:
                await scheduler.tick()
            except PagedKVError:
                continue  # counted (an expired session ends the loop); a scheduler carries on
        scheduler.result.seconds = time.monotonic() - began
        scheduler.result.expired |= session.lease_error is not None
        await session.close()
        return scheduler.result


# ---------------------------------------------------------------------- victim

async def victim(target: str, seed: int) -> None:
    """Open short-lease sessions, allocate and step in them, never close most of them, until
    SIGKILLed: a client that dies holding blocks. Some sessions keep their lease alive (they
    lapse after the kill), others stop calling and lapse while the victim lives. Prints a line
    per allocation (the parent counts them)."""
    rng = random.Random(seed)
    async with await PoolClient.connect(target, timeout=30) as client:
        kept: list[Session] = []
        while True:
            keep = rng.random() < 0.7
            session = await client.open_session("victim", lease_ttl_ms=VICTIM_LEASE_MS,
                                                cache_salt=b"load", keep_alive=keep)
            if keep:
                kept.append(session)
            if len(kept) > 3:
                await kept.pop(0).close()
            seq_ids: list[int] = []
            for seq_id in range(1, rng.randint(2, 6)):
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(20, 300))]
                try:
                    await session.allocate(seq_id, token_ids=prompt)
                except PagedKVError:
                    break
                seq_ids.append(seq_id)
                print("allocated", flush=True)
            for _ in range(rng.randint(1, 20) if seq_ids else 0):
                try:
                    await session.step(seq_ids, commit=True)
                except PagedKVError:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0.0, 0.2))


# ------------------------------------------------------------------- the run

def run_load(target: str, metrics: str, config: LoadConfig) -> LoadReport:
    """Drive the daemon at `target` (no other client) and report."""
    rng = random.Random(config.seed)
    start_at = time.time() + config.warmup_s
    workers = [subprocess.Popen(
        [sys.executable, __file__, "--worker", target, str(config.seed * 1000 + i),
         str(start_at), str(config.seconds), str(config.max_live)],
        stdout=subprocess.PIPE) for i in range(config.clients)]
    kills, allocations = 0, 0
    while config.victims and time.time() < start_at + config.seconds:
        process = subprocess.Popen([sys.executable, __file__, "--victim", target,
                                    str(rng.randrange(1 << 30))], stdout=subprocess.PIPE)
        time.sleep(min(rng.uniform(*VICTIM_LIFE_S), max(0.1, start_at + config.seconds
                                                       - time.time())))
        process.kill()
        out, _ = process.communicate()
        kills += 1
        allocations += out.count(b"allocated")
    results = [worker_result(w, config.seconds + 120) for w in workers]
    stats = wait_for_empty_pool(metrics)
    steps = [ms for result in results for ms in result.step_ms]
    errors: Counter[str] = Counter()
    for result in results:
        errors.update(result.errors)
    p50, p99 = np.percentile(steps, [50, 99]) if steps else (float("nan"), float("nan"))
    return LoadReport(
        ops_per_s=sum(r.ops / r.seconds for r in results if r.seconds > 0),
        step_p50_ms=float(p50), step_p99_ms=float(p99),
        healthy_sessions_expired=sum(r.expired for r in results),
        blocks_leaked=stats.used_blocks, sequences_leaked=stats.num_sequences,
        victim_kills=kills, victim_allocations=allocations, errors=errors)


def worker_result(worker: subprocess.Popen[bytes], timeout: float) -> WorkerResult:
    """A healthy client's report; a client that crashed counts as one "crashed" error."""
    out, _ = worker.communicate(timeout=timeout)
    try:
        return WorkerResult(**json.loads(out))
    except (ValueError, TypeError):
        return WorkerResult(errors={"crashed": 1})


def wait_for_empty_pool(metrics: str, patience_s: float = 10.0) -> pb.PoolStats:
    """The pool's figures once no session is left, or after `patience_s` (victims' leases
    lapse within VICTIM_LEASE_MS and the reaper's 100 ms)."""
    deadline = time.monotonic() + patience_s
    while True:
        stats = pool_figures(metrics)
        if stats.num_sessions == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", help="load this daemon instead of starting one "
                        f"({' '.join(DAEMON_ARGS)})")
    parser.add_argument("--metrics", help="host:port of --target's /metrics")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--victim", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        target, seed, start_at, seconds, max_live = args.worker
        result = asyncio.run(healthy_client(target, int(seed), float(start_at), float(seconds),
                                            int(max_live)))
        print(json.dumps(result.__dict__))
        return 0
    if args.victim:
        asyncio.run(victim(args.victim[0], int(args.victim[1])))
        return 0
    config = LoadConfig(clients=args.clients, seconds=args.seconds, seed=args.seed)
    if args.target:
        report = run_load(args.target, args.metrics, config)
    else:
        with running_pagedkvd(*DAEMON_ARGS) as daemon:
            report = run_load(daemon.target, daemon.metrics, config)
    for line in report.figures():
        print(line)
    bad = report.healthy_sessions_expired or report.blocks_leaked or report.sequences_leaked
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
