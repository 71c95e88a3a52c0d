"""`make gpu-check`: what a session with a lent GPU runs first, in at most 8 minutes on an
H100 or H200. It checks, in order, each stage with its own timeout (all within DEADLINE_S):

1. cuda: torch sees a CUDA device, else it fails at once (exit 1, the reason on one line of
   stderr; it never skips), and the driver can run torch's CUDA build
   (pagedkv.memory.cuda_driver); it notes the versions (torch, its CUDA build, the driver's
   CUDA from cuDriverGetVersion, the driver from nvidia-smi), measures the device's copy
   bandwidth (a 1 GiB device-to-device copy: bytes read + written / time) and looks up its
   datasheet bandwidth (benchmarks/device_bandwidth.py; an unknown device is said so).
2. pytest: `pytest -m gpu` in a subprocess, its passed / failed / skipped counts from its JUnit
   report (among them: decode replayed from CUDA graphs gives eager's tokens,
   tests/model_runner/test_decode_graphs.py, the check `pagedkv runner --cuda-graphs` waits
   for; a CUDA VMM allocation exported as a descriptor outlives the process that made it and
   maps in another, tests/memory/test_cuda_vmm.py). A `gpu` test skipped on a CUDA device fails
   the stage (its id and reason shown).
3. bench: benchmarks/bench_kernels_gpu.py --quick (`make bench-gpu` at fewer points: its
   correctness check, decode and prefill timings, the fp16/bf16/fp8 x D=128/256 matrix, the
   32-layer loop eager and from a CUDA graph) in a subprocess; its `name: value unit` figures.
4. tune: benchmarks/tune_kernels_gpu.py --quick (`make tune-gpu` for decode and prefill at
   D=128, GROUP 4, bf16): whether the launch options tuned here differ from the committed table
   (model_runner/kernels/tuned_configs.json), key by key. A difference is a note, not a failure:
   `make tune-gpu` on this device writes the whole table to commit.
5. serve: `pagedkv serve --device cuda --dtype float32` per model family (a tiny random Llama
   and a tiny random Qwen2, saved with save_pretrained in a temporary folder with a byte-level
   BPE tokenizer that AutoTokenizer loads): the server starts its daemon and its runner as
   separate processes, the runner maps the daemon's pool through CUDA IPC (checked: the
   pool's memory kind is cuda_ipc, on a device). The greedy token ids of a batch of three prompts
   (plain HTTP, /v1/completions with return_token_ids) must equal transformers' greedy
   generate of the same weights on the GPU (eager attention, fp32), and its prompt ids those of
   AutoTokenizer. A failed family's logs are kept in LOG_DIR (the server's; its daemon's and
   runner's when it left them).

Then one summary: passed / failed / skipped per stage, the decode and prefill bandwidth the
bench achieved against the copy bandwidth measured here and the datasheet's, the 32-layer loop's
host time per layer, the CUDA, driver and torch versions.
Exit 1 when any stage failed.

    python benchmarks/gpu_check.py                       # everything (make gpu-check)
    python benchmarks/gpu_check.py --stages cuda,serve   # some stages
    python benchmarks/gpu_check.py --stages serve --device cpu   # try the serve stage on a CPU
"""

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from device_bandwidth import COPY_BYTES, copy_bandwidth, datasheet_bandwidth
from serve_process import DAEMON_MODULE, RUNNER_MODULE, Server, served

from pagedkv.client import PoolClient
from pagedkv.memory.cuda_driver import (
    driver_cuda_version,
    driver_too_old,
    driver_version_text,
    why_no_cuda,
)
from pagedkv.vocab.paths import DAEMON_RUNNER_SOCKET_NAME, socket_target

