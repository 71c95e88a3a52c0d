"""What the crash log costs (restore = "auto" with crash_log, daemon/service/crash_log.py): a
decode Step of 256 sequences with the log on against off, measured side by side in one run
(alternating, so both see the same host), and what a crash restore then costs.

Through the Step RPC: two real `pagedkvd`s (restore = "auto", one with --no-crash-log), one
client session each holding SEQS sequences, STEPS Steps of one token per sequence each,
alternating between the two daemons:

    wal_step_p50_ms_off        p50 of a Step RPC, no log
    wal_step_p50_ms_on         p50 of a Step RPC, the log on (its shm_dir a tmpfs)
    wal_step_p50_ratio         on / off (goal <= 1.10)

Inside the daemon, with no gRPC around it (the log's cost over the bookkeeping alone: the
strictest ratio), two PoolServices (no memory), each with one session of SEQS sequences of
PROMPT tokens (token ids given, committed), then STEPS decode steps of `PoolService.step`
(the servicer's Step without the gRPC edge), one token per sequence with its id and
commit=True, as a runner's step certifies the previous tokens:

    wal_service_step_p50_ms_off   p50 of a Step with no log
    wal_service_step_p50_ms_on    p50 of a Step with the log (in a temporary folder on
                                  /dev/shm when it exists, as the daemon's shm_dir)
    wal_service_step_p50_ratio    on / off
    wal_bytes_per_step            log bytes one Step adds
    wal_checkpoint_ms             a checkpoint of the filled service (once per
                                  crash_log_bytes of records; under the lock), its file
                                  allocated ahead by a thread (as a log SPARE_AT full has it)
    wal_checkpoint_cold_ms        the same allocating its own file (a spare not ready yet)
    wal_checkpoint_image_ms       of which the service's image alone (what is left under the
                                  lock once the file is allocated ahead)
    wal_replay_ms                 replay_log of the whole run into a fresh service (a crash
                                  restore, before check_invariants)

Usage: python benchmarks/bench_crash_log.py [--quick]
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from daemon_process import running_pagedkvd

from pagedkv.client import Allocate as ClientAllocate
from pagedkv.client import PoolClient
from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.service.crash_log import log_path
from pagedkv.daemon.service.log_replay import open_log, replay_log
from pagedkv.daemon.service.operations import Allocate, Commit
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.process import log_setup

BLOCK_SIZE = 16
SEQS = 256
PROMPT = 64
LEASE_MS = 600_000


def service(pool_id: str, num_blocks: int) -> PoolService:
    return PoolService(BlockPool(num_blocks, BLOCK_SIZE), None, pool_id=pool_id,
                       max_lease_ttl_ms=LEASE_MS, default_lease_ttl_ms=LEASE_MS)


async def filled(pool_id: str, num_blocks: int) -> tuple[PoolService, str]:
    svc = service(pool_id, num_blocks)
    sid = svc.open_session("bench").session_id
    ops = [Allocate(q, PROMPT, [q * PROMPT + t for t in range(PROMPT)]) for q in range(SEQS)]
    await svc.batch(sid, [*ops, Commit(list(range(SEQS)))])
    return svc, sid


async def timed_step(svc: PoolService, sid: str, token: int) -> float:
    start = time.perf_counter()
    await svc.step(sid, range(SEQS), 1, [token] * SEQS, commit=True)
    return time.perf_counter() - start


async def rpc_step_times(steps: int, num_blocks: int) -> tuple[list[float], list[float]]:
    """Step RPC latencies (s) of a daemon with no crash log and of one with it, alternating."""
    args = ("--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE),
            "--restore", "auto", "--lease-ttl-ms", str(LEASE_MS))
    with tempfile.TemporaryDirectory() as state, \
            running_pagedkvd(*args, "--state-dir", f"{state}/off", "--no-crash-log") as off, \
            running_pagedkvd(*args, "--state-dir", f"{state}/on") as on:
        async with await PoolClient.connect(off.target) as off_client, \
                await PoolClient.connect(on.target) as on_client:
            sessions = [await client.open_session("bench", keep_alive=False)
                        for client in (off_client, on_client)]
            seq_ids = list(range(SEQS))
            for session in sessions:
                await session.batch([ClientAllocate(q, token_ids=list(range(PROMPT)))
                                     for q in seq_ids])
            times: tuple[list[float], list[float]] = ([], [])
            for i in range(steps):
                for which in ((0, 1) if i % 2 else (1, 0)):
                    start = time.perf_counter()
                    await sessions[which].step(seq_ids, [1000 + i] * SEQS)
                    times[which].append(time.perf_counter() - start)
    return times


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few steps, for the tests")
    args = parser.parse_args()
    log_setup.configure("warning")
    steps = 20 if args.quick else 400
    num_blocks = SEQS * -(-(PROMPT + steps + 1) // BLOCK_SIZE) + 64
    rpc_off, rpc_on = await rpc_step_times(steps, num_blocks)
    print(f"wal_step_p50_ms_off: {statistics.median(rpc_off) * 1000:.3f} ms")
    print(f"wal_step_p50_ms_on: {statistics.median(rpc_on) * 1000:.3f} ms")
    print(f"wal_step_p50_ratio: {statistics.median(rpc_on) / statistics.median(rpc_off):.3f} x")
    off, off_sid = await filled("off", num_blocks)
    on, on_sid = await filled("on", num_blocks)
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as folder:
        path = log_path(Path(folder), "on")
        crash_log = open_log(on, path, max_bytes=64 << 20)
        base_bytes = crash_log.size
        times_off: list[float] = []
        times_on: list[float] = []
        for i in range(steps):  # alternating, which goes first too
            pair = [(off, off_sid, times_off), (on, on_sid, times_on)]
            for svc, sid, times in (pair if i % 2 else pair[::-1]):
                times.append(await timed_step(svc, sid, 1000 + i))
        per_step = (crash_log.size - base_bytes) / steps
        start = time.perf_counter()
        crash_log.start()  # no spare: it allocates its file
        cold = time.perf_counter() - start
        crash_log.make_spare()  # as a log SPARE_AT full does
        assert crash_log.spare is not None
        crash_log.spare.result()
        start = time.perf_counter()
        crash_log.start()
        checkpoint = time.perf_counter() - start
        start = time.perf_counter()
        crash_log.image()
        image = time.perf_counter() - start
        again = service("next", num_blocks)
        start = time.perf_counter()
        await replay_log(again, path, adopted_from="on")
        replay = time.perf_counter() - start
    p50_off, p50_on = statistics.median(times_off), statistics.median(times_on)
    print(f"wal_service_step_p50_ms_off: {p50_off * 1000:.3f} ms")
    print(f"wal_service_step_p50_ms_on: {p50_on * 1000:.3f} ms")
    print(f"wal_service_step_p50_ratio: {p50_on / p50_off:.3f} x")
    print(f"wal_bytes_per_step: {per_step:.0f} bytes")
    print(f"wal_checkpoint_ms: {checkpoint * 1000:.1f} ms")
    print(f"wal_checkpoint_cold_ms: {cold * 1000:.1f} ms")
    print(f"wal_checkpoint_image_ms: {image * 1000:.1f} ms")
    print(f"wal_replay_ms: {replay * 1000:.1f} ms")
    print(f"wal_steps: {steps} steps")


if __name__ == "__main__":
    asyncio.run(main())
