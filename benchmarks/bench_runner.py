"""`pagedkv runner` against transformers' own generation loops, on CPU, measured side by side.

Model: the "tiny-llama" preset (2 layers, hidden 128, 4 heads, 2 KV heads, intermediate 256,
vocab 1000, fp32), seed 0, built by `load_model` for every contestant, so all share the weights.
Workload: NUM_PROMPTS random prompts of MIN_PROMPT..MAX_PROMPT tokens (seeded), NEW_TOKENS
greedy tokens each (no EOS: every sequence generates exactly NEW_TOKENS).

Contestants, each measured --rounds times, interleaved (one of each per round); medians printed,
ratios are of medians. Process start-up and model loading are never timed, and each timed run
follows an untimed run of the same contestant, so each is measured warm, not after its process
idled while the others ran (the runner's first prefill took 150-170 ms, later ones 55-70 ms; a
runner run right after transformers' contestants was 10-25% slower than one right after another
runner run).
- hf_generate: `model.generate` (sdpa), batches of HF_BATCH, left padding (pad id 0 and an
  attention mask), in this process. Timed: the generate calls (padding included).
- hf_generate_batch (default / sized): transformers' paged continuous batching, in this process,
  through the manager behind `generate_batch` (`init_continuous_batching`, with the workload
  hints generate_batch passes): the default ContinuousBatchingConfig, and one sized to the
  pagedkv pool (page_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS; max_batch_tokens stays 8192, the
  runner's default too). Each manager is built once (printed as *_setup_s: on CPU the default
  sizing plans for a share of the machine's memory, and its attention-mask buffer alone takes
  GiBs) and every run starts from an empty cache. Timed: add_requests until the last request
  finished.
- runner contestants: a pagedkvd process (--num-blocks NUM_BLOCKS, B = BLOCK_SIZE) and a
  `pagedkv runner` process (started once, unpinned), driven by client processes, each with one
  session and its Runner.StepStream, greedy sequences finished by the runner at max_tokens =
  NEW_TOKENS. Each client drives the runner one of two ways:
  - follow (what a client of the runner, the client Engine among them, does now; runner.proto's
    StepStream, "Following"): one step allocates every prompt of the client (new_sequence,
    decode_ahead) with follow set; the runner then steps the sequences by itself and pushes each
    answer, and the client sends nothing, only reads the pushes (RunnerClient.next_push) until
    every sequence's finished output came (the runner ends following there); then one step
    releases them all.
  - message per step (ahead / no-ahead): the same first step without follow, then NEW_TOKENS - 1
    decode steps, one message each, appending the last sampled token of every sequence (the
    last one also releases them); every sequence marked decode_ahead in each step (ahead: the
    runner computes the next step while the answer travels) or never (no-ahead).
  The contestants: runner (one client, all NUM_PROMPTS prompts, follow), runner_ahead and
  runner_no_ahead (the same client, message per step, ahead / no-ahead),
  runner_1client_8prompts (one client of PROMPTS_PER_CLIENT prompts, follow) and
  runner_4clients (CLIENTS such clients at once, follow). Timed, in each client: from the first
  step's call to the last step's answer (connecting and opening the session excluded). Clients
  start together at a barrier (a line on stdin); total tok/s is all their tokens over (last end
  - first start). The runner's /metrics give its forward passes meanwhile: *_forward_ms (mean
  forward + sampling), *_seqs_per_forward (how many sequences one forward computed) and
  *_steps_per_daemon_call (how many sessions' Steps one StepMany to the daemon carried).

Service figures (issue 19), from the same runs:
- daemon_calls_per_decode_step: the daemon's finished RPCs and answered stream messages (its
  pagedkv:rpc_requests and pagedkv:stream_messages counters, every service and method, so
  clients' calls too; the runner's StepMany calls are StepStream messages) per runner forward,
  during the "runner" contestant (one client following NUM_PROMPTS sequences). The window is
  the whole run, so the prefill step and the last step's releases are in it.
- forward_waits_on_daemon_frac: of the decode-only forwards of that run, the share whose forward
  thread sat idle for one of their steps that made a daemon call: it became ready (that call
  answered) after the previous forward ended (the runner's
  pagedkv_runner:decode_forwards{start="idle_wait"}). A step inside its sequences' reservations
  makes no daemon call and never counts (issue 19: decode calls by the block; before it every
  decode step made one, and every decode forward of a decode_ahead run counted). An upper
  bound: the runner cannot tell whether the idle time went to the daemon's answer or to a
  client's step that came before it (a followed session sends none after its first step).
- event_loop_ms_per_decode_step (issue 35, target <= 0.3): the CPU time of the runner's main
  thread (its event loop: gRPC, handling steps, answers, preparing forwards, holds; read from
  /proc/PID/task/PID/schedstat) per decode-only forward, during the "runner" contestant; each
  runner contestant's own is printed as *_event_loop_ms_per_decode_step.
- *_pushes_per_decode_step: the runner's pushed answers (pagedkv_runner:pushes_total) per
  decode-only forward: one per followed session a forward carries, fewer when a lagging
  stream's steps were merged into one push (model_runner/process/outbox.py).
- service_overhead_frac: 4 client processes of PROMPTS_PER_CLIENT prompts, each through the
  client `Engine` (all its prompts submitted at once; one extra run a round, not a contestant):
  (client step time - runner forward time) / client step time, where the client step time is
  the mean gap between consecutive decode-only StepRecords of every client, and the runner
  forward time is the mean of every forward during the run (its prefill forwards too).

Threads: every contestant gets --threads intra-op threads (default 1: torch.set_num_threads here,
--torch-threads and OMP_NUM_THREADS for the runner; the daemon always uses one). With torch's
default of one per CPU, a 2-CPU machine running a daemon, a runner and clients is
oversubscribed, and the runner's and `generate`'s many small ops mostly wait on OpenMP
(`--threads 0` measures that).

CPU time: beside wall time, each run's CPU seconds (user + system, every thread) of every process
taking part are summed (this process for transformers; the clients' loops plus the daemon and the
runner meanwhile for pagedkv): *_tok_per_cpu_s and the *_per_cpu ratios say what each token
costs, which a busy shared machine distorts less than wall time.

Figures: hf_generate_tok_s, hf_generate_batch_default_tok_s, hf_generate_batch_sized_tok_s,
runner_tok_s (one client, all prompts, following), runner_ahead_tok_s and runner_no_ahead_tok_s
(the same, message per step), runner_vs_hf_generate (target >= 1), runner_vs_hf_generate_batch
(vs default sizing, target >= 10), runner_1client_8prompts_tok_s, runner_4clients_tok_s (4
client processes of 8 prompts each, following), runner_4clients_vs_1client (target >= 2),
runner_bare_tok_s and runner_bare_8prompts_tok_s (the runner's model alone in this process,
`bare_generate`, the median of BARE_RUNS: all prompts, and one client's 8),
runner_bare_vs_hf_generate and runner_4clients_vs_1client_ceiling (runner_bare over
runner_bare_8prompts): the two ratios' ceilings, what they would be with no service cost at
all; runner_vs_bare (the share of the bare model's throughput the runner keeps),
runner_follow_speedup (runner over runner_ahead: following vs a message per decode_ahead step),
runner_ahead_speedup (runner_ahead over runner_no_ahead), each ratio also _per_cpu,
runner_matches_hf (every runner contestant's and the continuous batching's tokens equal HF
greedy `generate` run on each of CHECK_PROMPTS alone, unpadded; the script exits 1 if not),
daemon_calls_per_decode_step (target <= 0.25), forward_waits_on_daemon_frac (target <= 0.05),
service_overhead_frac (target <= 0.10; see "Service figures" above).
Usage: python benchmarks/bench_runner.py [--rounds 3] [--threads 1]
"""

