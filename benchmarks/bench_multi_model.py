"""Several models, one pool (issue 21): kvcached's intermittent-peak workload on the CPU.

Three models of different geometries (the presets tiny-llama, tiny and small-llama, random
weights) take turns: each burst is one model's requests, all submitted at once, needing a share
of the KV memory at full length (--burst-share, 0.8 by default: more than a third already to
admit them); the next model's burst starts when the last one ended. Both sides' engines take up
to 4,096 tokens a step (--max-batched-tokens), a burst's prompts, so what is measured is memory,
not prefill chunking. The same total KV memory is either shared by one daemon (three runners on
it, pages moving between the models' formats as the bursts alternate) or split into static
thirds (three daemons, a third each: what a static gpu_memory_utilization split gives). Side by
side in one run:

    multi_model_ttft_p99_ratio      static / shared, p99 time to first token over all requests
    multi_model_tok_s_ratio         shared / static, generated tokens per second
    multi_model_peak_seqs_ratio     shared / static, the most sequences one model ran at once
    model_sleep_ms, model_wake_ms   putting to sleep (and waking) the last burst's model, whose
                                    cached blocks then hold most of the pool (shared daemon)

Usage: python benchmarks/bench_multi_model.py [--rounds 1] [--burst-share 0.8]
       [--max-batched-tokens 4096] [--memory-mib 6] [--quick]
"""

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e import figure

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.scheduler import SchedulerConfig
from pagedkv.client.pool.client import PoolClient
from pagedkv.process.launch import READY_STATE, Launched, start_daemon, start_runner
from pagedkv.vocab.geometry import PRESETS, dtype_bytes

BLOCK_SIZE = 16
# A page fits whole blocks of every preset's format (small-llama's fp32 block is 128 KiB).
PAGE_BYTES = 128 * 1024
MODELS = ("tiny-llama", "tiny", "small-llama")
# Long prompts, short answers: a burst's admission alone needs more than a third of the memory.
PROMPT_TOKENS, NEW_TOKENS = 96, 32


@dataclass(frozen=True)
class Served:
    """A model's runner and the daemon it computes on."""

    name: str
    daemon: str
    runner: str
    # The daemon's runner socket (models are put to sleep there).
    control: str


def block_bytes(model: str) -> int:
    return PRESETS[model].geometry().bytes_per_block(BLOCK_SIZE, dtype_bytes("float32"))


