"""bench_runner_restart.py's runs through the client `Engine` on a daemon and a runner it
starts itself (with the runner's /metrics, which `pagedkv serve`'s children do not serve):
the tokens a restarted runner computes again, against what the daemon had committed.

    with supervised(folder) as (processes, supervisor):
        crash = asyncio.run(hot(processes, supervisor, prompts, params))
    with unsupervised(folder) as processes:
        crash = asyncio.run(cold(processes, folder, prompts, params))
"""

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e import BLOCK_SIZE, PRESET, Stack
from restart_streams import Crash, StreamLog, kill_midway

from pagedkv.client import PagedKVError, SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.llm.supervisor import Supervisor
from pagedkv.process.launch import READY_STATE, Launched, free_tcp_port, start_daemon, start_runner

# Room for every stream twice over (the uninterrupted run's cached blocks stay).
NUM_BLOCKS = 2048
CHILD_ARGS = ("--log-level", "warning")


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
def supervised(folder: Path) -> Iterator[tuple[Processes, Supervisor]]:
    """A daemon and a runner that the supervisor starts again when it dies."""
    metrics = f"127.0.0.1:{free_tcp_port()}"
    daemon, new_runner = start_pair(folder, metrics)
    with daemon:
        runner = new_runner()
        runner.wait_for_notification(READY_STATE)
        supervisor = Supervisor(new_runner, runner, startup_timeout_s=120.0)
        supervisor.start()
        try:
            yield Processes(daemon, lambda: supervisor.child, metrics), supervisor
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
        log.extend(output.outputs[0].token_ids[len(log.tokens) - start:])


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


async def restarted(supervisor: Supervisor) -> float:
    """Once the supervisor's new runner said READY=1: the time of it."""
    while not (supervisor.restarts and any(READY_STATE in message.split("\n")
                                           for message in supervisor.child.notifications)):
        await asyncio.sleep(0.002)
    return time.monotonic()


async def hot(processes: Processes, supervisor: Supervisor, prompts: list[list[int]],
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
