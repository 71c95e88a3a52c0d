"""KeepAlive latency and lease expiries of a light client while another drives heavy memory work.

A real `pagedkvd` (Llama-3.1-8B geometry, bf16, B = 16: 2 MiB a block, a CPU pool in /dev/shm,
`--zero-freed-blocks`) serves two client processes that start together and run for SECONDS:

- heavy (A): HEAVY_SEQS parents of PARENT_TOKENS tokens (a partial last block each). Each
  iteration forks every parent (one Batch), Steps the children once (each child writes into
  its parent's shared partial last block: HEAVY_SEQS copy-on-write copies, 128 MiB), then frees
  the children (one Batch; their private copies are zeroed, 128 MiB). Every LONG_EVERY
  iterations it also allocates and frees a LONG_TOKENS sequence (1 GiB zeroed).
- light (B): a session with a LEASE_MS lease and no background keep-alive; it sends KeepAlive
  every KEEPALIVE_PERIOD_S from a task of its own and times each round trip, and every
  SMALL_STEP_PERIOD_S a small Step (SMALL_SEQS sequences) that touches none of A's blocks:
  memory work is ordered per block (daemon/service/memory_order.py), so it waits for none of
  A's copies or zeroing (before, it waited behind them for the pool lock).

Figures:
    keepalive_p50_ms_during_heavy_steps, keepalive_p99_ms_during_heavy_steps  (target p99 <= 20)
    keepalive_max_ms_during_heavy_steps
    healthy_sessions_expired     leases the daemon let run out (its pagedkv:lease_expiries
                                 counter; target 0); both sessions are healthy
    light_keepalive_send_gap_max_ms  the longest time between two KeepAlives B sent: past
                                 LEASE_MS, B's own process stalled (a loaded machine) and its
                                 lease could run out through no fault of the daemon
    light_session_failures       calls of B that failed (FAILED_PRECONDITION = expired, ...)
    heavy_step_ms_p50, heavy_step_ms_p99   A's Step (HEAVY_SEQS copies), for context
    small_step_ms_p50, small_step_ms_max   B's Step while A's memory work runs
    small_step_ms_p99_during_heavy_copies  (target <= 10)
    heavy_copied_gib, zeroed_gib           memory work done in the window

With `--baseline-rev REV` the same measurement runs first on the code of git revision REV
(archived into a temporary folder and put first on PYTHONPATH, which the daemon and clients
inherit), its figures suffixed `_baseline`, then on this tree, and
`small_step_p99_vs_baseline` is the ratio of the two p99s (e.g. REV = c5eb497^, the pool-wide
lock held across memory work). PYTHONPATH pointing at an old tree's `pagedkv` folder by hand
does the same for one run.
With `--pin`, the daemon gets one CPU of its own and the clients the others.
Usage: python benchmarks/bench_keepalive_stall.py [--seconds S] [--pin] [--baseline-rev REV]
"""

import argparse
import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np
from daemon_process import pin

from pagedkv.client import Allocate, Fork, Free, PagedKVError, PoolClient
from pagedkv.process.launch import READY_STATE, free_tcp_port, log_tail, start_daemon

MODEL = "llama-3.1-8b"
BLOCK_SIZE = 16
NUM_BLOCKS = 1024  # 2 GiB of pool memory
HEAVY_SEQS = 64
PARENT_TOKENS = 40  # 2.5 blocks: the last one partial, shared with the child after a fork
LONG_TOKENS = 8192  # 512 blocks, 1 GiB to zero when freed
LONG_EVERY = 4
LEASE_MS = 300
KEEPALIVE_PERIOD_S = 0.1
SMALL_STEP_PERIOD_S = 0.1
SMALL_SEQS = 4
SECONDS = 20.0
# Time for both client processes to start and set up before the timed window opens.
START_DELAY_S = 4.0
# Deadline of every client call: a heavy call may legitimately take a while.
CALL_TIMEOUT_S = 30.0
SHM = Path("/dev/shm")


