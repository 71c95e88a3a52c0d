"""The client's runner hop side by side: Runner.Step as unary calls against steps as messages on
one Runner.StepStream, through a real pagedkvd and `pagedkv runner` on unix sockets, in one run.

Two RunnerClients of one runner, the same work, each with its own session: `stream_steps=False`
(one Step call a step, an external scheduler's way) and `stream_steps=True` (the engine's way).
Two kinds of step, in rounds of ROUND_CALLS calls alternating between the two clients, so load
on the machine falls on both alike:
- refused: a step naming no sequence, which the runner refuses (InvalidArgument) before any
  work: the hop alone, the servicer and the status's way back (trailing metadata for a Step
  call, the answer's code and cause on the stream), no lock, no daemon call, no forward;
- decode: one token for each of SEQS greedy sequences of the tiny-llama preset (the hop plus a
  forward; every RECYCLE_CALLS calls the sequences are released and prefilled again, untimed).

Figures, one per line (medians of every timed call):

    runner_refused_step_unary_ms, runner_refused_step_stream_ms,
    runner_refused_stream_vs_unary_ratio
    runner_decode_step_unary_ms, runner_decode_step_stream_ms, runner_decode_stream_vs_unary_ratio
    runner_cpu_us_refused_unary, runner_cpu_us_refused_stream
                               the runner's CPU time (utime + stime) per refused step
    runner_cpu_us_decode_unary, runner_cpu_us_decode_stream
                               the same per decode step (its forward included, and the
                               re-prefills every RECYCLE_CALLS steps, alike in both modes)

Usage: python benchmarks/bench_runner_stream.py
"""

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench_runner import pagedkv_processes, process_cpu_s

from pagedkv.client import (
    InvalidArgument,
    PoolClient,
    RunnerClient,
    SamplingParams,
    SeqStep,
    Session,
)

SEQS = 8
PROMPT = list(range(3, 19))
ROUNDS = 10
ROUND_CALLS = 50
WARMUP_CALLS = 20
# Decode steps between re-prefills: 16 + 48 tokens stay far inside the preset's positions.
RECYCLE_CALLS = 48
GREEDY = SamplingParams(temperature=0.0)
KINDS = ("refused", "decode")


class Mode:
    """One runner client, its session and sequences, and the figures of its calls."""

    def __init__(self, runner: RunnerClient, session: Session) -> None:
        self.runner = runner
        self.session = session
        # The last token of each sequence (empty until prefilled) and decode calls since.
        self.tokens: list[int] = []
        self.since_prefill = 0
        # Wall time of each timed call by kind, in ms; the runner's CPU seconds per kind.
        self.ms: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.cpu_s: dict[str, float] = dict.fromkeys(KINDS, 0.0)

    async def refused(self) -> None:
        try:
            await self.runner.step(self.session, [])
        except InvalidArgument:
            return
        raise AssertionError("a step of no sequence was not refused")

    async def decode(self) -> None:
        outputs = await self.runner.step(self.session, [SeqStep(i, [token])
                                                        for i, token in enumerate(self.tokens)])
        self.tokens = [output.token_id for output in outputs]
        self.since_prefill += 1

    async def ready(self, kind: str) -> None:
        """Before a decode step (untimed): prefill the sequences, again every RECYCLE_CALLS."""
        if kind != "decode" or (self.tokens and self.since_prefill < RECYCLE_CALLS):
            return
        if self.tokens:
            await self.runner.step(self.session, [], list(range(SEQS)))
        outputs = await self.runner.step(self.session, [
            SeqStep(i, PROMPT, new_sequence=True, params=GREEDY) for i in range(SEQS)])
        self.tokens = [output.token_id for output in outputs]
        self.since_prefill = 0

    async def run(self, kind: str, calls: int) -> None:
        for _ in range(calls):
            await self.ready(kind)
            await (self.refused() if kind == "refused" else self.decode())


async def timed(mode: Mode, kind: str, runner_pid: int, calls: int) -> None:
    """`calls` steps of `kind`, each timed alone; the runner's CPU time over all of them."""
    cpu = process_cpu_s(runner_pid)
    for _ in range(calls):
        await mode.ready(kind)
        start = time.perf_counter()
        await (mode.refused() if kind == "refused" else mode.decode())
        mode.ms[kind].append((time.perf_counter() - start) * 1e3)
    mode.cpu_s[kind] += process_cpu_s(runner_pid) - cpu


async def measure(daemon: str, runner: str, runner_pid: int) -> dict[str, Mode]:
    async with await PoolClient.connect(daemon) as pool, \
            await RunnerClient.connect(runner) as unary_client, \
            await RunnerClient.connect(runner, stream_steps=True) as stream_client:
        modes = {"unary": Mode(unary_client, await pool.open_session("unary")),
                 "stream": Mode(stream_client, await pool.open_session("stream"))}
        for mode in modes.values():
            for kind in KINDS:
                await mode.run(kind, WARMUP_CALLS)
        for _ in range(ROUNDS):
            for kind in KINDS:
                for mode in modes.values():
                    await timed(mode, kind, runner_pid, ROUND_CALLS)
        return modes


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="pkrs-") as name, \
            pagedkv_processes(Path(name), threads=1) as pagedkv:
        modes = asyncio.run(measure(pagedkv.daemon, pagedkv.runner, pagedkv.pids[1]))
    for kind in KINDS:
        unary, stream = (statistics.median(modes[m].ms[kind]) for m in ("unary", "stream"))
        print(f"runner_{kind}_step_unary_ms: {unary:.3f} ms")
        print(f"runner_{kind}_step_stream_ms: {stream:.3f} ms")
        print(f"runner_{kind}_stream_vs_unary_ratio: {stream / unary:.2f} ratio")
    for kind in KINDS:
        for name, mode in modes.items():
            per_call = mode.cpu_s[kind] / len(mode.ms[kind]) * 1e6
            print(f"runner_cpu_us_{kind}_{name}: {per_call:.0f} us")


if __name__ == "__main__":
    main()
