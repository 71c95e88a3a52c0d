"""The daemon's host-memory tier (kvpool.proto, "The host-memory tier"): what a prefix hit that
comes back from host memory saves, and how much of a multi-turn chat's reuse the tier keeps.

host_hit_ttft_speedup (end to end, benchmarks/e2e.py): two real pagedkvd + runner pairs side
by side, the same small pool, one with a host tier (`--host-tier-memory`), one without. Per
round and pair: a request with a fresh PREFIX_TOKENS prefix (computed once and committed), then
FILL_FACTOR x the pool's blocks of other prompts (their committed blocks push the prefix out of
the pool: into the host tier on one side, nowhere on the other), then the measured request: the
same prefix plus SUFFIX_TOKENS new tokens. Its time to first token (the engine's
time_to_first_token) is a host restore plus the suffix's prefill on one side and the whole
prompt's prefill on the other. The script checks that the hit came from the host tier: on the
tier side the request's num_cached_tokens covers the prefix's full blocks and the daemon's
pagedkv:host_tier_restores counter grew by at least as many blocks during it; on the other side
num_cached_tokens is 0 (the fill did evict the prefix). Figures: host_hit_ttft_ms (tier),
host_miss_ttft_ms (no tier), host_hit_ttft_speedup (miss / hit, medians over rounds); for
reference, pool_hit_ttft_ms (the same request right after the prefix was computed, before the
fill: a hit in the pool itself, both sides) and host_hit_vs_pool_hit_ttft_ratio (what the
restore adds).

host_tier_hit_rate (in process, the core `BlockPool` with a bookkeeping-only `HostTier`: no
memory, no forward, so the whole trace takes seconds): a multi-turn chat trace of CONVERSATIONS
conversations of TURNS turns, each turn's prompt = the previous prompt + the previous answer +
new user text, conversations interleaved (each round of turns in a fresh random order), so a
conversation's next turn comes after every other conversation's. Its working set (the full
blocks of every conversation's last prompt + answer) is WORKING_SET_FACTOR x the pool. Prompt
tokens found cached (num_cached_tokens) are counted four ways: pool + a host tier of the
working set's size, pool + a tier of half that, the pool alone, and an unbounded pool (every
reuse hits). Figures: host_tier_hit_rate (pool + tier / unbounded), host_tier_half_hit_rate,
pool_only_hit_rate (pool / unbounded), chat_cached_tokens_{unbounded,tier,tier_half,pool}.

host_offload_call_ratio (two real pagedkvd, no runner, tiny-llama geometry, OFFLOAD_BLOCKS
each, one with a host tier of 8x that): what the tier costs a workload that never reuses what it
evicts. One Batch call allocates OFFLOAD_SEQS prompts of fresh random tokens, commits and frees
them; once the pool is full of committed blocks every call evicts as many as it commits, and on
the tier's daemon copies each evicted block to host memory first (its memory work, which the
answer waits for). Median call time on each daemon (host_offload_call_ms, host_plain_call_ms),
calls alternating between them; host_offload_call_ratio = tier / plain;
host_offload_us_per_block = the difference per evicted block.

Usage: python benchmarks/bench_host_tier.py [--rounds 7] [--only ttft|hit-rate|offload] [--quick]
"""

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from daemon_process import running_pagedkvd
from e2e import BLOCK_SIZE, PRESET, VOCAB, Stack, add_quick_flag, figure, metric_sum, serving

from pagedkv.client import Allocate, Commit, Free, PoolClient, SamplingParams, Session
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.daemon.core.block_pool import BlockPool
from pagedkv.daemon.core.types import NoFit

# --- host_hit_ttft_speedup
PREFIX_TOKENS = 1000
SUFFIX_TOKENS = 8
FILL_PROMPT_TOKENS = 1000
# Blocks of other prompts pushed through the pool after the prefix, as a multiple of its size.
FILL_FACTOR = 2
NUM_BLOCKS = 256
# The tier holds every block a round stores (the fill included) with room to spare.
TIER_FACTOR = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)
RESTORES = "pagedkv:host_tier_restores_total"
STORES = "pagedkv:host_tier_stores_total"

