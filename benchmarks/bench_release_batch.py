"""A runner's release of a whole batch in the daemon: one Batch of SEQS Appends, a Commit and
SEQS Frees, through the service layer in process (`PoolService`, a real `BlockPool`, pool
memory in a temporary folder, no gRPC), one asyncio loop.

Workload: bench_runner's prompts (SEQS = 32 of 20-120 tokens, token ids given, so full blocks
are keyed), allocated in a session of their own; then DECODED decode steps of one token each
(`PoolService.step` with commit, as a runner's reservation renewals certify); then the timed
Batch a runner sends when its client releases them: per sequence an Append of the RESERVED
tokens it decoded into reserved slots since, one Commit of all, per sequence a Free. The
session is closed after each round (untimed). Medians of ROUNDS rounds after one untimed.

    release_batch_ms       the Batch, median
    release_batch_ops      ops in it

Runs against an older tree too: PYTHONPATH pointing at its `pagedkv` folder (2 x SEQS + 1 ops
went one by one through the pool before a Batch's Appends ran as one: 4.3 ms here).
Usage: python benchmarks/bench_release_batch.py [--rounds N]
"""

import argparse
import asyncio
import random
import statistics
import tempfile
import time

from bench_runner import BLOCK_SIZE, NUM_BLOCKS, make_prompts

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.service.operations import Allocate, Append, Commit, Free, Operation
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.process import log_setup
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

SEQS = 32
# Tokens each sequence decodes by Steps, then into its reserved slots (appended by the release).
DECODED, RESERVED = 48, 15


async def release_ms(service: PoolService, prompts: list[list[int]], rng: random.Random) -> float:
    """One round: allocate, decode, then the timed release Batch (milliseconds)."""
    sid = service.open_session("runner").session_id
    await service.batch(sid, [Allocate(s, len(p), p) for s, p in enumerate(prompts)])
    seqs = list(range(len(prompts)))
    out = [[rng.randrange(1000) for _ in range(DECODED + RESERVED)] for _ in prompts]
    for t in range(DECODED):
        await service.step(sid, seqs, 1, [o[t] for o in out], commit=True)
    ops: list[Operation] = [Append(s, RESERVED, out[s][DECODED:]) for s in seqs]
    ops += [Commit(seqs), *(Free(s) for s in seqs)]
    started = time.perf_counter()
    await service.batch(sid, ops)
    seconds = time.perf_counter() - started
    await service.close_session(sid)
    return 1000 * seconds


async def measure(rounds: int, folder: str) -> list[float]:
    memory = KVPoolMemory.create(TINY_CPU_GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float32",
                                 shm_dir=folder)
    service = PoolService(BlockPool(NUM_BLOCKS, BLOCK_SIZE), memory, pool_id="release",
                          geometry=TINY_CPU_GEOMETRY)
    prompts, rng = make_prompts()[:SEQS], random.Random(0)
    try:
        await release_ms(service, prompts, rng)  # warm-up
        return [await release_ms(service, prompts, rng) for _ in range(rounds)]
    finally:
        await service.stop()
        memory.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    log_setup.configure("warning")  # no "session opened" lines among the figures
    with tempfile.TemporaryDirectory(prefix="pkv-release-") as folder:
        times = asyncio.run(measure(args.rounds, folder))
    print(f"release_batch_ms: {statistics.median(times):.2f} ms")
    print(f"release_batch_ops: {2 * SEQS + 1} ops")


if __name__ == "__main__":
    main()
