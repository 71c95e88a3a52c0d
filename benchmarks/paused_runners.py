"""A runner paused and resumed at random points while honest clients step: every token they are
given still equals a private recomputation (issue 31's fence, fence.py, under a random schedule).

    report = pause_runners(PausedConfig(seed=1, seconds=30))

On a fence_stack (stalled_runner.py: pagedkvd and runners A and B of one model, a small pool)
honest clients (fuzz_runner_honest.HonestClient, each token judged by
fuzz_runner_shadow.Reference) step on both runners. A pauser, at random moments: sends A an
impatient client's new prompt, stops A (SIGSTOP) at a random point (just after sending it, once
its blocks are allocated, or a moment into its forward), has a filler take every free block,
waits up to 3 hold_ms, and mostly has the impatient client close its session directly (the
bundled close: SessionBusy is retried while the daemon fences A if its hold on the session
lapsed), then resumes A (SIGCONT). A fenced A is restarted, as a supervisor would; its clients'
steps meanwhile fail and they release their sequences. The blocks freed go to the clients on B:
a write by a resumed A would show as a wrong token. (A weak detector beside
tests/model_runner/test_stalled_runner.py's directed attacks: with the fence reverted, two 20 s
runs on tiny-llama showed no wrong token; it checks that fences at random points break nothing.)
"""

import asyncio
import contextlib
import random
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fuzz_runner_corpus import GREEDY, SHARED_SALT, Corpus
from fuzz_runner_honest import HonestClient
from fuzz_runner_report import RunnerFuzzReport
from fuzz_runner_shadow import Reference
from stalled_runner import PATIENCE_S, FenceStack, allocated, fence_stack, fill, resume

from pagedkv.client import PagedKVError, PoolClient, RunnerClient, SeqStep

# The honest clients' model (small: every token is recomputed here) and pool: small enough that
# freed blocks are soon another client's.
MODEL = "tiny-llama"
NUM_BLOCKS = 160
HOLD_MS = 300


@dataclass(frozen=True)
class PausedConfig:
    seed: int = 1
    seconds: float = 30.0
    # Honest clients on each runner.
    clients_per_runner: int = 2
    hold_ms: int = HOLD_MS


@dataclass
class PausedReport:
    """What the run did, and every wrong token."""

    honest: RunnerFuzzReport
    # Times runner A was stopped, and killed by the daemon (then restarted).
    pauses: int = 0
    fences: int = 0
    # Any other exit of runner A (a finding).
    other_exits: list[int] = field(default_factory=list)

    def figures(self) -> list[str]:
        return [f"paused_runner_pauses: {self.pauses} pauses",
                f"paused_runner_fences: {self.fences} runners",
                f"paused_runner_steps: {self.honest.steps} steps",
                f"paused_runner_checked_tokens: {self.honest.checked_tokens} tokens",
                f"paused_runner_wrong_tokens: {len(self.honest.wrong_tokens)} tokens"]

    def findings(self) -> list[str]:
        return [*self.honest.wrong_tokens[:5],
                *(f"runner A exited {code}, not by a fence" for code in self.other_exits)]


async def pause_once(stack: FenceStack, pool: PoolClient, rng: random.Random, corpus: Corpus,
                     report: PausedReport) -> None:
    """One impatient step on A, A stopped at a random point, the session closed directly, A
    resumed (and restarted if it was fenced). The first pause of a run always outlasts the hold
    of a step whose blocks are allocated, and closes: every run fences at least once."""
    first = report.pauses == 0
    async with await RunnerClient.connect(stack.a.unix_target) as on_a:
        session = await pool.open_session("impatient")
        step = asyncio.create_task(on_a.step(session, [SeqStep(
            1, corpus.prompt(rng), new_sequence=True, params=GREEDY)]))
        point = "allocated" if first else rng.choice(("sent", "allocated", "computing"))
        if point != "sent":
            await allocated(session)
        if point == "computing":
            await asyncio.sleep(rng.uniform(0.0, 0.02))
        stack.a.send(signal.SIGSTOP)
        report.pauses += 1
        filler = await fill(pool, "")  # what the close frees is all the others can get
        await asyncio.sleep((2 if first else rng.uniform(0.0, 3.0)) * stack.hold_ms / 1000)
        if first or rng.random() < 0.8:
            with contextlib.suppress(PagedKVError):
                await session.close()
            await asyncio.sleep(rng.uniform(0.1, 0.4))  # the clients on B take those blocks
        resume(stack.a)
        await asyncio.wait([step], timeout=PATIENCE_S)
        if step.done():
            step.exception()  # the impatient client does not read its answer
        for ended in (session, filler):
            with contextlib.suppress(PagedKVError):
                await ended.close()
    code = stack.a.process.poll()
    if code is not None:
        if code == -signal.SIGKILL:
            report.fences += 1
        else:
            report.other_exits.append(code)
        await asyncio.to_thread(stack.restart_a)


async def pauser(stack: FenceStack, pool: PoolClient, config: PausedConfig, corpus: Corpus,
                 report: PausedReport, deadline: float) -> None:
    rng = random.Random(f"pauser-{config.seed}")
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        await asyncio.sleep(rng.uniform(0.1, 1.0))
        await pause_once(stack, pool, rng, corpus, report)


async def run(stack: FenceStack, config: PausedConfig, report: PausedReport) -> None:
    reference = Reference(MODEL)
    async with contextlib.AsyncExitStack() as exits:
        pool = await exits.enter_async_context(await PoolClient.connect(stack.daemon.unix_target))
        corpus = Corpus(config.seed, reference.vocab_size, (await pool.pool_info()).block_size)
        deadline = asyncio.get_running_loop().time() + config.seconds
        clients = []
        for i in range(2 * config.clients_per_runner):
            target = (stack.a if i % 2 == 0 else stack.b).unix_target
            runner = await exits.enter_async_context(await RunnerClient.connect(target))
            session = await exits.enter_async_context(await pool.open_session(
                f"honest-{i}", cache_salt=SHARED_SALT))
            clients.append(HonestClient(f"honest-{i}", config.seed, corpus, reference, session,
                                        runner, report.honest).run(deadline))
        await asyncio.gather(pauser(stack, pool, config, corpus, report, deadline), *clients)


def pause_runners(config: PausedConfig) -> PausedReport:
    """The run (module docstring) on processes of its own; its report."""
    report = PausedReport(RunnerFuzzReport(config.seed))
    with tempfile.TemporaryDirectory(prefix="pkv-pause-") as name, \
            fence_stack(Path(name), MODEL, num_blocks=NUM_BLOCKS,
                        hold_ms=config.hold_ms) as stack:
        asyncio.run(run(stack, config, report))
    return report