# --- host_tier_hit_rate
CONVERSATIONS = 64
TURNS = 6
USER_TOKENS = (16, 96)
ANSWER_TOKENS = (32, 192)
WORKING_SET_FACTOR = 3

# --- host_offload_call_ratio
OFFLOAD_BLOCKS = 512
OFFLOAD_SEQS = 16
OFFLOAD_TOKENS = 256
OFFLOAD_CALLS = 200


async def bytes_per_block(daemon: str) -> int:
    """Bytes of one block of the pool of the daemon at `daemon` (PoolInfo)."""
    async with await PoolClient.connect(daemon) as client:
        return (await client.pool_info()).bytes_per_block


def host_tier_args(stack: Stack, num_slots: int) -> tuple[str, ...]:
    """pagedkvd flags of a host tier of `num_slots` blocks of `stack`'s pool geometry."""
    return ("--host-tier-memory", str(num_slots * asyncio.run(bytes_per_block(stack.daemon))))


# ----------------------------------------------------------------- TTFT of a host-tier hit


@dataclass(frozen=True)
class Hit:
    """The measured request of one round on one side."""

    output: RequestOutput
    # Blocks the daemon restored from its host tier while it ran.
    restored_blocks: int
    # The same kind of request while the prefix was still in the pool (a pool hit).
    pool_hit: RequestOutput

    @property
    def ttft_s(self) -> float:
        return ttft_s(self.output)


def ttft_s(output: RequestOutput) -> float:
    return float(output.metrics["time_to_first_token_s"])


