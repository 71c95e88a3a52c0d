"""A runner crash under greedy streams, against a cold restart of everything (issue 20).

Hot: a daemon and a runner of the tiny-llama preset (CPU), the runner watched by the
`RunnerSupervisor` that `pagedkv serve` uses (llm/runner_supervisor.py); STREAMS greedy streams
through one `Engine` connected with `runner_restart_wait_s=RESTART_WAIT_S`. Once every stream
has half its tokens, the runner is SIGKILLed; the supervisor starts it again on the same socket,
the engine resends each sequence's history, and the K/V stays in the daemon.
Cold: the same streams on a fresh daemon and runner; at the same point both are SIGKILLed and
started again, and each stream's prompt plus its tokens so far is submitted again to a new
engine (what a client must do when the daemon's K/V is gone).

Every stream must end with the tokens of an uninterrupted run of the same prompts (checked).
A stream's gap: the time of its last token before the kill to its first token after it.
Recomputed tokens: what the new runner computed (its /metrics, from zero after its start)
beyond one position per token generated after the kill.

Figures:
    runner_restart_gap_ms_p50, runner_restart_gap_ms_max     the hot gaps over the streams
    cold_restart_gap_ms_p50, cold_restart_gap_ms_max         the cold gaps
    runner_restart_vs_cold_gap_ratio                         hot p50 / cold p50
    runner_restart_ready_ms, cold_restart_ready_ms   from the kill to the new processes' READY=1:
                                 the part of the gaps that is process start
    recomputed_tokens_after_runner_restart                   hot
    uncommitted_tokens_at_kill   the goal: computed positions past each sequence's committed
                                 tokens (the daemon's figure, read right after the kill)
    partial_block_tokens_at_kill those past each sequence's last full block (what would be
                                 uncommitted if every full block were committed at once)
    recomputed_tokens_after_cold_restart                     cold (every token held)
    runner_restarts              the supervisor's count (1)

Usage: python benchmarks/bench_runner_restart.py [--streams 32] [--new-tokens 64] [--quick]
"""

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from e2e import BLOCK_SIZE, PRESET, VOCAB, Stack, add_quick_flag, figure

from pagedkv.client import PagedKVError, SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.llm.runner_supervisor import RunnerSupervisor
from pagedkv.process.launch import READY_STATE, Launched, free_tcp_port, start_daemon, start_runner

# Room for every stream twice over (the uninterrupted run's cached blocks stay).
NUM_BLOCKS = 2048
# Prompt lengths cycle through these (tokens), so the streams' tails differ.
PROMPT_LENS = (24, 37, 50, 63, 76, 89)
CHILD_ARGS = ("--log-level", "warning")