def burst_size(model: str, memory: int, share: float) -> int:
    """Requests of one burst: `share` of the memory at their full length."""
    blocks = (PROMPT_TOKENS + NEW_TOKENS) // BLOCK_SIZE
    return max(1, int(memory * share) // (blocks * block_bytes(model)))


@contextlib.contextmanager
def runner(folder: Path, daemon: Launched, model: str) -> Iterator[Launched]:
    name = folder / model
    name.mkdir()
    with start_runner(daemon.runners_target, name, "--random-init", model, "--model-name",
                      model, "--torch-threads", "1", "--log-level", "warning") as started:
        started.wait_for_notification(READY_STATE)
        yield started


@contextlib.contextmanager
def shared(memory: int) -> Iterator[list[Served]]:
    """One daemon with all the memory, a runner per model."""
    with tempfile.TemporaryDirectory(prefix="pkv-mm-") as folder_name:
        folder = Path(folder_name)
        with start_daemon(folder, "--shm-dir", folder_name, "--log-level", "warning",
                          "--model-config", MODELS[0], "--kv-memory", str(memory),
                          "--page-size", str(PAGE_BYTES),
                          "--block-size", str(BLOCK_SIZE)) as daemon:
            daemon.wait_for_notification(READY_STATE)
            with contextlib.ExitStack() as runners:
                served = [Served(m, daemon.unix_target,
                                 runners.enter_context(runner(folder, daemon, m)).unix_target,
                                 daemon.runners_target)
                          for m in MODELS]
                yield served


@contextlib.contextmanager
def static(memory: int) -> Iterator[list[Served]]:
    """A daemon per model with a third of the memory, and its runner."""
    with contextlib.ExitStack() as stack:
        served = []
        for model in MODELS:
            folder_name = stack.enter_context(tempfile.TemporaryDirectory(prefix="pkv-mm-"))
            folder = Path(folder_name)
            daemon = stack.enter_context(start_daemon(
                folder, "--shm-dir", folder_name, "--log-level", "warning", "--model-config",
                model, "--kv-memory", str(memory // 3), "--block-size", str(BLOCK_SIZE)))
            daemon.wait_for_notification(READY_STATE)
            started = stack.enter_context(runner(folder, daemon, model))
            served.append(Served(model, daemon.unix_target, started.unix_target,
                                 daemon.runners_target))
        yield served


@dataclass
class Run:
    ttft_s: list[float]
    tokens: int
    seconds: float
    peak_seqs: int


async def bursts(served: list[Served], memory: int, rounds: int, share: float,
                 batched_tokens: int) -> Run:
    """Each model's burst in turn, `rounds` times over; each engine computes at most
    `batched_tokens` a step (prompts are chunked)."""
    config = SchedulerConfig(max_num_batched_tokens=batched_tokens)
    engines = [await Engine.connect(s.daemon, s.runner, client_name=f"bench-{s.name}",
                                    config=config)
               for s in served]
    ttft: list[float] = []
    tokens = 0
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    started = time.monotonic()
    try:
        for burst in range(rounds * len(served)):
            index = burst % len(served)
            engine, model = engines[index], served[index].name
            count = burst_size(model, memory, share)
            prompts = [[(burst * 131 + i * 17 + j) % 900 + 1 for j in range(PROMPT_TOKENS)]
                       for i in range(count)]
            outputs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            ttft.extend(o.metrics["time_to_first_token_s"] for o in outputs)
            tokens += sum(o.num_generated_tokens for o in outputs)
        return Run(ttft, tokens, time.monotonic() - started,
                   max(e.peak_running_seqs for e in engines))
    finally:
        for engine in engines:
            await engine.close()


async def sleep_and_wake(daemon_runners_target: str, model: str) -> tuple[float, float]:
    """Milliseconds to put `model` to sleep, and to wake it (on the daemon's runner socket)."""
    pool = await PoolClient.connect(daemon_runners_target)
    try:
        began = time.monotonic()
        await pool.set_model_state(model, asleep=True)
        slept = time.monotonic()
        await pool.set_model_state(model, asleep=False)
        return (slept - began) * 1000, (time.monotonic() - slept) * 1000
    finally:
        await pool.close()


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--memory-mib", type=int, default=6)
    parser.add_argument("--burst-share", type=float, default=0.8,
                        help="the memory one burst needs at full length (default 0.8)")
    parser.add_argument("--max-batched-tokens", type=int, default=4096,
                        help="the engines' token budget per step (default 4096: one burst's "
                             "prompts, so prefill chunking is not what is measured)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    memory = (3 if args.quick else args.memory_mib) * 2**20
    with static(memory) as split:
        apart = asyncio.run(bursts(split, memory, args.rounds, args.burst_share,
                                   args.max_batched_tokens))
    with shared(memory) as together:
        pooled = asyncio.run(bursts(together, memory, args.rounds, args.burst_share,
                                    args.max_batched_tokens))
        # The last burst's model holds about half the pool in cached blocks now.
        sleep_ms, wake_ms = asyncio.run(sleep_and_wake(together[-1].control, MODELS[-1]))
    figure("multi_model_shared_tok_s", pooled.tokens / pooled.seconds, "tok/s")
    figure("multi_model_static_tok_s", apart.tokens / apart.seconds, "tok/s")
    figure("multi_model_shared_ttft_p99_ms", p99(pooled.ttft_s) * 1000, "ms")
    figure("multi_model_static_ttft_p99_ms", p99(apart.ttft_s) * 1000, "ms")
    figure("multi_model_ttft_p99_ratio", p99(apart.ttft_s) / p99(pooled.ttft_s), "x")
    figure("multi_model_tok_s_ratio",
           (pooled.tokens / pooled.seconds) / (apart.tokens / apart.seconds), "x")
    figure("multi_model_peak_seqs_ratio", pooled.peak_seqs / apart.peak_seqs, "x")
    figure("model_sleep_ms", sleep_ms, "ms")
    figure("model_wake_ms", wake_ms, "ms")


if __name__ == "__main__":
    main()
