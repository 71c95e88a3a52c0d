"""Core vs reference: the block-pool core against a per-sequence pure-Python block manager.

Prints one figure per line as `name: value unit`. Run with `make bench` (or directly).

One seeded decode trace, replayed in one process through `pagedkv.daemon.core.BlockPool` and
through `ReferenceBlockManager` (nano-vllm's design, written for speed): 256 live
sequences, prompts uniform in [20, 300] tokens with their token ids, outputs uniform in
[20, 650], B = 16, prefix caching on, a pool large enough that no cached block is ever evicted.
A finished sequence is freed and the next request admitted. The core gets one `append_batch`
over all live sequences per decode step, preceded by `commit` over the same sequences (the
service's Step with commit: the blocks the previous forward computed become matchable), `allocate`
with the prompt's ids on admission and `free` on finish; the reference gets one `append` call per
sequence per token and keys a block as soon as it fills (it has no pending state).

Only the pool's own calls are timed (admissions, decode steps, frees: the whole trace); a rate
is decode tokens appended / that time (wall clock; `--clock cpu` counts this thread's CPU time
instead, which a loaded machine disturbs less). Each side runs 3 times, interleaved, and reports
its median; a ratio is the core's median rate over the reference's. Prompts are random, so no
admission finds a cached prefix: the trace measures keying, not reuse.

Which hash each side keys blocks with (`--pairs`; each pair is its own set of runs):
- `core_vs_reference_ratio_xxh3`: both sides hash the same XXH3-128 chain, key_i =
  xxh3_128(key_{i-1} || tokens), the core with `prefix_hash = "xxh3_128"`;
- `core_vs_reference_ratio_sha256`: both sides hash the core's default SHA-256 chain;
- `core_vs_reference_ratio`: the core's default (SHA-256) against nano-vllm's own keys
  (xxhash64 seeded with the parent's hash): the figure as it was measured before the choice.
`--transaction` runs each of the core's calls (an admission, a step, a free) inside
`BlockPool.transaction()`, as the daemon does, so the undo journal records as it would there.
"""

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from hashlib import sha256
from typing import Protocol

import numpy as np
import numpy.typing as npt
from xxhash import xxh3_128_digest, xxh64_intdigest

from pagedkv.daemon.core import BlockPool, NoFit, PrefixHash
from pagedkv.daemon.core.content_keys import ContentKeys

from reference_block_manager import ROOT_KEY, BlockHash, ReferenceBlockManager
from traces import UNIFORM, Request, make_trace

BLOCK_SIZE = 16
LIVE = 256
# 2M token slots: more than a 2,000-step replay ever fills (about 50k blocks), so nothing is
# evicted (the reference counts evictions and the replay checks there were none).
NUM_BLOCKS = 1 << 17
VOCAB = 32_000
# Figure suffix -> (the core's prefix_hash, the reference's hash: the same chain, or None for
# nano-vllm's seeded xxhash64).
PAIRS: dict[str, tuple[PrefixHash, PrefixHash | None]] = {
    "_xxh3": ("xxh3_128", "xxh3_128"),
    "_sha256": ("sha256", "sha256"),
    "": ("sha256", None),
}


def _sha256_link(chunk: bytes, parent: bytes) -> bytes:
    return sha256(parent + chunk).digest()


def _xxh3_link(chunk: bytes, parent: bytes) -> bytes:
    return xxh3_128_digest(parent + chunk)


def reference_hash(algo: PrefixHash | None) -> tuple[BlockHash, Hashable]:
    """The reference's block hash and root: the core's own chain for `algo` (its root for the
    empty salt, each link hashing parent key || token ids), or nano-vllm's for None."""
    if algo is None:
        return xxh64_intdigest, ROOT_KEY
    link = _sha256_link if algo == "sha256" else _xxh3_link
    return link, ContentKeys(algo).root(b"")


@dataclass
class Timing:
    """Where one replay spent its time inside the pool's calls."""

    # Decode tokens appended, and the number of each kind of call.
    appended: int = 0
    admissions: int = 0
    steps: int = 0
    frees: int = 0
    # Seconds inside the pool's calls, per kind.
    admit_s: float = 0.0
    step_s: float = 0.0
    free_s: float = 0.0

    @property
    def pool_s(self) -> float:
        return self.admit_s + self.step_s + self.free_s

    @property
    def rate(self) -> float:
        """Decode tokens appended per second of pool time, admissions and frees included."""
        return self.appended / self.pool_s


class Manager(Protocol):
    """The calls a replay makes, adapted to one block manager."""

    def allocate(self, seq: int, prompt: npt.NDArray[np.int64]) -> int:
        """Admit `seq` with its prompt; the number of cached tokens."""

    def step(self, seqs: list[int], tokens: npt.NDArray[np.int64], token_list: list[int]) -> None:
        """Append one token to each of `seqs` (ids as an array and as a list)."""

    def free(self, seq: int) -> None: ...