@dataclass
class StreamLog:
    """One stream's tokens and when each reached the client."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    # time.monotonic() of each token's arrival.
    times: list[float] = field(default_factory=list)
    # Tokens it had when the processes were killed.
    at_kill: int = 0

    def add(self, token_ids: Sequence[int]) -> None:
        now = time.monotonic()
        new = list(token_ids[len(self.tokens):])
        self.tokens.extend(new)
        self.times.extend([now] * len(new))

    def gap_s(self, kill_at: float) -> float:
        """From its last token before `kill_at` to its first after."""
        after = next(t for t in self.times if t > kill_at)
        return after - max(t for t in self.times if t <= kill_at)


@dataclass(frozen=True)
class Crash:
    """One run with a kill in the middle."""

    logs: list[StreamLog]
    # time.monotonic() of the kill.
    kill_at: float
    # From the kill to the new processes' READY=1 (the runner's; cold: the daemon's, then the
    # runner's): what of the gap is process start.
    ready_s: float
    # Tokens the new runner computed beyond the new positions (`recomputed`).
    recomputed: int
    # Hot only: computed positions past each sequence's committed tokens at the kill, read
    # from the daemon (`uncommitted`): the least a restarted runner must compute again.
    uncommitted: int = 0

    def gaps_ms(self) -> list[float]:
        return [1000 * log.gap_s(self.kill_at) for log in self.logs]


@dataclass
class Processes:
    """A daemon, its runner (through `runner()`: a supervised one changes) and the runner's
    metrics address, in one folder."""

    daemon: Launched
    runner: Callable[[], Launched]
    metrics: str

    @property
    def stack(self) -> Stack:
        return Stack(self.daemon.unix_target, self.runner().unix_target, self.metrics)


def start_pair(folder: Path, metrics: str) -> tuple[Launched, Callable[[], Launched]]:
    """A daemon ready in `folder`, and how to start its runner (not started)."""
    daemon = start_daemon(folder, "--shm-dir", str(folder), "--model-config", PRESET,
                          "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                          *CHILD_ARGS)
    daemon.wait_for_notification(READY_STATE)
    return daemon, lambda: start_runner(daemon.runners_target, folder, "--random-init", PRESET,
                                        "--torch-threads", "1", "--metrics-listen", metrics,
                                        *CHILD_ARGS)


@contextlib.contextmanager
def supervised(folder: Path) -> Iterator[tuple[Processes, RunnerSupervisor]]:
    """A daemon and a runner that the supervisor starts again when it dies."""
    metrics = f"127.0.0.1:{free_tcp_port()}"
    daemon, new_runner = start_pair(folder, metrics)
    with daemon:
        runner = new_runner()
        runner.wait_for_notification(READY_STATE)
        supervisor = RunnerSupervisor(new_runner, runner, startup_timeout_s=120.0)
        supervisor.start()
        try:
            yield Processes(daemon, lambda: supervisor.runner, metrics), supervisor
        finally:
            supervisor.stop()
            daemon.stop()


@contextlib.contextmanager
def unsupervised(folder: Path) -> Iterator[Processes]:
    """A daemon and a runner; `restart` below starts both again in the same folder."""
    metrics = f"127.0.0.1:{free_tcp_port()}"
    daemon, new_runner = start_pair(folder, metrics)
    runner = new_runner()
    runner.wait_for_notification(READY_STATE)
    processes = Processes(daemon, lambda: runner, metrics)
    try:
        yield processes
    finally:
        processes.runner().stop()
        processes.daemon.stop()


def restart(processes: Processes, folder: Path) -> None:
    """Both processes killed already: start a new daemon, then a new runner, in `folder`."""
    daemon, new_runner = start_pair(folder, processes.metrics)
    runner = new_runner()
    runner.wait_for_notification(READY_STATE)
    processes.daemon, processes.runner = daemon, lambda: runner


async def stream(engine: Engine, log: StreamLog, prompt: list[int],
                 params: SamplingParams) -> None:
    """`prompt` through `engine`, its tokens added to `log` as they come (after any it has)."""
    start = len(log.tokens)
    async for output in engine.stream(prompt, params):
        log.add([*log.tokens[:start], *output.outputs[0].token_ids])


async def kill_midway(logs: list[StreamLog], new_tokens: int, kill: Callable[[], None]) -> float:
    """Once every stream has half its tokens, `kill()`; the time of the kill."""
    while min(len(log.tokens) for log in logs) < new_tokens // 2:
        await asyncio.sleep(0.002)
    kill_at = time.monotonic()
    kill()
    for log in logs:
        log.at_kill = len(log.tokens)
    return kill_at


def recomputed(stack: Stack, logs: list[StreamLog], new_tokens: int) -> int:
    """Tokens the new runner computed beyond one position per token generated after the kill
    (the last token of a stream needs none)."""
    return stack.computed_tokens() - sum(new_tokens - log.at_kill for log in logs)


async def uncommitted(engine: Engine) -> int:
    """Right after the runner's kill: the positions its sequences had computed (all their
    tokens but the last sampled) past their committed tokens (the daemon's figure, which the
    new runner trusts)."""
    seqs = [seq for request in engine.scheduler.running for seq in request.seqs]
    tables = await engine.session.block_tables([seq.seq_id for seq in seqs])
    return sum(len(seq.tokens) - 1 - table.num_cached_tokens
               for seq, table in zip(seqs, tables, strict=True))


async def restarted(supervisor: RunnerSupervisor) -> float:
    """Once the supervisor's new runner said READY=1: the time of it."""
    while not (supervisor.restarts and any(READY_STATE in message.split("\n")
                                           for message in supervisor.runner.notifications)):
        await asyncio.sleep(0.002)
    return time.monotonic()


async def hot(processes: Processes, supervisor: RunnerSupervisor, prompts: list[list[int]],
              params: SamplingParams) -> Crash:
    """The streams, the runner killed midway and started again by the supervisor."""
    logs = [StreamLog(p) for p in prompts]
    stack = processes.stack
    async with await Engine.connect(stack.daemon, stack.runner,
                                    runner_restart_wait_s=RESTART_WAIT_S) as engine:
        tasks = [asyncio.create_task(stream(engine, log, log.prompt, params)) for log in logs]
        kill_at = await kill_midway(logs, params.max_tokens,
                                    lambda: os.kill(supervisor.pid, signal.SIGKILL))
        tail = await uncommitted(engine)
        ready_at = await restarted(supervisor)
        await asyncio.gather(*tasks)
    return Crash(logs, kill_at, ready_at - kill_at, recomputed(stack, logs, params.max_tokens),
                 tail)