def lease_expiries(metrics_port: int) -> int:
    """The daemon's count of sessions it expired, from /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("pagedkv:lease_expiries_total "):
                return int(float(line.split()[1]))
    raise RuntimeError("no pagedkv:lease_expiries_total in /metrics")


async def wait_until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.time()))


# ------------------------------------------------------------------- heavy client (A)

async def heavy(target: str, start_at: float, seconds: float) -> dict[str, Any]:
    async with await PoolClient.connect(target, timeout=CALL_TIMEOUT_S) as client, \
            await client.open_session("heavy") as session:
        parents = list(range(HEAVY_SEQS))
        children = [HEAVY_SEQS + p for p in parents]
        long_seq = 2 * HEAVY_SEQS
        await session.batch([Allocate(p, PARENT_TOKENS) for p in parents])
        await wait_until(start_at)
        steps_ms: list[float] = []
        copies = zeroed = long_frees = 0
        while time.time() < start_at + seconds:
            await session.batch([Fork(p, c) for p, c in zip(parents, children, strict=True)])
            began = time.perf_counter()
            result = await session.step(children)
            steps_ms.append((time.perf_counter() - began) * 1000)
            copies += len(result.copies)
            await session.batch([Free(c) for c in children])
            zeroed += len(result.copies)  # the children's private copies, now released
            if len(steps_ms) % LONG_EVERY == 0:
                await session.allocate(long_seq, LONG_TOKENS)
                zeroed += await session.free(long_seq)
                long_frees += 1
        return {"steps_ms": steps_ms, "copies": copies, "zeroed": zeroed,
                "long_frees": long_frees}


# ------------------------------------------------------------------- light client (B)

async def light(target: str, start_at: float, seconds: float) -> dict[str, Any]:
    end_at = start_at + seconds
    failures: list[str] = []
    keepalive_ms: list[float] = []
    # Time between the starts of consecutive KeepAlives (the period, or a round trip, or the
    # client process stalled: on a loaded machine, past the lease when it is not scheduled).
    send_gaps_ms: list[float] = []
    small_ms: list[float] = []
    async with await PoolClient.connect(target, timeout=CALL_TIMEOUT_S) as client:
        session = await client.open_session("light", lease_ttl_ms=LEASE_MS, keep_alive=False)
        seqs = list(range(SMALL_SEQS))
        running = True

        async def call(what: str, timings: list[float] | None, request: Awaitable[Any]) -> None:
            """Await one call; time its round trip (answer or error) if it began in the window;
            record it if it failed."""
            began_at, began = time.time(), time.perf_counter()
            try:
                await request
            except PagedKVError as exc:
                failures.append(f"{what}: {type(exc).__name__}: {exc.message}")
            if timings is not None and start_at <= began_at <= end_at:
                timings.append((time.perf_counter() - began) * 1000)

        async def keep_alives() -> None:
            next_at = sent = time.time()
            while running:
                now = time.time()
                if start_at <= now <= end_at:
                    send_gaps_ms.append((now - sent) * 1000)
                sent = now
                await call("KeepAlive", keepalive_ms, session.keep_alive())
                next_at = max(next_at + KEEPALIVE_PERIOD_S, time.time())
                await wait_until(next_at)

        # Pinging starts at once: a 300 ms lease does not outlast the wait for the window.
        pings = asyncio.create_task(keep_alives())
        try:
            await call("Batch", None, session.batch([Allocate(s, 20) for s in seqs]))
            await wait_until(start_at)
            while time.time() < end_at:
                await call("Step", small_ms, session.step(seqs))
                await asyncio.sleep(min(SMALL_STEP_PERIOD_S, max(0.0, end_at - time.time())))
            await call("GetStats", None, session.stats())  # still alive at the end?
        finally:
            running = False
            await pings
        await session.close()
        return {"keepalive_ms": keepalive_ms, "small_ms": small_ms, "failures": failures,
                "send_gaps_ms": send_gaps_ms}


# ------------------------------------------------------------------------- driver

def run_role(role: str, target: str, start_at: float, seconds: float) -> None:
    measure = heavy if role == "heavy" else light
    print(json.dumps(asyncio.run(measure(target, start_at, seconds))))


def spawn(role: str, target: str, start_at: float, seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, "--role", role, target, str(start_at),
                             str(seconds)], stdout=subprocess.PIPE)


async def bytes_per_block(target: str) -> int:
    """Bytes of one block of the daemon's pool."""
    async with await PoolClient.connect(target, timeout=CALL_TIMEOUT_S) as client:
        info = await client.pool_info()
        return info.bytes_per_block


def report(a: dict[str, Any], b: dict[str, Any], expiries: int, block_bytes: int,
           suffix: str) -> None:
    keepalive, steps, small = (np.array(values or [np.nan]) for values in (
        b["keepalive_ms"], a["steps_ms"], b["small_ms"]))
    gib = block_bytes / 2**30

    def figure(name: str, value: float, unit: str, digits: int = 1) -> None:
        print(f"{name}{suffix}: {value:.{digits}f} {unit}")

    figure("keepalives_timed", len(b["keepalive_ms"]), "calls", 0)
    figure("keepalive_p50_ms_during_heavy_steps", np.percentile(keepalive, 50), "ms", 2)
    figure("keepalive_p99_ms_during_heavy_steps", np.percentile(keepalive, 99), "ms", 2)
    figure("keepalive_max_ms_during_heavy_steps", keepalive.max(), "ms", 2)
    figure("healthy_sessions_expired", expiries, "sessions", 0)
    figure("light_keepalive_send_gap_max_ms", max(b["send_gaps_ms"] or [np.nan]), "ms")
    figure("light_session_failures", len(b["failures"]), "calls", 0)
    for failure in b["failures"][:3]:
        print(f"# light client: {failure}")
    figure("heavy_steps", len(a["steps_ms"]), "steps", 0)
    figure("heavy_step_ms_p50", np.percentile(steps, 50), "ms")
    figure("heavy_step_ms_p99", np.percentile(steps, 99), "ms")
    figure("small_steps_timed", len(b["small_ms"]), "steps", 0)
    figure("small_step_ms_p50", np.percentile(small, 50), "ms")
    figure("small_step_ms_p99_during_heavy_copies", np.percentile(small, 99), "ms")
    figure("small_step_ms_max", small.max(), "ms")
    figure("heavy_copied_gib", a["copies"] * gib, "GiB")
    figure("zeroed_gib", a["zeroed"] * gib, "GiB")


