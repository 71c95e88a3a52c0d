"""Issue 31's attack on real processes: a runner stopped (SIGSTOP) while a forward it queued or
runs may still write a session's blocks, the blocks wanted by another session, and what the
daemon does about it (daemon/service/fence.py). Shared by the tests
(tests/model_runner/test_stalled_runner.py), bench_fence.py and soak.py's paused-runner case.

    with fence_stack(folder, write_model(folder)) as stack:   # pagedkvd, runners A and B
        outcome = await attack(stack, reference, Scenario(MID_FORWARD))

The attack (`attack`):
1. runner A computes a long prefill: bystander gamma's with beta's short step queued behind it
   (QUEUED), or beta's own (MID_FORWARD). Once the daemon has answered A's call for beta
   (beta's blocks allocated, A's hold set) A is stopped: at once when queued, once it has spent
   CPU time in the forward when mid-forward. A filler session of alpha's model takes every
   block alpha's format could get but beta's;
2. beta's hold lapses (A renews nothing while stopped); beta's blocks are taken: its own Free,
   or its model's sleep (SetModelState), asked every few ms until it goes through (`take`:
   `Taking.first` is the first answer after the lapse);
3. alpha, a session on runner B, gets the memory beta had: the same blocks (one model), or
   beta's pages withdrawn from A's format into B's (two models: "Models and pages"), and B
   computes alpha's prompt into them;
4. A resumes (SIGCONT: harmless if it was killed) and runs what it had queued; then alpha
   decodes, each token judged against a private recomputation (fuzz_runner_shadow.Reference).
Without a fence A's forward writes beta's K/V into alpha's blocks and alpha's tokens go wrong.
With it, A is killed (SIGKILL) before beta's blocks are freed and writes nothing.
"""

import asyncio
import contextlib
import functools
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fuzz_runner_corpus import GREEDY
from fuzz_runner_shadow import Reference
from transformers import LlamaConfig

from pagedkv.client import (
    PagedKVError,
    PoolClient,
    PoolExhausted,
    RunnerClient,
    SeqStep,
    Session,
    SessionBusy,
)
from pagedkv.process.launch import READY_STATE, Launched, start_daemon, start_runner
from pagedkv.vocab.geometry import dtype_bytes, model_name, resolve_geometry

