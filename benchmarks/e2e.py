"""End-to-end runs for the PagedAttention figures: a real `pagedkvd` and `pagedkv runner` (a tiny
random Llama on the CPU), a trace of requests through the client `Engine`, and what it measured.

    with serving(num_blocks=1146) as stack:
        run = asyncio.run(run_trace(stack, jobs_from_trace(trace, greedy)))
    run.tok_s, run.peak_batch, run.mean_saved, run.computed_tokens ...

The model is the "tiny-llama" preset (2 layers, hidden 128, vocabulary 1000, no end-of-sequence
token): its tokens are random ids, and every request generates exactly its `max_tokens`, so
the lengths follow the trace. The runner gets one intra-op thread: on a 2-core machine shared
with the daemon and the client, a second one only makes its forwards wait on OpenMP
(RESULTS.md, runner section).
"""

import argparse
import asyncio
import contextlib
import itertools
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import RequestOutput, StepRecord
from pagedkv.client.engine.scheduler import SchedulerConfig
from pagedkv.process.launch import READY_STATE, free_tcp_port, start_daemon, start_runner

from traces import Request

PRESET = "tiny-llama"
# The preset's vocabulary: trace prompts are drawn below it.
VOCAB = 1000
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Stack:
    """A daemon and the runner computing on its pool."""

    # gRPC targets of their unix sockets.
    daemon: str
    runner: str
    # host:port of the runner's /metrics.
    runner_metrics: str
    # host:port of the daemon's /metrics.
    daemon_metrics: str = ""

    def computed_tokens(self) -> int:
        """Tokens the runner's forwards computed so far, prefill and decode (its /metrics): a
        prefix-cache hit computes nothing, a preempted sequence's recompute counts again."""
        return round(metric_sum(self.runner_metrics, "pagedkv_runner:tokens_total"))

    def daemon_metric(self, sample: str) -> float:
        """One sample of the daemon's /metrics (summed over its labels), e.g.
        "pagedkv:host_tier_restores_total"."""
        return metric_sum(self.daemon_metrics, sample)


def metric_sum(address: str, sample: str) -> float:
    """The sum of the samples named `sample` that the /metrics at `address` shows."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(found.value for family in text_string_to_metric_families(text)
               for found in family.samples if found.name == sample)


@contextlib.contextmanager
def serving(num_blocks: int, *daemon_args: str, preset: str = PRESET) -> Iterator[Stack]:
    """A pool of `num_blocks` blocks of BLOCK_SIZE laid out for `preset` (plus `daemon_args`),
    and a runner of `preset` on it; their sockets, logs and pool file in a private folder. The
    runner stops first, so no step is in flight when the daemon drains."""
    with tempfile.TemporaryDirectory(prefix="pkv-e2e-") as name:
        folder = Path(name)
        daemon_metrics = f"127.0.0.1:{free_tcp_port()}"
        with start_daemon(folder, "--shm-dir", name, "--log-level", "warning",
                          "--model-config", preset, "--num-blocks", str(num_blocks),
                          "--block-size", str(BLOCK_SIZE), "--metrics-listen", daemon_metrics,
                          *daemon_args) as daemon:
            daemon.wait_for_notification(READY_STATE)
            metrics = f"127.0.0.1:{free_tcp_port()}"
            with start_runner(daemon.runners_target, folder, "--random-init", preset,
                              "--torch-threads", "1", "--metrics-listen", metrics,
                              "--log-level", "warning") as runner:
                runner.wait_for_notification(READY_STATE)
                yield Stack(daemon.unix_target, runner.unix_target, metrics, daemon_metrics)
                runner.stop()
            daemon.stop()


@dataclass(frozen=True)
class Job:
    """One request of a run."""

    prompt: Sequence[int]
    params: SamplingParams
    # When it arrives, in seconds after the run starts.
    arrival_s: float = 0.0


# A request's sampling parameters, from its index in the trace and its lengths.
ParamsFor = Callable[[int, Request], SamplingParams]


def jobs_from_trace(trace: Sequence[Request], params: ParamsFor,
                    rate_per_s: float | None = None, seed: int = 0) -> list[Job]:
    """A job per trace request; all at once, or Poisson arrivals at `rate_per_s`."""
    arrivals = np.zeros(len(trace))
    if rate_per_s is not None:
        gaps = np.random.default_rng(seed).exponential(1 / rate_per_s, len(trace))
        arrivals = np.cumsum(gaps) - gaps[0]
    return [Job(request.prompt.tolist(), params(index, request), float(at))
            for index, (request, at) in enumerate(zip(trace, arrivals, strict=True))]


def greedy(index: int, request: Request) -> SamplingParams:
    """The trace's output length, greedy (no stop token: the length is exact)."""
    return SamplingParams(temperature=0.0, max_tokens=request.output_len)