import argparse
import asyncio
import contextlib
import functools
import gc
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pagedkv.process.launch import READY_STATE, free_tcp_port, start_daemon, start_runner

if TYPE_CHECKING:
    from pagedkv.client import RunnerClient, SeqStep, Session, StepOutputs

T = TypeVar("T")

NUM_PROMPTS = 32
MIN_PROMPT, MAX_PROMPT = 20, 120
NEW_TOKENS = 64
PROMPT_SEED = 0
HF_BATCH = 16
PAD_ID = 0
BLOCK_SIZE = 16
# 32 sequences of at most 120 + 64 tokens hold at most 32 * 12 = 384 blocks.
NUM_BLOCKS = 512
PRESET = "tiny-llama"
CLIENTS = 4
PROMPTS_PER_CLIENT = 8
# Timed runs of each bare contestant a round (the median counts).
BARE_RUNS = 5
# Prompts whose runner tokens are checked against HF generate on the prompt alone.
CHECK_PROMPTS = (0, 1, 2, 3, 9, 31)


def make_prompts() -> list[list[int]]:
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(1000) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
            for _ in range(NUM_PROMPTS)]


# ------------------------------------------------------------------ what a contestant did


@dataclass(frozen=True)
class Run:
    """One timed generation of some prompts."""

    # Wall time of the timed part.
    seconds: float
    # CPU time meanwhile of every process taking part (user + system, all threads).
    cpu_s: float
    # Generated tokens by prompt index.
    tokens: dict[int, list[int]]

    @property
    def tok_s(self) -> float:
        return sum(len(t) for t in self.tokens.values()) / self.seconds

    @property
    def tok_per_cpu_s(self) -> float:
        return sum(len(t) for t in self.tokens.values()) / self.cpu_s