ROOT = Path(__file__).resolve().parent.parent
PROG = "gpu-check"
# The whole check ends within this many seconds (8 minutes less room to start and to print).
DEADLINE_S = 440.0
# Each stage's own limit (it gets less when the deadline is nearer).
STAGE_TIMEOUT_S = {"cuda": 20.0, "pytest": 150.0, "bench": 100.0, "tune": 50.0, "serve": 120.0}
STAGES = tuple(STAGE_TIMEOUT_S)
# How long a stage may outlive its timeout (its servers stopping) before it counts as hung.
STAGE_GRACE_S = 15.0
# How long an interrupted subprocess may take to write its report before it is killed.
INTERRUPT_GRACE_S = 15.0
# A bench figure: `name: value unit`.
FIGURE = re.compile(r"^([A-Za-z0-9_]+): (-?[0-9.]+(?:e[-+]?[0-9]+)?|inf|nan) (\S+)$")
# Failed or skipped tests named in the summary (the rest counted).
LISTED = 10
# The decode point the bench's target names.
DECODE_TARGET = "b64_c4096"

# The serve stage: text the tokenizer is trained on, prompts (a few tokens, past two 16-token
# blocks, past five), tokens generated per prompt (each decode crosses a block boundary).
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "paged attention keeps kv blocks",
             "hello world, this is pagedkv", "the quick brown fox jumps over the lazy dog"]
PROMPTS = ["the cat sat on", "hello world, the quick brown fox jumps over the lazy dog in the park",
           "the quick brown fox jumps over the lazy dog, " * 4]
NEW_TOKENS = 24
FAMILIES = ("llama", "qwen2")
# The tiny model's config sizes (make_model_dir's): 2 layers of hidden 128, GQA 4/2 heads of 32.
TINY_SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
# Of the serve stage's time, what is left for its servers to stop.
SERVE_STOP_ROOM_S = 20.0
# Where a failed family's logs (the server's, its daemon's, its runner's) are kept.
LOG_DIR = Path(tempfile.gettempdir()) / "gpu-check-logs"


@dataclass
class Stage:
    """What one stage found."""

    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    # Why it failed, and what it noticed, one line each.
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.problems and self.passed > 0

    def fail(self, problem: str) -> None:
        self.failed += 1
        self.problems.append(problem)


@dataclass
class Facts:
    """What the summary reports besides the counts."""

    versions: dict[str, str] = field(default_factory=dict)
    copy_bytes_per_s: float | None = None
    datasheet_bytes_per_s: float | None = None
    figures: dict[str, tuple[float, str]] = field(default_factory=dict)


# ------------------------------------------------------------------------------ subprocesses


