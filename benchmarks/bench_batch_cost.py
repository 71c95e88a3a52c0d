"""Cost of an all-or-nothing Batch as the pool grows: 8,192 blocks vs 262,144 blocks.

A Batch must leave the pool untouched if any of its ops fails. If that were done by copying the
pool's state (a snapshot), a 2-op Batch would cost O(pool); with an undo journal it costs the
work of its ops. This measures it in process, through the service layer (`PoolService`, a real
`BlockPool`, no pool memory, no gRPC), one asyncio loop, each call timed on its own.

Both pools hold SEQS live sequences with partial last blocks (token ids given, so their full
blocks are keyed) filling about USED_FRACTION of the pool, plus about CACHED_FRACTION of the
pool in committed, evictable prefix-cache blocks. The sequences are as many in both pools and
longer in the big one, so the big pool has more blocks, wider tables and a bigger prefix cache.
Measurements alternate between the pools, ROUNDS rounds of REPS calls each; the median is shown.

    batch_2op_us_{8k,262k}         Batch [Append(a, 1 token), Append(b, 1 token)]: two decode
                                   appends (a, b rotate over the live sequences)
    batch_cost_ratio_262k_vs_8k    batch_2op_us_262k / batch_2op_us_8k (target <= 1.5)
    append_1op_us_{8k,262k}        one unbatched Append of 1 token, for comparison
    batch_alloc_free_us_{8k,262k}  Batch [Allocate(new, 40 tokens with ids), Free(previous)]:
                                   admit one request, retire another
    *_ratio_262k_vs_8k             the same ratio for the other two

The script also runs against the code before the undo journal (PoolService methods were plain
functions then): PYTHONPATH pointing at an old tree's `pagedkv` folder is enough.
Usage: python benchmarks/bench_batch_cost.py [--rounds N] [--reps N]
"""

import argparse
import asyncio
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.service.operations import Allocate, Append, Free, Operation
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.process import log_setup

BLOCK_SIZE = 16
POOL_SIZES = {"8k": 8192, "262k": 262_144}
# Live sequences in each pool, and the share of its blocks they and the prefix cache hold.
SEQS = 2048
USED_FRACTION = 0.55
CACHED_FRACTION = 0.10
# Tokens of the request a Batch [Allocate, Free] admits.
ADMIT_TOKENS = 40
ROUNDS = 10
REPS = 1000
VOCAB = 32_000


async def settled(result: Any) -> Any:
    """A service call's answer: PoolService methods are coroutines since the undo journal; they
    returned directly before, which lets the script measure the old code too."""
    return await result if inspect.isawaitable(result) else result


@dataclass
class Bench:
    """One pool behind a service, one session, and the state the measured calls rotate through."""

    name: str
    service: PoolService
    session_id: str
    rng: np.random.Generator
    # Live sequence ids; appends rotate over them.
    live: list[int]
    next_append: int = 0
    # The sequence the next Batch [Allocate, Free] frees, and the next seq id to allocate.
    admitted: int = -1
    next_id: int = 0
    # Microseconds of each timed call, by kind.
    times: dict[str, list[float]] = field(default_factory=dict)

    def tokens(self, count: int) -> list[int]:
        ids: list[int] = self.rng.integers(0, VOCAB, count).tolist()
        return ids

    def two_appends(self) -> list[Operation]:
        i = self.next_append
        self.next_append = (i + 2) % len(self.live)
        a, b = self.live[i], self.live[(i + 1) % len(self.live)]
        return [Append(a, 1, self.tokens(1)), Append(b, 1, self.tokens(1))]

    def one_append(self) -> Append:
        seq = self.live[self.next_append]
        self.next_append = (self.next_append + 1) % len(self.live)
        return Append(seq, 1, self.tokens(1))

    def admit_retire(self) -> list[Operation]:
        new, old = self.next_id, self.admitted
        self.next_id += 1
        self.admitted = new
        return [Allocate(new, ADMIT_TOKENS, self.tokens(ADMIT_TOKENS)), Free(old)]


