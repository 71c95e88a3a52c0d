"""What `restore = "auto"` costs a restart: writing the snapshot at SIGTERM (after the drain,
inside the unit's TimeoutStopSec) and restoring it at start (before READY=1).

A PoolService of NUM_BLOCKS blocks of B = 16 tokens (no memory: the bookkeeping alone, which
is all a snapshot holds) is filled by SESSIONS sessions of SEQS sequences of TOKENS tokens
each, with token ids (keyed blocks: the prefix cache's chain is kept too), committed. Then:

    snapshot_write_ms      service_image + write_snapshot (msgpack, SHA-256, fsync, rename)
    snapshot_restore_ms    read_snapshot + restore_service into a fresh service
    snapshot_check_ms      check_invariants over the restored service (run at every restore)
    snapshot_bytes         the file's size
    snapshot_sequences     sequences restored (for context)

Usage: python benchmarks/bench_restart_snapshot.py [--quick]
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.process.snapshot_file import read_snapshot, write_snapshot
from pagedkv.daemon.service.operations import Allocate, Commit
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import restore_service, service_image
from pagedkv.process import log_setup

BLOCK_SIZE = 16
IDENTITY = {"num_blocks": 0}


async def filled(num_blocks: int, sessions: int, seqs: int, tokens: int) -> PoolService:
    service = PoolService(BlockPool(num_blocks, BLOCK_SIZE), None, pool_id="before",
                          max_lease_ttl_ms=600_000, default_lease_ttl_ms=600_000)
    for s in range(sessions):
        sid = service.open_session(f"c{s}").session_id
        ops = [Allocate(q, tokens, [(s * seqs + q) * tokens + t for t in range(tokens)])
               for q in range(seqs)]
        await service.batch(sid, [*ops, Commit(list(range(seqs)))])
    return service


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a small pool, for the tests")
    args = parser.parse_args()
    log_setup.configure("warning")  # no "session opened" lines among the figures
    sessions, seqs, tokens = (8, 4, 64) if args.quick else (256, 8, 1000)
    num_blocks = sessions * seqs * -(-tokens // BLOCK_SIZE) + 64
    service = await filled(num_blocks, sessions, seqs, tokens)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pagedkvd.snapshot"
        start = time.perf_counter()
        write_snapshot(path, IDENTITY | {"num_blocks": num_blocks}, service_image(service))
        written = time.perf_counter()
        again = PoolService(BlockPool(num_blocks, BLOCK_SIZE), None, pool_id="after",
                            max_lease_ttl_ms=600_000, default_lease_ttl_ms=600_000)
        read_start = time.perf_counter()
        restore_service(again, read_snapshot(path, IDENTITY | {"num_blocks": num_blocks}),
                        adopted_from="before")
        restored = time.perf_counter()
        again.check_invariants()
        checked = time.perf_counter()
        size = path.stat().st_size
    print(f"snapshot_write_ms: {(written - start) * 1000:.1f} ms")
    print(f"snapshot_restore_ms: {(restored - read_start) * 1000:.1f} ms")
    print(f"snapshot_check_ms: {(checked - restored) * 1000:.1f} ms")
    print(f"snapshot_bytes: {size} bytes")
    print(f"snapshot_sequences: {len(again.pool)} sequences")
    print(f"snapshot_blocks: {num_blocks} blocks")


if __name__ == "__main__":
    asyncio.run(main())