def run_logged(command: list[str], timeout: float, tag: str,
               env: dict[str, str] | None = None) -> tuple[int | None, list[str]]:
    """Run `command` from the repository root, echoing its output lines (unbuffered) prefixed
    with `tag`; (its exit status, its lines). INTERRUPT_GRACE_S before `timeout`: SIGINT
    (pytest then writes its report), SIGKILL at `timeout`, and the status is None."""
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            print(f"[{tag}] {line}", end="", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code: int | None = process.wait(max(1.0, timeout - INTERRUPT_GRACE_S))
    except subprocess.TimeoutExpired:
        code = None
        process.send_signal(signal.SIGINT)
        try:
            process.wait(INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    reader.join(5)
    return code, lines


# ------------------------------------------------------------------------------ 1. cuda


def nvidia_smi_driver() -> str:
    """The driver version nvidia-smi reports ("" without nvidia-smi or an answer)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        answer = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=10, check=True)
        return answer.stdout.strip().splitlines()[0]
    return ""


def check_cuda(stage: Stage, facts: Facts) -> None:
    """The device, the versions, the driver against torch's build, the copy bandwidth."""
    driver = driver_cuda_version()
    facts.versions.update({
        "torch": torch.__version__, "torch CUDA build": torch.version.cuda or "none",
        "driver CUDA": driver_version_text(driver) if driver is not None else "unknown",
        "driver": nvidia_smi_driver() or "unknown (no nvidia-smi)"})
    with contextlib.suppress(ImportError):
        import triton

        facts.versions["triton"] = triton.__version__
    too_old = driver_too_old(torch.__version__, torch.version.cuda, driver)
    if too_old is not None:
        stage.fail(too_old)
        return
    missing = why_no_cuda()
    if missing is not None:
        stage.fail(missing)
        return
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    facts.versions["device"] = f"{name} (sm_{major}{minor}, {torch.cuda.device_count()} visible)"
    stage.passed += 1
    facts.copy_bytes_per_s = copy_bandwidth(device)
    facts.datasheet_bytes_per_s = datasheet_bandwidth(name)
    stage.passed += 1
    stage.notes.append(f"copy bandwidth {facts.copy_bytes_per_s / 1e9:.0f} GB/s")
    if facts.datasheet_bytes_per_s is None:
        stage.notes.append(f"no datasheet bandwidth known for {name!r}")


# ------------------------------------------------------------------------------ 2. pytest


def junit_counts(stage: Stage, report: Path, on_cuda: bool) -> None:
    """Add the counts of pytest's JUnit `report` to `stage`, naming up to LISTED failed tests;
    skipped tests fail it when `on_cuda` (a `gpu` test must run where there is a GPU)."""
    failed, skipped = [], []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        skip = case.find("skipped")
        if problem is not None:
            failed.append(f"{test_id}: {first_line(problem.get('message', 'failed'))}")
        elif skip is not None:
            skipped.append(f"{test_id}: {first_line(skip.get('message', ''))}")
        else:
            stage.passed += 1
    stage.failed += len(failed)
    stage.skipped += len(skipped)
    stage.problems += failed[:LISTED]
    if len(failed) > LISTED:
        stage.problems.append(f"... and {len(failed) - LISTED} more failed")
    if on_cuda and skipped:
        stage.problems.append(f"{len(skipped)} gpu tests skipped on a CUDA device, e.g.:")
        stage.problems += skipped[:LISTED]


def first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else ""


def check_pytest(stage: Stage, timeout: float, on_cuda: bool) -> None:
    """`pytest -m gpu`, counted from its JUnit report."""
    with tempfile.TemporaryDirectory(prefix="gpuck-") as folder:
        report = Path(folder) / "gpu.xml"
        code, lines = run_logged([sys.executable, "-m", "pytest", "-m", "gpu", "-q",
                                  "-p", "no:cacheprovider", f"--junitxml={report}"],
                                 timeout, "pytest")
        if report.is_file():
            junit_counts(stage, report, on_cuda)
        if code is None:
            stage.fail(f"pytest -m gpu ran past {timeout:.0f} s (interrupted: the counts are "
                       "of the tests that ran)")
        elif code == 5:
            stage.fail("pytest -m gpu collected no test")
        elif code != 0 and not stage.failed:
            stage.fail(f"pytest -m gpu exited {code}: {lines[-1] if lines else ''}")


# ------------------------------------------------------------------------------ 3. bench


def run_script(stage: Stage, script: str, timeout: float) -> dict[str, tuple[float, str]] | None:
    """benchmarks/`script` --quick in a subprocess: its `name: value unit` figures; None (the
    stage failed, saying why) if it ran past `timeout` or exited non-zero."""
    code, lines = run_logged([sys.executable, str(ROOT / "benchmarks" / script), "--quick"],
                             timeout, stage.name)
    figures = {match[1]: (float(match[2]), match[3])
               for match in map(FIGURE.match, lines) if match}
    if code is None:
        stage.fail(f"{script} ran past {timeout:.0f} s")
    elif code != 0:
        stage.fail(f"{script} exited {code}: {lines[-1] if lines else ''}")
    return figures if code == 0 else None


def check_bench(stage: Stage, facts: Facts, timeout: float) -> None:
    """benchmarks/bench_kernels_gpu.py --quick; its figures into `facts`."""
    figures = run_script(stage, "bench_kernels_gpu.py", timeout)
    if figures is None:
        return
    facts.figures.update(figures)
    if figures.get("check_passed", (0.0, ""))[0] != 1:
        stage.fail("bench_kernels_gpu.py printed no check_passed: 1")
    elif not any(name.startswith("prefill_gbps_") for name in figures):
        stage.fail("bench_kernels_gpu.py printed no prefill figures")
    elif not any(name.startswith("loop_host_us_per_layer_") for name in figures):
        stage.fail("bench_kernels_gpu.py printed no layer-loop figures")
    else:
        stage.passed += 1


# ------------------------------------------------------------------------------ 4. tune


def check_tune(stage: Stage, timeout: float) -> None:
    """benchmarks/tune_kernels_gpu.py --quick: each key it tuned, noted with whether the options
    measured fastest here differ from the committed table's."""
    figures = run_script(stage, "tune_kernels_gpu.py", timeout)
    if figures is None:
        return
    keys = [name.removeprefix("tune_differs_") for name in figures
            if name.startswith("tune_differs_") and name != "tune_differs_total"]
    if not keys:
        stage.fail("tune_kernels_gpu.py printed no tune_differs_<key> figure")
        return
    stage.passed += 1
    for key in keys:
        warps, stages = (int(figures[f"tune_{what}_{key}"][0]) for what in ("warps", "stages"))
        speedup = figures[f"tune_speedup_{key}"][0]
        verdict = "differs from" if figures[f"tune_differs_{key}"][0] else "equals"
        stage.notes.append(f"{key}: tuned num_warps={warps} num_stages={stages} ({speedup:.2f}x "
                           f"the default) {verdict} the committed table")


# ------------------------------------------------------------------------------ 5. serve


def make_model_dir(folder: Path, family: str, sizes: Mapping[str, int] | None = None) -> None:
    """A tiny random `family` model (fp32, no end-of-sequence token: every answer is exactly
    NEW_TOKENS long) and a byte-level BPE tokenizer trained on SENTENCES, saved in `folder`.
    `sizes`: config sizes that replace TINY_SIZES' (a larger model of the same family)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)  # type: ignore[no-untyped-call]
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    # Wide random weights (initializer_range 0.2): logits far from uniform, so greedy ids are
    # decided by clear margins.
    config = config_class(vocab_size=len(tokenizer), **{**TINY_SIZES, **(sizes or {})},
                          max_position_embeddings=512, initializer_range=0.2,
                          tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                          pad_token_id=None, dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def hf_greedy(folder: Path, device: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' NEW_TOKENS greedy ids after each prompt, on `device` (eager, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                 dtype=torch.float32)
    model.set_attn_implementation("eager")
    torch.nn.Module.to(model, torch.device(device))
    torch.nn.Module.eval(model)
    answers = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        output = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        answers.append([int(t) for t in output[0, len(prompt):].tolist()])
    return answers


def complete(server: Server, model: str, timeout: float) -> list[dict[str, Any]]:
    """One greedy /v1/completions request of every prompt to `model`: its choices, in prompt
    order."""
    body = {"model": model, "prompt": PROMPTS, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "return_token_ids": True}
    request = urllib.request.Request(f"{server.url}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        choices: list[dict[str, Any]] = json.loads(reply.read())["choices"]
    return sorted(choices, key=lambda choice: int(choice["index"]))


def daemon_runner_socket(folder: Path) -> str:
    """The runner socket of the daemon `pagedkv serve` started in its private folder under
    `folder` (its TMPDIR)."""
    sockets = sorted(folder.glob(f"pagedkv-*/{DAEMON_RUNNER_SOCKET_NAME}"))
    if len(sockets) != 1:
        raise LookupError(f"expected one daemon runner socket under {folder}, found "
                          f"{len(sockets)}")
    return socket_target(sockets[0])


async def pool_memory(target: str) -> tuple[str, int]:
    """(memory kind, device index) of the pool the daemon at `target` hands its runners."""
    async with await PoolClient.connect(target) as pool:
        info = await pool.pool_info()
    return info.memory.kind, info.memory.device_index


def kill_leftovers(folder: Path) -> list[int]:
    """SIGKILL the processes this check started that still run: those whose command line names
    `folder` (a daemon or runner orphaned by a server that did not stop them); their pids."""
    killed = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(cmdline.parent.name)
            if pid != os.getpid() and str(folder).encode() in cmdline.read_bytes():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


@dataclass
class Family:
    """One model family's check: its folder, its model, what transformers generates."""

    name: str
    # Short (the unix sockets of the server's daemon and runner live under it); removed after.
    folder: Path
    # The prompts' ids by AutoTokenizer, and transformers' greedy ids after each.
    prompt_ids: list[list[int]] = field(default_factory=list)
    expected: list[list[int]] = field(default_factory=list)
    stage: Stage = field(init=False)

    def __post_init__(self) -> None:
        self.stage = Stage(self.name)

    @property
    def model_dir(self) -> Path:
        return self.folder / self.name


def prepare_family(name: str, device: str) -> Family:
    """The family's model folder, its prompts' ids and transformers' greedy answers on
    `device`. Run one family at a time: transformers' lazy imports are not thread-safe."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    family = Family(name, Path(tempfile.mkdtemp(prefix="gpuck-", dir="/tmp")))
    try:
        make_model_dir(family.model_dir, name)
        tokenizer = AutoTokenizer.from_pretrained(str(family.model_dir), local_files_only=True)
        family.prompt_ids = [list(tokenizer.encode(prompt)) for prompt in PROMPTS]
        family.expected = hf_greedy(family.model_dir, device, family.prompt_ids)
    except Exception as exc:
        family.stage.fail(f"{name}: {exception_line(exc)}")
    return family


def serve_family(family: Family, device: str, deadline: float) -> None:
    """`pagedkv serve` of the family's folder on `device`, against transformers' answers; its
    processes' logs kept in LOG_DIR when it fails, its folder removed."""
    stage, name = family.stage, family.name

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    try:
        with served(family.folder, str(family.model_dir), "--served-model-name", name,
                    "--device", device, "--dtype", "float32", "--kv-cache-memory", "64MiB",
                    timeout=left()) as server:
            pids = {server.child_pid(DAEMON_MODULE), server.child_pid(RUNNER_MODULE)}
            kind, index = asyncio.run(asyncio.wait_for(
                pool_memory(daemon_runner_socket(family.folder)), left()))
            choices = complete(server, name, left())
        want_kind = "shm" if device == "cpu" else "cuda_ipc"
        got_prompts = [choice["prompt_token_ids"] for choice in choices]
        got = [choice["token_ids"] for choice in choices]
        if len(pids) != 2:
            stage.fail(f"{name}: the daemon and the runner are one process")
        elif kind != want_kind or (device != "cpu" and index < 0):
            stage.fail(f"{name}: the pool's memory is {kind!r} on device index {index}, not "
                       f"{want_kind}")
        elif got_prompts != family.prompt_ids:
            stage.fail(f"{name}: the server's prompt ids {got_prompts} are not AutoTokenizer's "
                       f"{family.prompt_ids}")
        elif got != family.expected:
            first = next(i for i, (a, b) in enumerate(zip(got, family.expected, strict=True))
                         if a != b)
            stage.fail(f"{name}: prompt {first}: pagedkv {got[first]} != transformers "
                       f"{family.expected[first]}")
        else:
            stage.passed += 1
            stage.notes.append(f"{name}: {len(PROMPTS)} prompts x {NEW_TOKENS} greedy tokens "
                               f"equal transformers' (pool {kind}, device index {index}; daemon "
                               "and runner separate processes)")
    except Exception as exc:  # a start that failed, a request that timed out: this family fails
        stage.fail(f"{name}: {exception_line(exc)}")


def clean_up(family: Family) -> None:
    """Kill what is left of the family's processes, keep its logs if it failed, remove its
    folder."""
    killed = kill_leftovers(family.folder)
    if killed:
        family.stage.notes.append(f"{family.name}: killed leftover processes {killed}")
    if not family.stage.ok:
        kept = LOG_DIR / family.name
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir(parents=True)
        for log in family.folder.rglob("*.log"):
            shutil.copy(log, kept / "-".join(log.relative_to(family.folder).parts))
        family.stage.notes.append(f"{family.name}: logs kept in {kept}")
    shutil.rmtree(family.folder, ignore_errors=True)


def exception_line(exc: Exception) -> str:
    """`exc` on one line: its first line, and its last one (a quoted log's last line)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(exc).__name__}: {text[:500]}"


def check_serve(stage: Stage, timeout: float, device: str) -> None:
    """Every family prepared in turn, then served at once (they share the device), each server
    in a thread of its own."""
    # Room left after the deadline for the servers to stop (a few seconds, unless one hangs).
    deadline = time.monotonic() + timeout - SERVE_STOP_ROOM_S
    families: list[Family] = []
    try:
        for name in FAMILIES:
            families.append(prepare_family(name, device))
        ready = [family for family in families if not family.stage.failed]
        with ThreadPoolExecutor(len(FAMILIES)) as pool:
            list(pool.map(lambda family: serve_family(family, device, deadline), ready))
    finally:
        for family in families:
            clean_up(family)
            stage.passed += family.stage.passed
            stage.failed += family.stage.failed
            stage.problems += family.stage.problems
            stage.notes += family.stage.notes


# ------------------------------------------------------------------------------ summary


def best(figures: dict[str, tuple[float, str]], prefix: str) -> tuple[str, float] | None:
    """The largest figure whose name starts with `prefix`: (the rest of its name, value)."""
    found = [(name.removeprefix(prefix), value) for name, (value, _) in figures.items()
             if name.startswith(prefix)]
    return max(found, key=lambda item: item[1]) if found else None


def bandwidth_lines(facts: Facts) -> list[str]:
    """The bench's decode and prefill GB/s against the copy bandwidth measured here and the
    datasheet's, and the layer loop's host time."""
    copy, sheet = facts.copy_bytes_per_s, facts.datasheet_bytes_per_s
    lines = [f"copy bandwidth (measured here, {COPY_BYTES >> 30} GiB device-to-device, read + "
             f"written): {copy / 1e9:.0f} GB/s" if copy else "copy bandwidth: not measured",
             f"datasheet bandwidth: {sheet / 1e9:.0f} GB/s" if sheet else
             "datasheet bandwidth: unknown for this device"]

    def against_copy(gbps: float) -> str:
        parts = [f"{gbps * 1e9 / base:.2f} of {what}"
                 for base, what in ((copy, "copy"), (sheet, "datasheet")) if base]
        return f"{gbps:.0f} GB/s ({', '.join(parts)})" if parts else f"{gbps:.0f} GB/s"

    figures = facts.figures
    target = figures.get(f"decode_gbps_{DECODE_TARGET}")
    top = best(figures, "decode_gbps_")
    if top is None:
        lines.append("decode bandwidth: no figures")
    else:
        at_target = (f"{against_copy(target[0])} at {DECODE_TARGET}, " if target else "")
        lines.append(f"decode bandwidth: {at_target}best {against_copy(top[1])} at {top[0]}")
    prefill, tflops = best(figures, "prefill_gbps_"), best(figures, "prefill_tflops_")
    if prefill is None:
        lines.append("prefill bandwidth: no figures")
    else:
        compute = f"; best {tflops[1]:.0f} TFLOP/s at {tflops[0]}" if tflops else ""
        lines.append(f"prefill bandwidth: best {against_copy(prefill[1])} at {prefill[0]}"
                     f"{compute}")
    host = best(figures, "loop_host_us_per_layer_")
    lines.append(f"32-layer decode loop: host time up to {host[1]:.1f} us a layer beyond a CUDA "
                 f"graph's (at {host[0]})" if host else "32-layer decode loop: no figures")
    return lines


def summary(stages: list[Stage], facts: Facts) -> str:
    lines = [f"{PROG} summary"]
    lines += [f"  {name}: {value}" for name, value in facts.versions.items()]
    lines += [f"  {line}" for line in bandwidth_lines(facts)]
    lines.append(f"  {'stage':<8} {'result':<6} {'passed':>6} {'failed':>6} {'skipped':>7} "
                 f"{'seconds':>7}")
    for stage in stages:
        result = "ok" if stage.ok else "FAILED"
        lines.append(f"  {stage.name:<8} {result:<6} {stage.passed:>6} {stage.failed:>6} "
                     f"{stage.skipped:>7} {stage.seconds:>7.0f}")
    for stage in stages:
        lines += [f"  {stage.name}: {note}" for note in stage.notes]
        lines += [f"  {stage.name} problem: {problem}" for problem in stage.problems]
        if not stage.ok and not stage.problems:
            lines.append(f"  {stage.name} problem: nothing passed")
    failed = [stage.name for stage in stages if not stage.ok]
    lines.append(f"{PROG}: {'FAILED: ' + ', '.join(failed) if failed else 'passed'}")
    return "\n".join(lines)


def run_stage(stage: Stage, check: Callable[[Stage, float], None], timeout: float) -> None:
    """`check(stage, timeout)` in a thread; the stage fails if it raises or outlives `timeout`
    by STAGE_GRACE_S (its subprocesses stop themselves; a hung CUDA call is left behind)."""
    def run() -> None:
        try:
            check(stage, timeout)
        except Exception as exc:  # a stage's own bug: reported, the next stages still run
            stage.fail(exception_line(exc))

    thread = threading.Thread(target=run, name=stage.name, daemon=True)
    thread.start()
    thread.join(timeout + STAGE_GRACE_S)
    if thread.is_alive():
        stage.fail(f"did not finish within {timeout + STAGE_GRACE_S:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated, of {', '.join(STAGES)} (default: all)")
    parser.add_argument("--device", default="cuda",
                        help="the serve stage's device (cpu tries it without CUDA; default cuda)")
    args = parser.parse_args(argv)
    wanted = [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(STAGES))
    if unknown or not wanted:
        parser.error(f"--stages: unknown {', '.join(unknown) or 'nothing'}; of {STAGES}")
    needs_cuda = "cuda" in wanted or args.device != "cpu"
    missing = why_no_cuda() if needs_cuda else None
    if missing is not None:
        print(f"{PROG}: {missing}", file=sys.stderr)
        return 1
    started = time.monotonic()
    facts, stages = Facts(), []
    checks: dict[str, Callable[[Stage, float], None]] = {
        "cuda": lambda stage, _: check_cuda(stage, facts),
        "pytest": lambda stage, timeout: check_pytest(stage, timeout, on_cuda=needs_cuda),
        "bench": lambda stage, timeout: check_bench(stage, facts, timeout),
        "tune": check_tune,
        "serve": lambda stage, timeout: check_serve(stage, timeout, args.device),
    }
    for name in STAGES:
        if name not in wanted:
            continue
        stage = Stage(name)
        stages.append(stage)
        timeout = min(STAGE_TIMEOUT_S[name], DEADLINE_S - (time.monotonic() - started))
        began = time.monotonic()
        print(f"{PROG}: stage {name} (at most {timeout:.0f} s)", flush=True)
        if timeout < 5:
            stage.fail(f"no time left before the {DEADLINE_S:.0f} s deadline")
        else:
            run_stage(stage, checks[name], timeout)
        stage.seconds = time.monotonic() - began
    print(summary(stages, facts), flush=True)
    return 0 if all(stage.ok for stage in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