def thread_cpu_s(pid: int, tid: int) -> float:
    """The CPU time of one thread of a running process, in ns resolution (the first field of
    /proc/PID/task/TID/schedstat; stat's ticks are 10 ms)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def process_cpu_s(pid: int) -> float:
    """utime + stime of a running process (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ client processes


async def drive(daemon: str, runner_target: str, prompts: list[list[int]],
                wait_for_go: Callable[[], str], mode: str) -> dict[str, Any]:
    """Greedy generation of `prompts` through the runner on the session's Runner.StepStream
    (`mode`: follow, ahead or no-ahead; see follow_steps and message_steps): its start and end
    (time.monotonic, system-wide on Linux), CPU seconds and tokens, as JSON-ready values."""
    from pagedkv.client import PoolClient, RunnerClient

    async with await PoolClient.connect(daemon) as pool, \
            await RunnerClient.connect(runner_target, stream_steps=True) as runner, \
            await pool.open_session("bench-runner") as session:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, wait_for_go)
        start, cpu = time.monotonic(), time.process_time()
        tokens = await follow_steps(runner, session, prompts) if mode == "follow" \
            else await message_steps(runner, session, prompts, mode == "ahead")
        end, cpu = time.monotonic(), time.process_time() - cpu
    assert all(len(seq) == NEW_TOKENS for seq in tokens), "a sequence ended early"
    return {"start": start, "end": end, "cpu_s": cpu, "tokens": tokens}


def first_step(prompts: list[list[int]], ahead: bool) -> "list[SeqStep]":
    """The step allocating every prompt: sequence i is prompt i, greedy, finished by the runner
    at its last token (so it decodes nothing ahead past it); the runner keeps each sequence's
    sampling from this step."""
    from pagedkv.client import SamplingParams, SeqStep

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [SeqStep(seq_id, prompt, new_sequence=True, params=params, decode_ahead=ahead)
            for seq_id, prompt in enumerate(prompts)]


async def message_steps(runner: "RunnerClient", session: "Session", prompts: list[list[int]],
                        ahead: bool) -> list[list[int]]:
    """One message per step: the first step, then NEW_TOKENS - 1 decode steps each appending
    the last sampled token of every sequence (each marked decode_ahead when `ahead`), the last
    one also releasing them. The tokens by sequence."""
    from pagedkv.client import SeqStep

    seq_ids = list(range(len(prompts)))
    out = await runner.step(session, first_step(prompts, ahead))
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(1, NEW_TOKENS + 1):
        record(out, tokens)
        if step == NEW_TOKENS:
            break
        last = step == NEW_TOKENS - 1
        out = await runner.step(session, [SeqStep(seq_id, tokens[seq_id][-1:],
                                                  decode_ahead=ahead) for seq_id in seq_ids],
                                release=seq_ids if last else ())
    return tokens