async def prefix_round(stack: Stack, rng: np.random.Generator, num_blocks: int) -> Hit:
    """Compute a fresh prefix, push it out of the pool with other prompts, then time the
    request that reuses it."""
    prefix = rng.integers(0, VOCAB, PREFIX_TOKENS).tolist()
    fills = -(-FILL_FACTOR * num_blocks * BLOCK_SIZE // FILL_PROMPT_TOKENS)
    async with await Engine.connect(stack.daemon, stack.runner,
                                    client_name="bench-host-tier") as engine:
        await engine.generate(prefix + rng.integers(0, VOCAB, SUFFIX_TOKENS).tolist(), PARAMS)
        pool_hit = await engine.generate(prefix + rng.integers(0, VOCAB, SUFFIX_TOKENS).tolist(),
                                         PARAMS)
        for _ in range(fills):
            await engine.generate(rng.integers(0, VOCAB, FILL_PROMPT_TOKENS).tolist(), PARAMS)
        restores = stack.daemon_metric(RESTORES)
        output = await engine.generate(prefix + rng.integers(0, VOCAB, SUFFIX_TOKENS).tolist(),
                                       PARAMS)
        return Hit(output, round(stack.daemon_metric(RESTORES) - restores), pool_hit)


def measure_ttft(rounds: int, num_blocks: int) -> None:
    full_blocks = PREFIX_TOKENS // BLOCK_SIZE
    hits: list[Hit] = []
    misses: list[Hit] = []
    with serving(num_blocks) as plain, \
            serving(num_blocks, *host_tier_args(plain, TIER_FACTOR * num_blocks)) as tier:
        assert tier.daemon_metric("pagedkv:host_tier_blocks") == TIER_FACTOR * num_blocks
        for index in range(rounds):
            # The same prompts on both sides; which side goes first alternates.
            sides = [(tier, hits), (plain, misses)]
            for stack, found in sides if index % 2 == 0 else sides[::-1]:
                found.append(asyncio.run(prefix_round(stack, np.random.default_rng(index),
                                                      num_blocks)))
    for hit, miss in zip(hits, misses, strict=True):
        assert miss.output.num_cached_tokens == 0, \
            f"the fill left {miss.output.num_cached_tokens} prefix tokens in the pool"
        assert hit.output.num_cached_tokens >= full_blocks * BLOCK_SIZE, \
            f"host hit: {hit.output.num_cached_tokens} cached tokens, expected the prefix's " \
            f"{full_blocks * BLOCK_SIZE}"
        assert hit.pool_hit.num_cached_tokens >= full_blocks * BLOCK_SIZE, \
            f"pool hit: {hit.pool_hit.num_cached_tokens} cached tokens"
        assert hit.restored_blocks >= full_blocks, \
            f"the daemon restored {hit.restored_blocks} blocks, expected {full_blocks}"
    figure("host_hit_cached_tokens", statistics.median(
        h.output.num_cached_tokens for h in hits), "tokens", 0)
    figure("host_hit_restored_blocks", statistics.median(h.restored_blocks for h in hits),
           "blocks", 0)
    hit_s = statistics.median(h.ttft_s for h in hits)
    miss_s = statistics.median(m.ttft_s for m in misses)
    figure("host_hit_ttft_ms", hit_s * 1e3, "ms", 2)
    figure("host_miss_ttft_ms", miss_s * 1e3, "ms", 2)
    figure("host_hit_ttft_speedup", miss_s / hit_s, "ratio", 2)
    pool_s = statistics.median(ttft_s(h.pool_hit) for h in hits + misses)
    figure("pool_hit_ttft_ms", pool_s * 1e3, "ms", 2)
    figure("host_hit_vs_pool_hit_ttft_ratio", hit_s / pool_s, "ratio", 2)


# ----------------------------------------------------------------- multi-turn chat hit rate


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation: its prompt, and the answer generated after it."""

    conversation: int
    prompt: list[int]
    answer: list[int]


def chat_trace(conversations: int, turns: int, seed: int = 0) -> list[Turn]:
    """Every conversation's turns, interleaved: round t holds each conversation's turn t in a
    random order. A prompt is the previous prompt + its answer + new user text."""
    rng = np.random.default_rng(seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        length = int(rng.integers(*bounds, endpoint=True))
        drawn: list[int] = rng.integers(0, VOCAB, length).tolist()
        return drawn

    history: list[list[int]] = [[] for _ in range(conversations)]
    trace = []
    for _ in range(turns):
        for conversation in rng.permutation(conversations).tolist():
            prompt = history[conversation] + tokens(USER_TOKENS)
            answer = tokens(ANSWER_TOKENS)
            trace.append(Turn(conversation, prompt, answer))
            history[conversation] = prompt + answer
    return trace


def working_set_blocks(trace: list[Turn]) -> int:
    """Full blocks of every conversation's last prompt + answer: what is worth keeping."""
    last = {turn.conversation: len(turn.prompt) + len(turn.answer) for turn in trace}
    return sum(length // BLOCK_SIZE for length in last.values())


def cached_tokens(trace: list[Turn], num_blocks: int, host_slots: int = 0) -> int:
    """Prompt tokens found cached (pool or host tier) over the trace, one turn at a time: the
    prompt allocated and committed (its prefill), its answer appended and committed, freed."""
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    if host_slots:
        pool.attach_host_tier(host_slots)
    total = 0
    for index, turn in enumerate(trace):
        update = pool.allocate(index, len(turn.prompt), turn.prompt)
        assert not isinstance(update, NoFit), f"turn {index} does not fit {num_blocks} blocks"
        total += update.num_cached_tokens
        pool.commit([index])
        grown = pool.append(index, len(turn.answer), turn.answer)
        assert not isinstance(grown, NoFit), f"turn {index}'s answer does not fit"
        pool.commit([index])
        pool.free(index)
    pool.check_invariants()
    return total


def measure_hit_rate(conversations: int, turns: int) -> None:
    trace = chat_trace(conversations, turns)
    working_set = working_set_blocks(trace)
    pool_blocks = working_set // WORKING_SET_FACTOR
    runs: dict[str, Callable[[], int]] = {
        "unbounded": lambda: cached_tokens(trace, 2 * working_set),
        "tier": lambda: cached_tokens(trace, pool_blocks, host_slots=working_set),
        "tier_half": lambda: cached_tokens(trace, pool_blocks, host_slots=working_set // 2),
        "pool": lambda: cached_tokens(trace, pool_blocks),
    }
    found = {name: run() for name, run in runs.items()}
    figure("chat_working_set_blocks", working_set, "blocks", 0)
    figure("chat_pool_blocks", pool_blocks, "blocks", 0)
    figure("chat_prompt_tokens", sum(len(turn.prompt) for turn in trace), "tokens", 0)
    for name, tokens in found.items():
        figure(f"chat_cached_tokens_{name}", tokens, "tokens", 0)
    figure("host_tier_hit_rate", found["tier"] / found["unbounded"], "ratio")
    figure("host_tier_half_hit_rate", found["tier_half"] / found["unbounded"], "ratio")
    figure("pool_only_hit_rate", found["pool"] / found["unbounded"], "ratio")


# ----------------------------------------------------------------- the cost of offloading


async def churn_call_ms(session: Session, rng: np.random.Generator) -> float:
    """One Batch: fresh prompts allocated, committed and freed; its time in ms."""
    seq_ids = list(range(OFFLOAD_SEQS))
    tokens = rng.integers(0, VOCAB, (OFFLOAD_SEQS, OFFLOAD_TOKENS)).tolist()
    start = time.perf_counter()
    await session.batch([*(Allocate(s, token_ids=tokens[s]) for s in seq_ids),
                         Commit(seq_ids), *(Free(s) for s in seq_ids)])
    return (time.perf_counter() - start) * 1e3


async def alternate_churn(plain: str, tier: str, calls: int) -> dict[str, list[float]]:
    """`calls` timed churn calls on each daemon, alternating, after filling both pools."""
    times: dict[str, list[float]] = {"plain": [], "tier": []}
    rng = np.random.default_rng(0)
    async with await PoolClient.connect(plain) as plain_client, \
            await PoolClient.connect(tier) as tier_client, \
            await plain_client.open_session("bench-offload") as plain_session, \
            await tier_client.open_session("bench-offload") as tier_session:
        sessions = {"plain": plain_session, "tier": tier_session}
        fill = OFFLOAD_BLOCKS * BLOCK_SIZE // (OFFLOAD_SEQS * OFFLOAD_TOKENS) + 1
        for index in range(fill + calls):
            for name, session in sessions.items():
                took = await churn_call_ms(session, rng)
                if index >= fill:
                    times[name].append(took)
    return times


def measure_offload(calls: int) -> None:
    pool = ("--model-config", PRESET, "--num-blocks", str(OFFLOAD_BLOCKS),
            "--block-size", str(BLOCK_SIZE))
    with running_pagedkvd(*pool) as plain:
        tier_memory = 8 * OFFLOAD_BLOCKS * asyncio.run(bytes_per_block(plain.target))
        with running_pagedkvd(*pool, "--host-tier-memory", str(tier_memory)) as tier:
            stores = metric_sum(tier.metrics, STORES)
            times = asyncio.run(alternate_churn(plain.target, tier.target, calls))
            stored = metric_sum(tier.metrics, STORES) - stores
    evicted = OFFLOAD_SEQS * OFFLOAD_TOKENS // BLOCK_SIZE
    assert stored >= calls * evicted, f"{stored} blocks offloaded, expected {calls * evicted}"
    plain_ms, tier_ms = (statistics.median(times[name]) for name in ("plain", "tier"))
    figure("host_plain_call_ms", plain_ms, "ms")
    figure("host_offload_call_ms", tier_ms, "ms")
    figure("host_offload_call_ratio", tier_ms / plain_ms, "ratio", 2)
    figure("host_offload_us_per_block", (tier_ms - plain_ms) * 1e3 / evicted, "us", 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="TTFT rounds per side")
    parser.add_argument("--only", choices=("ttft", "hit-rate", "offload"),
                        help="one part only")
    add_quick_flag(parser)
    args = parser.parse_args()
    if args.only in (None, "hit-rate"):
        measure_hit_rate(8 if args.quick else CONVERSATIONS, 3 if args.quick else TURNS)
    if args.only in (None, "ttft"):
        # Quick: a pool of 64 blocks, so the fill is 2 prompts.
        measure_ttft(1 if args.quick else args.rounds, 64 if args.quick else NUM_BLOCKS)
    if args.only in (None, "offload"):
        measure_offload(10 if args.quick else OFFLOAD_CALLS)


if __name__ == "__main__":
    main()
