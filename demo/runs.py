"""The demo's processes: a daemon and a runner per allocator, and one run of the workload on each.

    with started_stacks(folder, num_blocks, [None, 192]) as stacks:  # paged, contiguous
        runs = [run_workload(stack, quick) for stack in stacks]
        stop_stacks(stacks)

Daemons and runners are started as systemd would (`pagedkv.process.launch`: ready on READY=1),
each stack in its own folder. Every daemon starts at once, then every runner (a runner
connects to its daemon as it starts): on a 2-core machine most of a start is importing torch,
and the imports overlap. An idle stack costs little while another one runs. The clients are `worker`
processes, started together. The demo fails (`DemoFailed`, with the log) unless every process
exits with status 0 and each daemon leaves no pool file behind.
"""

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagedkv.demo.pool_sampler import PoolSample, PoolSampler, ScrapeFailed
from pagedkv.demo.worker import READY, WorkerResult
from pagedkv.demo.workload import BLOCK_SIZE, MODEL, NUM_WORKERS
from pagedkv.process.launch import (
    READY_STATE,
    Launched,
    free_tcp_port,
    log_tail,
    start_daemon,
    start_runner,
)

Allocator = Literal["paged", "contiguous"]
# Longest a client may take for its whole workload (the full demo takes well under a minute).
RUN_TIMEOUT_S = 300.0


class DemoFailed(RuntimeError):
    """A process of the demo failed; the message quotes the tail of its log."""


@dataclass(frozen=True, slots=True)
class Stack:
    """A daemon and the runner computing on its pool."""

    allocator: Allocator
    num_blocks: int
    # The tokens each sequence reserves (contiguous), or None (paged).
    max_model_len: int | None
    # host:port of the daemon's /metrics.
    metrics: str
    daemon: Launched
    runner: Launched


@dataclass(frozen=True, slots=True)
class RunResult:
    """What one run of the workload produced."""

    stack: Stack
    workers: list[WorkerResult]
    # The pool from just before the start signal to the clients' end.
    samples: list[PoolSample]

    @property
    def started_s(self) -> float:
        return min(w.started_s for w in self.workers)

    @property
    def finished_s(self) -> float:
        return max(w.finished_s for w in self.workers)


@contextlib.contextmanager
def started_stacks(folder: Path, num_blocks: int,
                   reservations: Sequence[int | None]) -> Iterator[list[Stack]]:
    """One stack per entry of `reservations`: a paging daemon for None, else a contiguous one
    whose sequences each reserve that many tokens. Files under `folder`, which must be short
    (unix socket paths are limited to ~107 bytes). Killed on exit unless `stop_stacks` ran."""
    allocators = [_allocator(max_model_len) for max_model_len in reservations]
    addresses = [f"127.0.0.1:{free_tcp_port()}" for _ in reservations]
    for allocator in allocators:
        (folder / allocator).mkdir()
    with contextlib.ExitStack() as exits:
        daemons = [exits.enter_context(start_daemon(
            folder / allocator, "--shm-dir", str(folder / allocator),
            *_daemon_args(num_blocks, max_model_len, address)))
            for allocator, max_model_len, address in zip(allocators, reservations, addresses,
                                                         strict=True)]
        for daemon in daemons:
            daemon.wait_for_notification(READY_STATE)
        runners = [exits.enter_context(start_runner(
            daemon.runners_target, daemon.workdir, "--random-init", MODEL,
            "--log-level", "warning"))
            for daemon in daemons]
        for runner in runners:
            runner.wait_for_notification(READY_STATE)
        yield [Stack(allocator, num_blocks, max_model_len, address, daemon, runner)
               for allocator, max_model_len, address, daemon, runner
               in zip(allocators, reservations, addresses, daemons, runners, strict=True)]


def stop_stacks(stacks: Sequence[Stack]) -> None:
    """SIGTERM every runner, then every daemon (each drains its calls and frees its pool);
    each must exit with status 0, and no daemon may leave its pool file."""
    runners = [(f"the {s.allocator} stack's runner", s.runner) for s in stacks]
    daemons = [(f"the {s.allocator} stack's pagedkvd", s.daemon) for s in stacks]
    for group in (runners, daemons):
        for _, process in group:
            process.send(signal.SIGTERM)
        for name, process in group:
            code = process.wait_for_exit()
            if code != 0:
                raise DemoFailed(f"{name} exited with {code} on SIGTERM:\n"
                                 f"{log_tail(process.log_path)}")
    for stack in stacks:
        if stack.daemon.pool_files():
            raise DemoFailed(f"pagedkvd left its pool file: {stack.daemon.pool_files()}")


def _allocator(max_model_len: int | None) -> Allocator:
    return "paged" if max_model_len is None else "contiguous"


def _daemon_args(num_blocks: int, max_model_len: int | None, metrics: str) -> list[str]:
    reserve = [] if max_model_len is None else [
        "--allocator", "contiguous", "--max-model-len", str(max_model_len)]
    return ["--model-config", MODEL, "--num-blocks", str(num_blocks), "--block-size",
            str(BLOCK_SIZE), *reserve, "--metrics-listen", metrics, "--log-level", "warning"]


def run_workload(stack: Stack, quick: bool) -> RunResult:
    """Every client's workload once against `stack`, the clients started together."""
    folder = stack.daemon.workdir
    with contextlib.ExitStack() as exits:
        workers = [exits.enter_context(_worker(stack, index, quick))
                   for index in range(NUM_WORKERS)]
        for index, worker in enumerate(workers):
            _expect_ready(worker, folder, index)
        try:
            with PoolSampler(stack.metrics) as sampler:
                for worker in workers:
                    _send_go(worker)
                results = [_result(worker, folder, index)
                           for index, worker in enumerate(workers)]
        except ScrapeFailed as error:
            log = log_tail(stack.daemon.log_path)
            raise DemoFailed(f"{error}; pagedkvd's log:\n{log}") from None
    return RunResult(stack, results, sampler.samples)


@contextlib.contextmanager
def _worker(stack: Stack, index: int, quick: bool) -> Iterator[subprocess.Popen[str]]:
    """A client process, its stderr in worker-INDEX.log beside the daemon's; killed on exit if
    it still runs."""
    command = [sys.executable, "-m", "pagedkv.demo.worker", "--daemon",
               stack.daemon.unix_target, "--runner", stack.runner.unix_target, "--index",
               str(index), *(["--quick"] if quick else [])]
    with _log_path(stack.daemon.workdir, index).open("w") as log:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=log, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _expect_ready(worker: subprocess.Popen[str], folder: Path, index: int) -> None:
    assert worker.stdout is not None
    if worker.stdout.readline().strip() != READY:
        worker.wait(RUN_TIMEOUT_S)
        raise DemoFailed(f"client {index} exited ({worker.returncode}) before it was ready:\n"
                         f"{log_tail(_log_path(folder, index))}")


def _send_go(worker: subprocess.Popen[str]) -> None:
    assert worker.stdin is not None
    worker.stdin.write("go\n")
    worker.stdin.flush()  # closed by `_result`'s communicate()


def _result(worker: subprocess.Popen[str], folder: Path, index: int) -> WorkerResult:
    out, _ = worker.communicate(timeout=RUN_TIMEOUT_S)
    if worker.returncode != 0:
        raise DemoFailed(f"client {index} exited with {worker.returncode}:\n"
                         f"{log_tail(_log_path(folder, index))}")
    return WorkerResult.from_json(out)


def _log_path(folder: Path, index: int) -> Path:
    return folder / f"worker-{index}.log"