# Large enough that a 1,536-token prefill takes a second or more of one CPU core: a stop lands
# inside it. Random weights with initializer_range=0.2 and no EOS, as the tests' tiny model.
SLOW_MODEL = LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=2048,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, initializer_range=0.2,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
BLOCK_SIZE = 16
# The long prefill (gamma's, or beta's mid-forward), in blocks: 1,536 tokens.
LONG_BLOCKS = 96
# Beta's short prompt (queued case) and alpha's: alpha's fits in beta's blocks with its decodes.
SHORT_PROMPT = 2 * BLOCK_SIZE
ALPHA_PROMPT = 2 * BLOCK_SIZE - 8
ALPHA_TOKENS = 6
# Blocks of the stopped runner's model a page holds: pages move between formats one by one.
PAGE_BLOCKS = 2
# Blocks past the prompts (the runner's reservations, if any), taken by the filler.
SLACK_BLOCKS = 8
NUM_BLOCKS = LONG_BLOCKS + 2 * (SHORT_PROMPT // BLOCK_SIZE) + SLACK_BLOCKS
# How long the runners' daemon calls hold a session (`pagedkv runner --hold-ms`).
HOLD_MS = 500
# CPU seconds the stopped runner spends in the long forward before the mid-forward stop.
STOP_AFTER_CPU_S = 0.15
# Patience for anything awaited (processes starting on a loaded 2-core machine).
PATIENCE_S = 60.0
# How often `fill` reads the free blocks again when other clients took some meanwhile.
FILL_TRIES = 5
# SessionBusy's message while a hold still runs, with what is left of it.
_HELD_FOR = re.compile(r"holds session \S+ for ([0-9]+) ms more")

QUEUED = "queued"
MID_FORWARD = "mid_forward"


def write_model(folder: Path, num_layers: int = SLOW_MODEL.num_hidden_layers) -> str:
    """SLOW_MODEL with `num_layers` layers (another K/V format when fewer), its config.json in a
    subfolder of `folder` named after it (the model's name): the daemon's --model-config, the
    runners' --random-init, the reference's source."""
    model = folder / f"slow-{num_layers}-layers"
    SLOW_MODEL.__class__(**{**SLOW_MODEL.to_dict(),
                            "num_hidden_layers": num_layers}).save_pretrained(model)
    return str(model / "config.json")


def block_bytes(model: str) -> int:
    """Bytes of one block of `model`'s K/V (a preset, or a config.json)."""
    geometry = resolve_geometry(model)
    return geometry.bytes_per_block(BLOCK_SIZE, dtype_bytes(geometry.default_dtype))


def runner_args(model: str, hold_ms: int) -> tuple[str, ...]:
    return ("--random-init", str(model), "--hold-ms", str(hold_ms), "--torch-threads", "1",
            "--log-level", "warning")


@dataclass
class FenceStack:
    """A daemon and two runners: A (the one stopped) and B, each of its model (the daemon's own
    is B's)."""

    daemon: Launched
    a: Launched
    b: Launched
    # Each runner's model (a preset, or a config.json).
    a_model: str
    b_model: str
    folder: Path
    hold_ms: int

    @property
    def a_name(self) -> str:
        return model_name(self.a_model)

    @property
    def b_name(self) -> str:
        return model_name(self.b_model)

    def restart_a(self) -> Launched:
        """A new runner A (the last one was fenced), as a supervisor would start it."""
        resume(self.a)
        self.a.stop()
        self.a = start_runner(self.daemon.runners_target, self.folder / "a",
                              *runner_args(self.a_model, self.hold_ms))
        self.a.wait_for_notification(READY_STATE, PATIENCE_S)
        return self.a


@contextmanager
def fence_stack(folder: Path, a_model: str, b_model: str | None = None,
                num_blocks: int = NUM_BLOCKS, hold_ms: int = HOLD_MS) -> Iterator[FenceStack]:
    """pagedkvd (its own model B's; the memory of num_blocks of A's model, BLOCK_SIZE tokens
    each, PAGE_BLOCKS of them a page) and runners A and B (B's model is A's unless named), each
    in its own subfolder of `folder`; every process stopped (A resumed first) at the end."""
    b_model = b_model or a_model
    for name in ("d", "a", "b"):
        (folder / name).mkdir(exist_ok=True)
    a_bytes, b_bytes = block_bytes(a_model), block_bytes(b_model)
    with start_daemon(folder / "d", "--shm-dir", str(folder / "d"), "--model-config",
                      b_model, "--num-blocks", str(num_blocks * a_bytes // b_bytes),
                      "--page-size", str(PAGE_BLOCKS * a_bytes), "--block-size",
                      str(BLOCK_SIZE)) as daemon:
        daemon.wait_for_notification(READY_STATE, PATIENCE_S)
        start = functools.partial(start_runner, daemon.runners_target)
        stack = FenceStack(daemon, start(folder / "a", *runner_args(a_model, hold_ms)),
                           start(folder / "b", *runner_args(b_model, hold_ms)),
                           a_model, b_model, folder, hold_ms)
        try:
            stack.a.wait_for_notification(READY_STATE, PATIENCE_S)
            stack.b.wait_for_notification(READY_STATE, PATIENCE_S)
            yield stack
        finally:
            resume(stack.a)
            stack.a.stop()
            stack.b.stop()


def resume(process: Launched) -> None:
    """SIGCONT, if it still runs."""
    if process.process.poll() is None:
        process.send(signal.SIGCONT)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def eventually(condition: Callable[[], Awaitable[bool]], what: str,
                     timeout: float = PATIENCE_S, poll_s: float = 0.01) -> None:
    """Poll `condition` until true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(poll_s)


async def blocks_held(session: Session) -> int:
    stats = (await session.stats()).session
    return 0 if stats is None else stats.blocks_held


async def allocated(session: Session) -> None:
    """Wait until `session` holds blocks: a runner's daemon call for its step was answered."""
    async def holds() -> bool:
        return await blocks_held(session) > 0
    await eventually(holds, f"the blocks of session {session.session_id[:8]}")


async def computing(runner: Launched) -> None:
    """Wait until `runner` has spent STOP_AFTER_CPU_S of CPU from now: inside a forward."""
    start = cpu_seconds(runner.process.pid)

    async def spent() -> bool:
        return cpu_seconds(runner.process.pid) - start >= STOP_AFTER_CPU_S
    await eventually(spent, "the runner computing", poll_s=0.002)


async def fill(pool: PoolClient, model: str) -> Session:
    """A session of `model` holding every block its format could get now (read again when
    other clients took some between the figure and the allocation)."""
    filler = await pool.open_session("filler", model=model)
    for _ in range(FILL_TRIES):
        free = (await filler.stats()).free_blocks
        if not free:
            break
        try:
            await filler.allocate(1, free * BLOCK_SIZE)
            break
        except PoolExhausted:
            continue
    return filler


@dataclass
class Taking:
    """A call that frees beta's blocks, asked until it goes through (`take`)."""

    # The first answer after the hold lapsed: "granted" (no fence), or SessionBusy's message.
    first: str = ""
    # When the hold lapsed, by the last "held for N ms more" answer (monotonic seconds: the
    # daemon's clock, seen from here), when the first answer after it came, and when the call
    # went through.
    lapse: float = 0.0
    answered: float = 0.0
    granted: float = 0.0


async def take(call: Callable[[], Awaitable[object]]) -> Taking:
    """Ask `call` (beta's Free, its model's sleep) every few ms until it goes through."""
    taking = Taking()
    while True:
        sent = time.monotonic()
        try:
            await call()
        except SessionBusy as exc:
            left = _HELD_FOR.search(exc.message)
            if left is not None:
                taking.lapse = sent + int(left.group(1)) / 1000
            elif not taking.first:
                taking.first, taking.answered = exc.message, time.monotonic()
            await asyncio.sleep(0.005)
            continue
        taking.granted = time.monotonic()
        if not taking.first:
            taking.first, taking.answered = "granted", taking.granted
        return taking


@dataclass(frozen=True)
class Scenario:
    """One form of the attack."""

    # Where runner A is stopped: QUEUED (beta's step behind gamma's long prefill) or
    # MID_FORWARD (inside beta's own long prefill).
    stop: str
    # What takes beta's blocks from it: its own Free (False) or its model's sleep (True).
    sleep: bool = False


@dataclass
class Outcome:
    """What the attack did."""

    taking: Taking
    # Pages of alpha's blocks that held beta's (the premise: else nothing could go wrong).
    shared_pages: int = 0
    # Alpha's tokens, and the reference's verdict on each wrong one.
    alpha_tokens: list[int] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    # Runner A's exit status once resumed and awaited (None: still running).
    a_exit: int | None = None


async def judged_steps(runner: RunnerClient, session: Session, reference: Reference,
                       prompt: list[int], outcome: Outcome, between: Callable[[], Awaitable[None]]
                       ) -> None:
    """Alpha's prompt then ALPHA_TOKENS - 1 decodes on `runner`, each token judged; `between`
    runs after the prompt's step."""
    tokens = list(prompt)
    step = SeqStep(1, prompt, new_sequence=True, params=GREEDY)
    for i in range(ALPHA_TOKENS):
        last = i == ALPHA_TOKENS - 1
        (out,) = await runner.step(session, [step], release=[1] if last else [])
        verdict = reference.judge(tokens, out.token_id, out.logprob)
        if verdict.wrong:
            outcome.wrong.append(f"token {i}: {verdict.wrong}")
        outcome.alpha_tokens.append(out.token_id)
        tokens.append(out.token_id)
        step = SeqStep(1, [out.token_id])
        if i == 0:
            await between()


async def pages_of(pool: PoolClient, model: str, session: Session) -> set[int]:
    """The pages of sequence 1's blocks of `session` (of `model`)."""
    (table,) = await session.block_tables([1])
    per_page = {m.name: m.blocks_per_page for m in (await pool.pool_info()).models}[model]
    return {block // per_page for block in table.block_ids}


async def attack(stack: FenceStack, reference: Reference, scenario: Scenario) -> Outcome:
    """Issue 31's attack (module docstring) on `stack`, alpha judged by `reference` (runner B's
    model); its outcome. Runner A ends dead, or resumed."""
    mid_forward = scenario.stop == MID_FORWARD
    long_prompt = [(7 * j + 3) % 128 for j in range(LONG_BLOCKS * BLOCK_SIZE)]
    beta_prompt = long_prompt if mid_forward else [(5 * j + 1) % 128 for j in range(SHORT_PROMPT)]
    alpha_prompt = [(11 * j + 2) % 128 for j in range(ALPHA_PROMPT)]
    async with contextlib.AsyncExitStack() as exits:
        async def connect(target: str) -> PoolClient:
            return await exits.enter_async_context(await PoolClient.connect(target))
        pool = await connect(stack.daemon.unix_target)
        on_a = await exits.enter_async_context(await RunnerClient.connect(stack.a.unix_target))
        on_b = await exits.enter_async_context(await RunnerClient.connect(stack.b.unix_target))
        beta = await exits.enter_async_context(await pool.open_session("beta",
                                                                       model=stack.a_name))
        alpha = await exits.enter_async_context(await pool.open_session("alpha",
                                                                        model=stack.b_name))
        a_steps = []
        if not mid_forward:  # gamma's long prefill keeps A's forward thread busy
            gamma = await exits.enter_async_context(await pool.open_session(
                "gamma", model=stack.a_name))
            a_steps.append(asyncio.create_task(on_a.step(
                gamma, [SeqStep(1, long_prompt, new_sequence=True, params=GREEDY)])))
            await allocated(gamma)
            await computing(stack.a)
        a_steps.append(asyncio.create_task(on_a.step(
            beta, [SeqStep(1, beta_prompt, new_sequence=True, params=GREEDY)])))
        try:
            await allocated(beta)
            if mid_forward:
                await computing(stack.a)
            stack.a.send(signal.SIGSTOP)
            if any(task.done() for task in a_steps):
                raise AssertionError("runner A answered before it was stopped: the long "
                                     "prefill is too short for this machine")
            beta_pages = await pages_of(pool, stack.a_name, beta)
            await exits.enter_async_context(await fill(pool, stack.b_name))
            if scenario.sleep:  # on the runner socket: SetModelState is for runners
                runners = await connect(stack.daemon.runners_target)
                outcome = Outcome(await take(lambda: runners.set_model_state(stack.a_name,
                                                                             True)))
            else:
                outcome = Outcome(await take(lambda: beta.free(1)))
            await beta.close()

            async def a_resumes() -> None:
                outcome.shared_pages = len(await pages_of(pool, stack.b_name, alpha)
                                           & beta_pages)
                resume(stack.a)
                await asyncio.wait(a_steps, timeout=PATIENCE_S)
            await judged_steps(on_b, alpha, reference, alpha_prompt, outcome, a_resumes)
        finally:
            resume(stack.a)
            await asyncio.wait(a_steps, timeout=PATIENCE_S)
        for task in a_steps:  # their answers (or A's death) are not what is judged
            with contextlib.suppress(PagedKVError):
                task.result()
    outcome.a_exit = stack.a.process.poll()
    return outcome