async def follow_steps(runner: "RunnerClient", session: "Session",
                       prompts: list[list[int]]) -> list[list[int]]:
    """What a client of the runner does now: the first step (every sequence decode_ahead) with
    follow, then only the runner's pushed answers (it steps the sequences by itself) until the
    runner finished every sequence (following ends there), then one step releasing them all.
    The tokens by sequence."""
    out = await runner.step(session, first_step(prompts, True), follow=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    going = len(prompts)
    while True:
        # A finished output is its sequence's last: the runner's next push leaves it out.
        going -= sum(output.finished for output in out)
        record(out, tokens)
        if not going:
            break
        out = await runner.next_push(session)
    await runner.step(session, [], release=list(range(len(prompts))))
    return tokens


def record(out: "StepOutputs", tokens: list[list[int]]) -> None:
    """Append each output's sampled token to its sequence's tokens."""
    for output in out:
        assert output.sampled, f"sequence {output.seq_id} sampled nothing"
        tokens[output.seq_id].append(output.token_id)


async def drive_engine(daemon: str, runner_target: str, prompts: list[list[int]],
                       wait_for_go: Callable[[], str]) -> dict[str, Any]:
    """The same greedy generation through the client `Engine` (every prompt a request, all at
    once), as drive returns it, plus decode_step_s: the seconds between consecutive decode-only
    steps (every sequence sent one token) as the Engine's StepRecords saw them."""
    from pagedkv.client import SamplingParams
    from pagedkv.client.engine.engine import Engine
    from pagedkv.client.engine.outputs import StepRecord

    records: list[StepRecord] = []
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    async with await Engine.connect(daemon, runner_target, client_name="bench-engine") as engine:
        engine.observers.append(records.append)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, wait_for_go)
        start, cpu = time.monotonic(), time.process_time()
        outputs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        end, cpu = time.monotonic(), time.process_time() - cpu
    step_s = [b.time_s - a.time_s for a, b in itertools.pairwise(records)
              if b.num_tokens == b.num_seqs > 0]
    return {"start": start, "end": end, "cpu_s": cpu, "decode_step_s": step_s,
            "tokens": [list(output.outputs[0].token_ids) for output in outputs]}


def client_main(daemon: str, runner_target: str, first: int, count: int, mode: str) -> None:
    prompts = make_prompts()[first:first + count]
    run = drive_engine(daemon, runner_target, prompts, sys.stdin.readline) if mode == "engine" \
        else drive(daemon, runner_target, prompts, sys.stdin.readline, mode)
    print(json.dumps(asyncio.run(run)), flush=True)


def run_clients(pagedkv: "Pagedkv", groups: Sequence[range],
                mode: str) -> tuple[Run, "Forwards", list[float]]:
    """One client process per group of prompt indices (`mode`: drive's, or engine),
    released together once all are ready; the engine clients' decode step times too.
    CPU time: the clients' loops plus the daemon's and the runner's meanwhile."""
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--client", pagedkv.daemon, pagedkv.runner,
         str(group.start), str(len(group)), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for group in groups]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process failed to start (exit {proc.wait()})")
        before = Forwards.read(pagedkv)
        server_cpu = pagedkv.cpu_s()
        loop_cpu = thread_cpu_s(pagedkv.runner_pid, pagedkv.runner_pid)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        runs = []
        for proc in procs:
            stdout, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"a client process failed (exit {proc.returncode})")
            runs.append(json.loads(stdout.strip().splitlines()[-1]))
        server_cpu = pagedkv.cpu_s() - server_cpu
        # Read before the scrape below, whose work (on the runner's loop) is the bench's own.
        loop_cpu = thread_cpu_s(pagedkv.runner_pid, pagedkv.runner_pid) - loop_cpu
        forwards = replace(Forwards.read(pagedkv) - before, loop_cpu_s=loop_cpu)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tokens = {group.start + i: seq for group, run in zip(groups, runs, strict=True)
              for i, seq in enumerate(run["tokens"])}
    seconds = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return (Run(seconds, server_cpu + sum(r["cpu_s"] for r in runs), tokens), forwards,
            [s for r in runs for s in r.get("decode_step_s", [])])


# ------------------------------------------------------------------ daemon and runner


@dataclass(frozen=True)
class Pagedkv:
    """The running daemon and runner."""

    daemon: str
    runner: str
    # The runner's /metrics URL.
    metrics_url: str
    # The daemon's /metrics URL.
    daemon_metrics_url: str
    pids: tuple[int, int]

    @property
    def runner_pid(self) -> int:
        """The runner's process id, which is also its main (event-loop) thread's id."""
        return self.pids[1]

    def cpu_s(self) -> float:
        return sum(process_cpu_s(pid) for pid in self.pids)