async def cold(processes: Processes, folder: Path, prompts: list[list[int]],
               params: SamplingParams) -> Crash:
    """The streams, both processes killed midway and started again, each stream submitted
    again with its tokens so far."""
    logs = [StreamLog(p) for p in prompts]
    stack = processes.stack
    engine = await Engine.connect(stack.daemon, stack.runner, runner_restart_wait_s=0.0)
    tasks = [asyncio.create_task(stream(engine, log, log.prompt, params)) for log in logs]

    def kill_both() -> None:
        processes.runner().send(signal.SIGKILL)
        processes.daemon.send(signal.SIGKILL)

    kill_at = await kill_midway(logs, params.max_tokens, kill_both)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    processes.runner().stop()
    processes.daemon.stop()
    await asyncio.to_thread(restart, processes, folder)
    ready_at = time.monotonic()
    stack = processes.stack
    async with await Engine.connect(stack.daemon, stack.runner) as again:
        await asyncio.gather(*(stream(again, log, [*log.prompt, *log.tokens], SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens - len(log.tokens))) for log in logs))
    with contextlib.suppress(PagedKVError, TimeoutError):
        await asyncio.wait_for(engine.close(), 5.0)
    return Crash(logs, kill_at, ready_at - kill_at, recomputed(stack, logs, params.max_tokens))


async def uninterrupted(processes: Processes, prompts: list[list[int]],
                        params: SamplingParams) -> list[list[int]]:
    stack = processes.stack
    async with await Engine.connect(stack.daemon, stack.runner) as engine:
        outputs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [list(output.outputs[0].token_ids) for output in outputs]


def partial_block_tokens(logs: list[StreamLog]) -> int:
    """Computed positions past each stream's last full block at the kill: the uncommitted
    tail if every full block were committed as soon as it was computed."""
    return sum((len(log.prompt) + log.at_kill - 1) % BLOCK_SIZE for log in logs)


def check(logs: list[StreamLog], expected: list[list[int]], what: str) -> None:
    differ = [i for i, (log, tokens) in enumerate(zip(logs, expected, strict=True))
              if log.tokens != tokens]
    assert not differ, f"{what}: streams {differ} differ from the uninterrupted run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    add_quick_flag(parser)
    args = parser.parse_args()
    streams, new_tokens = (4, 16) if args.quick else (args.streams, args.new_tokens)
    prompts = [[(31 * i + 7 * j + 1) % VOCAB for j in range(PROMPT_LENS[i % len(PROMPT_LENS)])]
               for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    with tempfile.TemporaryDirectory(prefix="pkv-rr-") as hot_dir, \
            tempfile.TemporaryDirectory(prefix="pkv-rc-") as cold_dir:
        with supervised(Path(hot_dir)) as (processes, supervisor):
            runner_crash = asyncio.run(hot(processes, supervisor, prompts, params))
            expected = asyncio.run(uninterrupted(processes, prompts, params))
            restarts = supervisor.restarts
        with unsupervised(Path(cold_dir)) as processes:
            cold_crash = asyncio.run(cold(processes, Path(cold_dir), prompts, params))
    check(runner_crash.logs, expected, "runner restart")
    check(cold_crash.logs, expected, "cold restart")
    hot_gaps, cold_gaps = runner_crash.gaps_ms(), cold_crash.gaps_ms()
    figure("runner_restart_gap_ms_p50", statistics.median(hot_gaps), "ms", 1)
    figure("runner_restart_gap_ms_max", max(hot_gaps), "ms", 1)
    figure("cold_restart_gap_ms_p50", statistics.median(cold_gaps), "ms", 1)
    figure("cold_restart_gap_ms_max", max(cold_gaps), "ms", 1)
    figure("runner_restart_vs_cold_gap_ratio",
           statistics.median(hot_gaps) / statistics.median(cold_gaps), "ratio", 2)
    figure("runner_restart_ready_ms", 1000 * runner_crash.ready_s, "ms", 1)
    figure("cold_restart_ready_ms", 1000 * cold_crash.ready_s, "ms", 1)
    figure("recomputed_tokens_after_runner_restart", runner_crash.recomputed, "tokens", 0)
    figure("uncommitted_tokens_at_kill", runner_crash.uncommitted, "tokens", 0)
    figure("partial_block_tokens_at_kill", partial_block_tokens(runner_crash.logs), "tokens", 0)
    figure("recomputed_tokens_after_cold_restart", cold_crash.recomputed, "tokens", 0)
    figure("runner_restarts", restarts, "restarts", 0)


if __name__ == "__main__":
    main()
