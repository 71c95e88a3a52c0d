"""How soon a stalled runner's blocks go to another session (issue 31's fence, fence.py).

    python benchmarks/bench_fence.py [--rounds 5] [--hold-ms 500]

A pagedkvd and a runner A (benchmarks/stalled_runner.py's slow model, CPU). Each round: beta's
1,536-token prefill runs on A; A is stopped (SIGSTOP) inside it; a filler takes the rest of the
pool; beta's own Free is asked every 5 ms (the daemon answers "held for N ms more" until the
hold lapses, then SessionBusy while it kills A, then frees); alpha's Allocate follows at once and
gets beta's blocks. A is restarted for the next round, as a supervisor would.

- fence_reassign_ms: from the hold's lapse (the last "held for N ms more" answer's send time + N:
  the daemon's clock, seen from here) to alpha's Allocate answered with beta's blocks; it
  includes up to 5 ms of polling after the lapse;
- fence_kill_to_exit_ms: from the first refusal after the lapse (the daemon sent SIGKILL just
  before answering it) to A's exit, as its parent (this process) sees it;
- fence_kill_to_free_ms: from that refusal to the Free granted (the daemon saw the exit).
Each figure is the median of the rounds, with the worst beside it.
"""

import argparse
import asyncio
import contextlib
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stalled_runner import (
    BLOCK_SIZE,
    LONG_BLOCKS,
    allocated,
    computing,
    fence_stack,
    fill,
    take,
    write_model,
)

from pagedkv.client import PoolClient, RunnerClient, SamplingParams, SeqStep
from pagedkv.process.launch import Launched

# The pool: beta's long prompt, alpha's two blocks' worth and a little slack.
NUM_BLOCKS = LONG_BLOCKS + 16


@dataclass(frozen=True)
class Round:
    """One round's moments, in ms from the hold's lapse."""

    reassigned_ms: float
    kill_to_exit_ms: float
    kill_to_free_ms: float


def exit_moment(process: Launched) -> list[float]:
    """A list that gets the monotonic time `process` exits, from a thread waiting on it."""
    moment: list[float] = []

    def wait() -> None:
        process.process.wait()
        moment.append(time.monotonic())
    threading.Thread(target=wait, daemon=True).start()
    return moment


async def one_round(daemon: str, a: Launched, runner_target: str) -> Round:
    prompt = [(7 * j + 3) % 128 for j in range(LONG_BLOCKS * BLOCK_SIZE)]
    async with contextlib.AsyncExitStack() as exits:
        pool = await exits.enter_async_context(await PoolClient.connect(daemon))
        runner = await exits.enter_async_context(await RunnerClient.connect(runner_target))
        beta = await exits.enter_async_context(await pool.open_session("beta"))
        alpha = await exits.enter_async_context(await pool.open_session("alpha"))
        step = asyncio.create_task(runner.step(beta, [SeqStep(
            1, prompt, new_sequence=True, params=SamplingParams(temperature=0.0))]))
        await allocated(beta)
        await computing(a)
        a.send(signal.SIGSTOP)
        exited = exit_moment(a)
        (table,) = await beta.block_tables([1])
        await exits.enter_async_context(await fill(pool, ""))
        taking = await take(lambda: beta.free(1))
        blocks = await alpha.allocate(1, 2 * BLOCK_SIZE)
        reassigned = time.monotonic()
        if not set(blocks.block_ids) <= set(table.block_ids):
            raise RuntimeError("alpha's blocks were not beta's: the pool had other room")
        a.send(signal.SIGCONT)
        await asyncio.wait([step], timeout=60)
        if step.done():
            step.exception()  # A's death, seen: not what is measured
        if not exited or taking.first == "granted":
            raise RuntimeError(f"runner A was not fenced: {taking.first}")
    return Round(1000 * (reassigned - taking.lapse), 1000 * (exited[0] - taking.answered),
                 1000 * (taking.granted - taking.answered))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hold-ms", type=int, default=500)
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="pkv-fence-") as name, \
            fence_stack(Path(name), write_model(Path(name)), num_blocks=NUM_BLOCKS,
                        hold_ms=args.hold_ms) as stack:
        for i in range(args.rounds):
            if i:
                stack.restart_a()
            rounds.append(asyncio.run(one_round(stack.daemon.unix_target, stack.a,
                                                stack.a.unix_target)))
    print(f"fence_rounds: {len(rounds)} rounds (hold_ms {args.hold_ms})")
    for figure in ("reassigned_ms", "kill_to_exit_ms", "kill_to_free_ms"):
        values = [getattr(r, figure) for r in rounds]
        name = "fence_reassign_ms" if figure == "reassigned_ms" else f"fence_{figure}"
        print(f"{name}: {statistics.median(values):.1f} ms")
        print(f"{name}_max: {max(values):.1f} ms")


if __name__ == "__main__":
    main()