@contextlib.contextmanager
def pagedkv_processes(folder: Path, threads: int) -> Iterator[Pagedkv]:
    """pagedkvd and `pagedkv runner` with their sockets, logs and pool file in `folder`. The
    runner stops first, so no step is in flight when the daemon drains."""
    metrics = f"127.0.0.1:{free_tcp_port()}"
    daemon_metrics = f"127.0.0.1:{free_tcp_port()}"
    with start_daemon(folder, "--model-config", PRESET, "--num-blocks", str(NUM_BLOCKS),
                      "--block-size", str(BLOCK_SIZE), "--shm-dir", str(folder),
                      "--log-level", "warning", "--metrics-listen", daemon_metrics) as daemon:
        daemon.wait_for_notification(READY_STATE)
        # The runner sets its own intra-op threads (--torch-threads, default half the CPUs):
        # tell it, as well as OpenMP, what every contestant gets.
        runner_threads = threads or os.cpu_count() or 1
        with start_runner(daemon.runners_target, folder, "--random-init", PRESET,
                          "--metrics-listen", metrics, "--log-level", "warning",
                          "--torch-threads", str(runner_threads),
                          env={"OMP_NUM_THREADS": str(threads)} if threads else None) as runner:
            runner.wait_for_notification(READY_STATE)
            yield Pagedkv(daemon.unix_target, runner.unix_target, f"http://{metrics}/metrics",
                          f"http://{daemon_metrics}/metrics",
                          (daemon.process.pid, runner.process.pid))
            runner.stop()
        daemon.stop()