@dataclass(frozen=True)
class TraceRun:
    """What one run of a trace measured."""

    outputs: list[RequestOutput]
    # One record per engine step, in order.
    records: list[StepRecord]
    # Per step (when asked): 1 - blocks_held / block_table_entries of the session, i.e. the
    # fraction of the blocks its sequences name that sharing saved; steps holding nothing
    # are left out.
    saved: list[float]
    # From the first arrival to the last answer.
    seconds: float
    # Tokens the runner computed meanwhile (Stack.computed_tokens).
    computed_tokens: int
    num_preemptions: int

    @property
    def generated_tokens(self) -> int:
        return sum(output.num_generated_tokens for output in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.seconds

    # Concurrency is counted in sequences computed together by one step (a step's batch, which
    # holds the ones finishing in it), not in those still running after it.
    @property
    def peak_batch(self) -> int:
        return max(r.num_seqs for r in self.records)

    @property
    def mean_batch(self) -> float:
        return float(np.mean([r.num_seqs for r in self.records]))

    @property
    def saturated_batch(self) -> float:
        """The mean batch of the steps after which requests still waited (the pool, or
        max_num_seqs, was the limit); 0 if nothing ever waited."""
        batches = [r.num_seqs for r in self.records if r.waiting]
        return float(np.mean(batches)) if batches else 0.0

    @property
    def saturated_tok_s(self) -> float:
        """Tokens sampled per second by the steps planned while requests waited: throughput
        while the pool (or max_num_seqs) was the limit, without the last stragglers' tail."""
        steps = [(a, b) for a, b in itertools.pairwise(self.records) if a.waiting]
        seconds = sum(b.time_s - a.time_s for a, b in steps)
        return sum(b.num_sampled for _, b in steps) / seconds if seconds else 0.0

    @property
    def mean_saved(self) -> float:
        return float(np.mean(self.saved))


async def run_trace(stack: Stack, jobs: Sequence[Job], config: SchedulerConfig | None = None,
                    *, sample_sharing: bool = False) -> TraceRun:
    """Every job through one Engine (one session), each submitted at its arrival time."""
    computed = stack.computed_tokens()
    async with await Engine.connect(stack.daemon, stack.runner, config=config,
                                    client_name="bench-e2e") as engine:
        records: list[StepRecord] = []
        engine.observers.append(records.append)
        sampler = _SharingSampler(engine) if sample_sharing else None
        started = time.monotonic()

        async def arrive(job: Job) -> RequestOutput:
            await asyncio.sleep(max(0.0, started + job.arrival_s - time.monotonic()))
            return await engine.generate(job.prompt, job.params)

        try:
            outputs = await asyncio.gather(*(arrive(job) for job in jobs))
        finally:
            if sampler is not None:
                await sampler.stop()
        seconds = time.monotonic() - started
        return TraceRun(list(outputs), records, sampler.saved if sampler else [], seconds,
                        stack.computed_tokens() - computed, engine.scheduler.num_preemptions)


class _SharingSampler:
    """Reads the session's figures once after each step (the engine's observer wakes it; the
    read overlaps the next step, so it sees the pool between two steps' changes)."""

    def __init__(self, engine: Engine) -> None:
        self.saved: list[float] = []
        self._engine = engine
        self._stepped = asyncio.Event()
        engine.observers.append(lambda _: self._stepped.set())
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            await self._stepped.wait()
            self._stepped.clear()
            stats = (await self._engine.session.stats()).session
            assert stats is not None
            if stats.block_table_entries:
                self.saved.append(1 - stats.blocks_held / stats.block_table_entries)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def figure(name: str, value: float, unit: str, digits: int = 3) -> None:
    """One figure, as every benchmark prints them: `name: value unit`."""
    print(f"{name}: {value:.{digits}f} {unit}", flush=True)


def add_quick_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run (seconds): checks that the script works, not a figure")
