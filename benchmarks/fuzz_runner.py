"""Stateful fuzzer of the runner: honest, hostile and killed clients on one real daemon and one
real runner, every token an honest client is given checked against a private recomputation.

    python benchmarks/fuzz_runner.py [--seed 1] [--seconds 120] [--kinds forged_history,...]

A pagedkvd and a `pagedkv runner` (both started by pagedkv.process.launch, a random-initialized
tiny Llama) serve:
- honest clients (`fuzz_runner_honest`), asyncio tasks with a session and a runner channel each:
  random valid steps (new sequences from a shared corpus under one cache salt, so prefix-cache
  hits cross clients; chunked prefills, decodes, decode ahead, forks, releases), greedy with
  logprobs; the shadow (`fuzz_runner_shadow`) recomputes each client's own tokens with the same
  model in this process: any token it refutes is a wrong token; some of them (by the seed)
  stream their steps and have the runner follow some, taking its pushes, sending steps planned
  before pushes they had not read on purpose (refused StalePlan), releasing mid-follow
  (`fuzz_runner_follow`);
- a hostile client (`fuzz_runner_hostile`), another tenant sharing the cache salt
  (`fuzz_runner_tenants`): forged histories, num_computed lies, token ids outside the
  vocabulary, junk sessions, steps cancelled mid-flight, K/V certified without being computed
  (Commit, Step with commit);
- client processes SIGKILLed mid-step (`fuzz_runner_victim`), their sessions left to lapse.
At the end every session is closed (killed ones lapse): the pool must hold no used block and no
sequence. Each client's random choices follow from the seed (the interleaving of the clients
does not: a finding names the seed, the client, its step and the hostile actions just before).

Figures: runner_fuzz_steps, runner_fuzz_wrong_tokens, runner_fuzz_leaked_blocks,
runner_fuzz_pushes_taken, runner_fuzz_stale_refusals, and the hostile actions by kind and
outcome (fuzz_runner_report). Exit status 1 on any finding.
"""

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from daemon_process import running_pagedkvd
from fuzz_runner_corpus import SHARED_SALT, Corpus
from fuzz_runner_honest import HonestClient
from fuzz_runner_hostile import KINDS, Hostile
from fuzz_runner_report import RunnerFuzzReport
from fuzz_runner_shadow import Reference
from fuzz_runner_tenants import Tenancy, write_tenancy
from fuzz_runner_victim import kill_clients
from load_daemon import wait_for_empty_pool

from pagedkv.client import PagedKVError, PoolClient, RunnerClient
from pagedkv.process.launch import READY_STATE, start_runner

# The model both the runner and the shadow build (a preset or a config.json path).
MODEL = "tiny-llama"
# The pool the fuzzer is meant for: small enough that it fills now and then.
DAEMON_ARGS = ("--num-blocks", "256", "--block-size", "16")
# Seconds the killed clients' leases (and the runner's hold on a queued step) may take to lapse.
LAPSE_PATIENCE_S = 30.0


@dataclass(frozen=True)
class RunnerFuzzConfig:
    seed: int = 1
    # How long the clients run.
    seconds: float = 60.0
    honest_clients: int = 3
    # Hostile action kinds (empty: none); whether to SIGKILL client processes mid-step.
    kinds: tuple[str, ...] = KINDS
    kills: bool = True
    # The served model: the runner's --random-init and the shadow's.
    model: str = MODEL


async def fuzz(daemon: str, runner_target: str, tenancy: Tenancy, config: RunnerFuzzConfig,
               report: RunnerFuzzReport) -> None:
    """Run the clients against the daemon at `daemon` (the hostile one at
    `tenancy.hostile_target`) and the runner at `runner_target`."""
    torch.set_num_threads(1)  # the daemon, the runner and the clients share the cores
    reference = Reference(config.model)
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        pool = await stack.enter_async_context(await PoolClient.connect(daemon, timeout=30))
        # The hostile client's channel, then the honest clients' (some streaming steps).
        runners = [await stack.enter_async_context(await RunnerClient.connect(
            runner_target, stream_steps=streams))
            for streams in (False, *stream_clients(config.seed, config.honest_clients))]
        info = await runners[0].info()
        if info.vocab_size != reference.vocab_size:
            raise RuntimeError(f"the runner serves {info.model} (vocabulary {info.vocab_size}), "
                               f"not {config.model}")
        corpus = Corpus(config.seed, info.vocab_size, info.block_size)
        deadline = loop.time() + config.seconds
        tasks = []
        for i, runner in enumerate(runners[1:]):
            session = await stack.enter_async_context(await pool.open_session(
                f"honest-{i}", cache_salt=SHARED_SALT))
            client = HonestClient(f"honest-{i}", config.seed, corpus, reference, session,
                                  runner, report)
            tasks.append(client.run(deadline))
        if config.kinds:
            hostile_pool = await stack.enter_async_context(await PoolClient.connect(
                tenancy.hostile_target, auth_token=tenancy.hostile_token, timeout=30,
                retry=None))
            hostile = Hostile(config.seed, corpus, hostile_pool, runners[0], report,
                              info.max_model_len, config.kinds)
            tasks.append(hostile.run(deadline))
        if config.kills:
            tasks.append(kill_clients(daemon, runner_target, config.seed, corpus, report,
                                      deadline))
        await asyncio.gather(*tasks)