@dataclass(frozen=True)
class Forwards:
    """The runner's forward passes, from its /metrics."""

    count: float
    seconds: float
    sequences: float
    # The runner's StepMany calls to the daemon, and the sessions' Steps they carried.
    daemon_calls: float
    daemon_steps: float
    # Decode-only forwards whose thread idled for one of their steps, and the others.
    decode_idle_wait: float
    decode_queued: float
    # The daemon's finished RPCs (every method; read from the daemon's /metrics).
    daemon_rpcs: float
    # CPU seconds of the runner's main thread (its event loop: gRPC, steps, answers, holds)
    # during the clients' run: set by run_clients, which reads it around the run alone (a
    # /metrics scrape is work of the bench's own on that thread).
    loop_cpu_s: float
    # Pushed answers (messages) on every StepStream: fewer than the followed sessions' steps
    # when a lagging stream's steps were merged (model_runner/process/outbox.py).
    pushes: float

    @property
    def decode_forwards(self) -> float:
        return self.decode_idle_wait + self.decode_queued

    @classmethod
    def read(cls, pagedkv: Pagedkv) -> "Forwards":
        values = scrape(pagedkv.metrics_url)
        prefix = "pagedkv_runner:"
        return cls(values[f"{prefix}forward_duration_seconds_count"],
                   values[f"{prefix}forward_duration_seconds_sum"],
                   values[f"{prefix}sequences_per_forward_sum"],
                   values[f"{prefix}steps_per_daemon_call_count"],
                   values[f"{prefix}steps_per_daemon_call_sum"],
                   values.get(f"{prefix}decode_forwards_total{{start=idle_wait}}", 0.0),
                   values.get(f"{prefix}decode_forwards_total{{start=queued}}", 0.0),
                   daemon_rpcs(pagedkv.daemon_metrics_url), 0.0,
                   sum(value for key, value in values.items()
                       if key.startswith(f"{prefix}pushes_total{{")))

    def __sub__(self, other: "Forwards") -> "Forwards":
        return Forwards(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, keyed `name{label=value,...}` (or `name` unlabelled)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {sample.name + (("{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                            + "}") if sample.labels else ""): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def daemon_rpcs(url: str) -> float:
    """The daemon's finished RPCs and answered stream messages so far (a StepMany sent as a
    StepStream message counts as one), every service, method and status code."""
    return sum(value for key, value in scrape(url).items()
               if key.startswith(("pagedkv:rpc_requests_total",
                                  "pagedkv:stream_messages_total")))


# ------------------------------------------------------------------ transformers


def load_hf_model() -> Any:
    from pagedkv.model_runner.models import ModelSource, load_model

    model = load_model(ModelSource(random_init=PRESET))
    model.set_attn_implementation("sdpa")
    return model


def hf_generate(model: Any, prompts: Sequence[Sequence[int]], batch_size: int) -> Run:
    """model.generate over batches of left-padded prompts."""
    import torch

    tokens: list[list[int]] = []
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first:first + batch_size]
            width = max(len(p) for p in batch)
            input_ids = torch.tensor([[PAD_ID] * (width - len(p)) + list(p) for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=input_ids, attention_mask=mask,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
            tokens.extend(out[:, width:].tolist())
    return Run(time.perf_counter() - start, time.process_time() - cpu, dict(enumerate(tokens)))


def bare_generate(contestant: Any, prompts: Sequence[Sequence[int]]) -> Run:
    """The runner's model alone: `ModelRunner.step` in this process (bench_decode_forward's
    RunnerContestant: one packed prefill, then one step per token, argmax), no daemon, no
    gRPC, no client: what the runner contestants would make with no service cost at all."""
    start, cpu = time.perf_counter(), time.process_time()
    tokens, _ = contestant([list(p) for p in prompts])
    return Run(time.perf_counter() - start, time.process_time() - cpu, dict(enumerate(tokens)))


class ContinuousBatching:
    """transformers' paged continuous batching (what generate_batch runs), default sizing or
    sized to the pagedkv pool. The manager (cache and I/O tensors) is built once, as a server
    keeps it, and each run starts from an empty cache (no prefix left from an earlier run)."""

    def __init__(self, model: Any, prompts: Sequence[Sequence[int]], sized: bool) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        config = GenerationConfig(  # type: ignore[no-untyped-call]
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
        cb_config = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS) \
            if sized else None
        # What generate_batch passes.
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                              max_generated_length=NEW_TOKENS, num_requests=len(prompts))
        start = time.perf_counter()
        self.manager = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=cb_config, workload_hints=hints)
        self.manager.warmup()  # builds the cache and I/O tensors (no CUDA graphs on CPU)
        # Seconds building the manager (not part of tok/s).
        self.setup_s = time.perf_counter() - start

    def run(self, prompts: Sequence[Sequence[int]]) -> Run:
        """add_requests until the last request finished."""
        self.manager.batch_processor.cache.reset()  # forget the previous run's prefixes
        self.manager.start()
        try:
            start, cpu = time.perf_counter(), time.process_time()
            ids = self.manager.add_requests(inputs=[list(p) for p in prompts],
                                            max_new_tokens=NEW_TOKENS)
            results: dict[str, Any] = {}
            while len(results) < len(prompts):
                result = self.manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("continuous batching stopped before every request "
                                       "finished")
                if result.is_finished():
                    results[result.request_id] = result
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            self.manager.stop(block=True, timeout=30, keep_for_next_session=True)
        tokens = {i: list(results[request_id].generated_tokens)
                  for i, request_id in enumerate(ids)}
        return Run(seconds, cpu, tokens)

    def close(self) -> None:
        self.manager.destroy()
        self.manager = None
        gc.collect()  # the default sizing's attention-mask buffer alone is GiBs


# ------------------------------------------------------------------ the benchmark


def check_tokens(name: str, tokens: dict[int, list[int]], reference: dict[int, list[int]]) -> bool:
    """Whether `tokens` holds the reference's tokens for each reference prompt it generated."""
    ok = True
    for index, expected in reference.items():
        got = tokens.get(index, expected)
        if got != expected:
            differ = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False))
                           if a != b), min(len(got), len(expected)))
            print(f"# MISMATCH {name}: prompt {index} differs from HF at token {differ}: "
                  f"{got[differ:differ + 3]} vs {expected[differ:differ + 3]}", file=sys.stderr)
            ok = False
    return ok


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.machine())
    return f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def warmed(run: Callable[[], T]) -> T:
    """The second of two calls of `run`: the first, not timed, warms its process up."""
    run()
    return run()