async def build(name: str, num_blocks: int, seed: int) -> Bench:
    """A pool of num_blocks blocks, occupied as the module docstring says."""
    service = PoolService(BlockPool(num_blocks, BLOCK_SIZE), None, pool_id=f"bench{name}")
    session = service.open_session("bench", lease_ttl_ms=600_000)
    rng = np.random.default_rng(seed)
    bench = Bench(name, service, session.session_id, rng, live=list(range(SEQS)))
    sid = session.session_id
    # Lengths around the mean that fills USED_FRACTION, never a multiple of the block size.
    mean = USED_FRACTION * num_blocks * BLOCK_SIZE / SEQS
    lengths = rng.integers(int(mean * 0.75), int(mean * 1.25), SEQS)
    lengths += lengths % BLOCK_SIZE == 0
    for seq, length in enumerate(lengths.tolist()):
        await settled(service.allocate(sid, Allocate(seq, length, bench.tokens(length))))
    # Evictable prefix-cache blocks: sequences of full blocks, committed, then freed.
    cached_seqs = range(SEQS, SEQS + max(1, int(CACHED_FRACTION * num_blocks) // 64))
    for seq in cached_seqs:
        await settled(service.allocate(sid, Allocate(seq, 64 * BLOCK_SIZE,
                                                     bench.tokens(64 * BLOCK_SIZE))))
    commit: Callable[[list[tuple[int, int]]], int] | None = getattr(service.pool, "commit", None)
    if commit is not None:  # the old pool keyed blocks committed at once
        commit([session.key(seq) for seq in cached_seqs])
    for seq in cached_seqs:
        await settled(service.free(sid, Free(seq)))
    bench.next_id = SEQS + len(cached_seqs)
    bench.admitted = bench.next_id
    await settled(service.allocate(sid, Allocate(bench.admitted, ADMIT_TOKENS,
                                                 bench.tokens(ADMIT_TOKENS))))
    bench.next_id += 1
    return bench


async def measure(bench: Bench, reps: int) -> None:
    """REPS timed calls of each kind, each call on its own."""
    service, sid = bench.service, bench.session_id
    kinds: dict[str, Callable[[], Any]] = {
        "batch_2op": lambda: service.batch(sid, bench.two_appends()),
        "append_1op": lambda: service.append(sid, bench.one_append()),
        "batch_alloc_free": lambda: service.batch(sid, bench.admit_retire()),
    }
    for kind, call in kinds.items():
        times = bench.times.setdefault(kind, [])
        for _ in range(reps):
            start = time.perf_counter()
            await settled(call())
            times.append((time.perf_counter() - start) * 1e6)


def describe(bench: Bench) -> str:
    stats = bench.service.pool_stats()
    return (f"# pool {bench.name}: {stats.num_blocks} blocks, {stats.used_blocks} used "
            f"({stats.used_blocks / stats.num_blocks:.0%}), {stats.cached_blocks} cached, "
            f"{stats.num_sequences} live sequences")


async def run(rounds: int, reps: int) -> None:
    benches = [await build(name, size, seed) for seed, (name, size) in
               enumerate(POOL_SIZES.items())]
    print(f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for bench in benches:
        print(describe(bench))
    for _ in range(rounds):  # alternate, so drift of a shared machine hits both pools alike
        for bench in benches:
            await measure(bench, reps)
    for bench in benches:
        print(describe(bench))
        bench.service.check_invariants()
    small, big = benches
    for kind in ("batch_2op", "append_1op", "batch_alloc_free"):
        medians = [statistics.median(b.times[kind]) for b in benches]
        for bench, median in zip(benches, medians, strict=True):
            print(f"{kind}_us_{bench.name}: {median:.1f} us")
        name = "batch_cost_ratio" if kind == "batch_2op" else f"{kind}_ratio"
        print(f"{name}_{big.name}_vs_{small.name}: {medians[1] / medians[0]:.2f} ratio")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--reps", type=int, default=REPS, help="calls of each kind per round")
    args = parser.parse_args()
    log_setup.configure("warning")  # no "session opened" lines among the figures
    asyncio.run(run(args.rounds, args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