def stream_clients(seed: int, clients: int) -> list[bool]:
    """Which honest clients stream their steps (and have the runner follow some): a random
    choice by the seed, at least one so that every run covers following."""
    rng = random.Random(f"streams-{seed}")
    streams = [rng.random() < 0.5 for _ in range(clients)]
    if clients and not any(streams):
        streams[rng.randrange(clients)] = True
    return streams


def run_runner_fuzz(daemon: str, runner: str, metrics: str, tenancy: Tenancy,
                    config: RunnerFuzzConfig) -> RunnerFuzzReport:
    """Fuzz the runner at `runner` and its daemon at `daemon`, started with
    `tenancy.daemon_args` (no other client; its /metrics on `metrics`, host:port), and report."""
    report = RunnerFuzzReport(config.seed)
    started = time.monotonic()
    try:
        asyncio.run(fuzz(daemon, runner, tenancy, config, report))
    except PagedKVError as exc:  # a call the fuzzer itself relies on failed
        report.internal_errors.append(f"the fuzzer's own call failed: {exc}")
    report.seconds = time.monotonic() - started
    stats = wait_for_empty_pool(metrics, LAPSE_PATIENCE_S)
    report.leaked_blocks, report.leftover_sequences = stats.used_blocks, stats.num_sequences
    report.num_blocks, report.free_blocks = stats.num_blocks, stats.free_blocks
    return report


@dataclass
class Stack:
    """A daemon and a runner started for the fuzzer, and how they ended."""

    daemon: str
    runner: str
    # host:port of the daemon's /metrics.
    metrics: str
    tenancy: Tenancy
    # Exit statuses once stopped, and their logs' tails.
    exit_codes: tuple[int, int] = (0, 0)
    logs: str = ""


@contextmanager
def running_stack(model: str = MODEL) -> Iterator[Stack]:
    """pagedkvd (DAEMON_ARGS, its pool laid out for `model`, the fuzzer's tenants) and a runner
    serving `model`."""
    with tempfile.TemporaryDirectory(prefix="pkv-rfz-") as name:
        tenancy = write_tenancy(Path(name))
        with running_pagedkvd("--model-config", model, *DAEMON_ARGS,
                              *tenancy.daemon_args) as daemon, \
                start_runner(daemon.launched.runners_target, Path(name), "--random-init", model,
                             "--torch-threads", "1", "--log-level", "warning") as runner:
            runner.wait_for_notification(READY_STATE)
            stack = Stack(daemon.target, runner.unix_target, daemon.metrics, tenancy)
            try:
                yield stack
            finally:
                runner_code = runner.stop()
                stack.logs = runner.stderr()[-2000:]
        stack.exit_codes = (daemon.exit_code or 0, runner_code)
        stack.logs += daemon.log[-2000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=3, help="honest clients")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="hostile action kinds, comma-separated (empty: none)")
    parser.add_argument("--no-kills", action="store_true", help="SIGKILL no client process")
    args = parser.parse_args()
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    config = RunnerFuzzConfig(seed=args.seed, seconds=args.seconds,
                              honest_clients=args.clients, kinds=kinds, kills=not args.no_kills)
    with running_stack() as stack:
        report = run_runner_fuzz(stack.daemon, stack.runner, stack.metrics, stack.tenancy,
                                 config)
    for line in report.figures():
        print(line)
    findings = report.findings()
    if stack.exit_codes != (0, 0):
        findings.append(f"pagedkvd and the runner exited {stack.exit_codes}:\n{stack.logs}")
    for finding in findings:
        print(f"# {finding}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