def steadied(run: Callable[[], Run], times: int = BARE_RUNS) -> Run:
    """The median (by seconds) of `times` timed calls of `run`, after an untimed one: for the
    bare contestants, each a fraction of a second, whose ratio is the ceiling (one run of
    each left it 1.72-2.00 from round to round)."""
    run()
    return sorted((run() for _ in range(times)), key=lambda r: r.seconds)[times // 2]


CONTESTANTS = ("hf_generate", "hf_generate_batch_default", "hf_generate_batch_sized", "runner",
               "runner_ahead", "runner_no_ahead", "runner_1client_8prompts", "runner_4clients",
               "runner_bare", "runner_bare_8prompts")


def measure(rounds: int, threads: int) -> int:
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    if threads:
        torch.set_num_threads(threads)
    prompts = make_prompts()
    print(f"# {machine()}; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"intra-op threads: {torch.get_num_threads()} here (HF), runner OMP_NUM_THREADS="
          f"{threads or 'unset'}")
    print(f"# load average at start: {load_average()}")
    model = load_hf_model()
    # The reference: each checked prompt alone, unpadded (not timed).
    reference = {i: hf_generate(model, [prompts[i]], 1).tokens[0] for i in CHECK_PROMPTS}
    batching = {name: ContinuousBatching(load_hf_model(), prompts, sized)
                for name, sized in (("hf_generate_batch_default", False),
                                    ("hf_generate_batch_sized", True))}
    for name, contestant in batching.items():
        print(f"{name}_setup_s: {contestant.setup_s:.2f} s")
    from bench_decode_forward import RunnerContestant

    from pagedkv.model_runner.kernels.attention_backend import get_backend

    bare = RunnerContestant(get_backend("auto", "cpu"), prompts)
    # Client processes of each runner contestant, and how they drive the runner (drive's mode).
    four = [range(c * PROMPTS_PER_CLIENT, (c + 1) * PROMPTS_PER_CLIENT) for c in range(CLIENTS)]
    groups = {"runner": ([range(0, NUM_PROMPTS)], "follow"),
              "runner_ahead": ([range(0, NUM_PROMPTS)], "ahead"),
              "runner_no_ahead": ([range(0, NUM_PROMPTS)], "no-ahead"),
              "runner_1client_8prompts": ([range(0, PROMPTS_PER_CLIENT)], "follow"),
              "runner_4clients": (four, "follow")}
    figures: dict[str, list[float]] = {}
    all_ok = True
    with contextlib.ExitStack() as stack:
        for contestant in batching.values():
            stack.callback(contestant.close)
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="pkv-runner-bench-"))
        pagedkv = stack.enter_context(pagedkv_processes(Path(folder), threads))
        for round_index in range(rounds):
            runs: dict[str, Run] = {}
            extra: dict[str, float] = {}
            runs["hf_generate"] = warmed(functools.partial(hf_generate, model, prompts, HF_BATCH))
            for name, contestant in batching.items():
                runs[name] = warmed(functools.partial(contestant.run, prompts))
            runs["runner_bare"] = steadied(functools.partial(bare_generate, bare, prompts))
            runs["runner_bare_8prompts"] = steadied(functools.partial(
                bare_generate, bare, prompts[:PROMPTS_PER_CLIENT]))
            for name, (group, mode) in groups.items():
                runs[name], forwards, _ = warmed(functools.partial(run_clients, pagedkv, group,
                                                                   mode))
                extra[f"{name}_forward_ms"] = 1000 * forwards.seconds / forwards.count
                extra[f"{name}_seqs_per_forward"] = forwards.sequences / forwards.count
                extra[f"{name}_steps_per_daemon_call"] = (forwards.daemon_steps
                                                          / forwards.daemon_calls)
                extra[f"{name}_daemon_rpcs_per_forward"] = forwards.daemon_rpcs / forwards.count
                extra[f"{name}_decode_idle_wait_frac"] = forwards.decode_idle_wait / max(
                    1.0, forwards.decode_idle_wait + forwards.decode_queued)
                extra[f"{name}_event_loop_ms_per_decode_step"] = (
                    1000 * forwards.loop_cpu_s / max(1.0, forwards.decode_forwards))
                extra[f"{name}_pushes_per_decode_step"] = (
                    forwards.pushes / max(1.0, forwards.decode_forwards))
                extra[f"{name}_outside_forward_frac"] = (1 - forwards.seconds
                                                         / runs[name].seconds)
            engine_run, forwards, step_s = run_clients(pagedkv, four, "engine")
            all_ok &= check_tokens("engine_4clients", engine_run.tokens, reference)
            # The client's decode step time, less the runner's mean forward, over the step.
            extra["engine_4clients_outside_forward_frac"] = 1 - (
                forwards.seconds / forwards.count) / statistics.mean(step_s)
            for name, run in runs.items():
                all_ok &= check_tokens(name, run.tokens, reference)
            extra["runner_equal_hf_generate_seqs"] = sum(
                runs["runner"].tokens[i] == runs["hf_generate"].tokens[i]
                for i in range(NUM_PROMPTS))
            row = {**{name: run.tok_s for name, run in runs.items()},
                   **{f"{name}_per_cpu": run.tok_per_cpu_s for name, run in runs.items()},
                   **extra}
            print(f"# round {round_index + 1}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in row.items()) + f"; load average {load_average()}")
            for key, value in row.items():
                figures.setdefault(key, []).append(value)
    report({key: statistics.median(values) for key, values in figures.items()},
           min(figures["runner_equal_hf_generate_seqs"]), all_ok)
    print(f"# load average at end: {load_average()}")
    if not all_ok:
        print("bench_runner: tokens differ from HF greedy generate (see MISMATCH lines)",
              file=sys.stderr)
        return 1
    return 0


def report(med: dict[str, float], equal_seqs: float, all_ok: bool) -> None:
    """The figures: medians over the rounds; ratios are of medians."""
    for name in CONTESTANTS:
        print(f"{name}_tok_s: {med[name]:.1f} tok/s")
    ratios = {"runner_vs_hf_generate": ("runner", "hf_generate"),
              "runner_vs_hf_generate_batch": ("runner", "hf_generate_batch_default"),
              "runner_vs_hf_generate_batch_sized": ("runner", "hf_generate_batch_sized"),
              "runner_4clients_vs_1client": ("runner_4clients", "runner_1client_8prompts"),
              "runner_follow_speedup": ("runner", "runner_ahead"),
              # What the model alone allows: the ceilings of the two ratios above, and the
              # share of it the runner keeps through the service.
              "runner_bare_vs_hf_generate": ("runner_bare", "hf_generate"),
              "runner_4clients_vs_1client_ceiling": ("runner_bare", "runner_bare_8prompts"),
              "runner_vs_bare": ("runner", "runner_bare"),
              "runner_ahead_speedup": ("runner_ahead", "runner_no_ahead")}
    for key, (a, b) in ratios.items():
        print(f"{key}: {med[a] / med[b]:.2f} ratio")
    # The same per CPU second of every process taking part: less sensitive to a busy machine.
    for name in CONTESTANTS:
        print(f"{name}_tok_per_cpu_s: {med[f'{name}_per_cpu']:.1f} tok/cpu-s")
    for key, (a, b) in ratios.items():
        print(f"{key}_per_cpu: {med[f'{a}_per_cpu'] / med[f'{b}_per_cpu']:.2f} ratio")
    for name in ("runner", "runner_ahead", "runner_no_ahead", "runner_1client_8prompts",
                 "runner_4clients"):
        print(f"{name}_forward_ms: {med[f'{name}_forward_ms']:.1f} ms")
        print(f"{name}_seqs_per_forward: {med[f'{name}_seqs_per_forward']:.1f} seqs")
        print(f"{name}_steps_per_daemon_call: {med[f'{name}_steps_per_daemon_call']:.2f} steps")
        print(f"{name}_event_loop_ms_per_decode_step: "
              f"{med[f'{name}_event_loop_ms_per_decode_step']:.3f} ms")
        print(f"{name}_pushes_per_decode_step: "
              f"{med[f'{name}_pushes_per_decode_step']:.2f} pushes")
    # Issue 19's service figures (see the module docstring for what each measures).
    print(f"daemon_calls_per_decode_step: {med['runner_daemon_rpcs_per_forward']:.2f} "
          "calls/forward")
    print(f"forward_waits_on_daemon_frac: {med['runner_decode_idle_wait_frac']:.2f} frac")
    print(f"service_overhead_frac: {med['engine_4clients_outside_forward_frac']:.2f} frac")
    # Issue 35: the runner's event loop (main thread) CPU per decode forward, one client
    # following 32 sequences (the 4-client figure is printed per contestant above).
    print(f"event_loop_ms_per_decode_step: {med['runner_event_loop_ms_per_decode_step']:.3f} ms")
    print(f"runner_equal_hf_generate_seqs: {equal_seqs:.0f} of {NUM_PROMPTS}")
    print(f"runner_matches_hf: {int(all_ok)} bool")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each (default 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of every contestant: torch.set_num_threads here "
                             "(transformers), --torch-threads and OMP_NUM_THREADS of the runner;"
                             " 0 = torch's default, one per CPU (default 1)")
    parser.add_argument("--client", nargs=5,
                        metavar=("DAEMON", "RUNNER", "FIRST", "COUNT", "MODE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        daemon, runner_target, first, count, mode = args.client
        client_main(daemon, runner_target, int(first), int(count), mode)
        return 0
    return measure(args.rounds, args.threads)


if __name__ == "__main__":
    sys.exit(main())