def run_baseline(rev: str, seconds: float, pin_daemon: bool) -> float:
    """This script's measurement on the code of git revision `rev`: its figures printed as they
    come, suffixed `_baseline`; returns its small_step_ms_p99_during_heavy_copies."""
    with tempfile.TemporaryDirectory(prefix="pkv-baseline-") as folder:
        tree = Path(folder) / "pagedkv"
        tree.mkdir()
        # From the repository's root: in a subfolder, git archives only that subfolder.
        archive = subprocess.run(["git", "archive", rev], check=True, capture_output=True,
                                 cwd=Path(__file__).resolve().parents[1]).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [folder, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, __file__, "--seconds", str(seconds), "--suffix", "_baseline",
                   *(["--pin"] if pin_daemon else [])]
        output = subprocess.run(command, env=env, check=True, capture_output=True,
                                text=True).stdout
    print(f"# baseline: git revision {rev}")
    print(output, end="")
    line = next(line for line in output.splitlines()
                if line.startswith("small_step_ms_p99_during_heavy_copies_baseline:"))
    return float(line.split()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--pin", action="store_true", help="daemon on a CPU of its own")
    parser.add_argument("--baseline-rev", default=None,
                        help="measure this git revision's code first, as the baseline")
    parser.add_argument("--suffix", default="", help=argparse.SUPPRESS)
    parser.add_argument("--role", nargs=4, metavar=("ROLE", "TARGET", "START_AT", "SECONDS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role, target, start_at, seconds = args.role
        run_role(role, target, float(start_at), float(seconds))
        return 0
    baseline = None
    if args.baseline_rev:
        baseline = run_baseline(args.baseline_rev, args.seconds, args.pin)
    p99 = measure(args.seconds, args.pin, args.suffix)
    if p99 is None:
        return 1
    if baseline is not None:
        print(f"small_step_p99_vs_baseline: {p99 / baseline:.3f} ratio")
    return 0


def measure(seconds: float, pin_daemon: bool, suffix: str) -> float | None:
    """One run of the daemon and both clients; prints the figures and returns the small Step's
    p99 (None when /dev/shm has no room)."""
    need = NUM_BLOCKS * 2**21 * 5 // 4  # the pool (2 MiB blocks) and some room
    if shutil.disk_usage(SHM).free < need:
        print(f"# {SHM} has under {need / 2**30:.1f} GiB free", file=sys.stderr)
        return None
    metrics_port = free_tcp_port()
    # The daemon's socket, log and pool file in a tmpfs folder.
    with tempfile.TemporaryDirectory(prefix="pkv-ka-", dir=SHM) as name, \
            start_daemon(Path(name), "--model-config", MODEL, "--num-blocks", str(NUM_BLOCKS),
                         "--block-size", str(BLOCK_SIZE), "--zero-freed-blocks", "--shm-dir", name,
                         "--metrics-listen", f"127.0.0.1:{metrics_port}",
                         "--log-level", "warning") as daemon:
        try:
            print(f"# {pin(daemon.process) if pin_daemon else 'unpinned'}; load average "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            daemon.wait_for_notification(READY_STATE)
            block_bytes = asyncio.run(bytes_per_block(daemon.unix_target))
            start_at = time.time() + START_DELAY_S
            clients = [spawn(role, daemon.unix_target, start_at, seconds)
                       for role in ("heavy", "light")]
            limit = START_DELAY_S + seconds + 60
            a, b = (json.loads(c.communicate(timeout=limit)[0]) for c in clients)
            report(a, b, lease_expiries(metrics_port), block_bytes, suffix)
        finally:
            if daemon.stop():
                print(log_tail(daemon.log_path), file=sys.stderr)
    return float(np.percentile(b["small_ms"], 99)) if b["small_ms"] else float("nan")


if __name__ == "__main__":
    sys.exit(main())