class CoreManager:
    """`BlockPool`: one commit and one batched append per decode step; each call inside a
    transaction if `transaction`."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, transaction: bool = False,
                 prefix_hash: PrefixHash = "sha256") -> None:
        self.pool = BlockPool(num_blocks, BLOCK_SIZE, enable_prefix_caching=True,
                              prefix_hash=prefix_hash)
        self.call = self.pool.transaction if transaction else contextlib.nullcontext

    def allocate(self, seq: int, prompt: npt.NDArray[np.int64]) -> int:
        with self.call():
            result = self.pool.allocate(seq, len(prompt), prompt)
        assert not isinstance(result, NoFit)
        return result.num_cached_tokens

    def step(self, seqs: list[int], tokens: npt.NDArray[np.int64], token_list: list[int]) -> None:
        # As the service's Step(commit=True): what the last forward computed becomes matchable
        # (the prompts admitted since, the blocks the last step filled), then the append.
        with self.call():
            self.pool.commit(seqs)
            assert not isinstance(self.pool.append_batch(seqs, 1, tokens), NoFit)

    def free(self, seq: int) -> None:
        with self.call():
            self.pool.free(seq)


class ReferenceManager:
    """`ReferenceBlockManager`: one call per sequence per token, keyed with `algo`'s chain
    (`reference_hash`)."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, algo: PrefixHash | None = None) -> None:
        block_hash, root = reference_hash(algo)
        self.blocks = ReferenceBlockManager(num_blocks, BLOCK_SIZE, block_hash, root)

    def allocate(self, seq: int, prompt: npt.NDArray[np.int64]) -> int:
        cached = self.blocks.allocate(seq, prompt)
        assert cached is not None
        return cached

    def step(self, seqs: list[int], tokens: npt.NDArray[np.int64], token_list: list[int]) -> None:
        append = self.blocks.append
        for seq, token in zip(seqs, token_list, strict=True):
            append(seq, token)

    def free(self, seq: int) -> None:
        self.blocks.free(seq)


def replay(manager: Manager, trace: list[Request], steps: int,
           clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Decode `steps` steps of `trace` with LIVE sequences in flight, timing the pool's calls
    with `clock`."""
    rng = np.random.default_rng(1)
    queue = iter(enumerate(trace))
    left: dict[int, int] = {}  # live sequence -> tokens still to generate
    timing = Timing()

    def admit() -> None:
        seq, req = next(queue)
        start = clock()
        cached = manager.allocate(seq, req.prompt)
        timing.admit_s += clock() - start
        timing.admissions += 1
        assert cached == 0, "random prompts share no full block"
        left[seq] = req.output_len

    for _ in range(LIVE):
        admit()
    for _ in range(steps):
        seqs = list(left)
        tokens = rng.integers(0, VOCAB, len(seqs), dtype=np.int64)
        token_list = tokens.tolist()
        start = clock()
        manager.step(seqs, tokens, token_list)
        timing.step_s += clock() - start
        timing.steps += 1
        timing.appended += len(seqs)
        for seq in seqs:
            left[seq] -= 1
            if left[seq] == 0:
                del left[seq]
                start = clock()
                manager.free(seq)
                timing.free_s += clock() - start
                timing.frees += 1
                admit()
    return timing


def median_run(runs: list[Timing]) -> Timing:
    return sorted(runs, key=lambda run: run.rate)[len(runs) // 2]


def compare(suffix: str, trace: list[Request], args: argparse.Namespace,
            clock: Callable[[], float]) -> None:
    """Run both sides `args.repeats` times, interleaved, with the hashes PAIRS[suffix] gives
    them, and print their median rates and ratio, named with `suffix`."""
    core_hash, reference_algo = PAIRS[suffix]
    sides: dict[str, Callable[[], Manager]] = {
        "core": partial(CoreManager, transaction=args.transaction, prefix_hash=core_hash),
        "reference": partial(ReferenceManager, algo=reference_algo)}
    runs: dict[str, list[Timing]] = {"core": [], "reference": []}
    for _ in range(args.repeats):  # interleaved, so a noisy stretch hits both sides
        for name, make in sides.items():
            manager = make()
            gc.collect()
            timing = replay(manager, trace, args.steps, clock)
            if isinstance(manager, ReferenceManager):
                assert manager.blocks.evictions == 0, "the pool is too small: blocks were evicted"
            runs[name].append(timing)
            if args.verbose:
                print(f"# {name}{suffix}: {timing.rate:,.0f} appends/s; admit "
                      f"{timing.admit_s:.3f} s ({timing.admissions}), steps {timing.step_s:.3f} "
                      f"s ({timing.steps}), free {timing.free_s:.3f} s ({timing.frees})")
    core, reference = median_run(runs["core"]), median_run(runs["reference"])
    ratio = statistics.median(run.rate for run in runs["core"]) / \
        statistics.median(run.rate for run in runs["reference"])
    print(f"core_trace_appends_per_s{suffix}: {core.rate:.0f} appends/s")
    print(f"reference_trace_appends_per_s{suffix}: {reference.rate:.0f} appends/s")
    print(f"core_vs_reference_ratio{suffix}: {ratio:.3f} ratio")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side (median)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: this thread's CPU time, steadier on a "
                             "loaded machine (each timed call then also counts ~1 us of clock)")
    parser.add_argument("--transaction", action="store_true",
                        help="each core call inside BlockPool.transaction(), as in the daemon")
    parser.add_argument("--pairs", nargs="+", choices=["xxh3", "sha256", "nano"],
                        default=["xxh3", "sha256", "nano"],
                        help="hashes compared: both xxh3_128, both sha256, the core's sha256 "
                             "against nano-vllm's xxhash64 (default: all three)")
    parser.add_argument("--verbose", action="store_true", help="each run's phases")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    trace = make_trace(UNIFORM, num_requests=LIVE + args.steps * LIVE // 20, vocab=VOCAB)
    for pair in args.pairs:
        compare("" if pair == "nano" else f"_{pair}", trace, args, clock)


if __name__ == "__main__":
    main()
