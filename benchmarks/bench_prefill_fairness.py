"""Another client's decode latency while one client's long prefill runs (issue 17 #13).

Before, a runner step was never split: a client's long prefill ran as one forward while every
other client waited for all of it. Now no forward computes more than `--max-batch-tokens`: the
prefill runs as several forwards, and the other clients' decode steps join each of them.

Real processes: a pagedkvd and a `pagedkv runner` (small-llama, random weights) per budget. Client
B prefills a short prompt, then client A sends a PROMPT-token prompt and B decodes one token per
step, greedy, until A's prefill is answered. Per budget (512, and 8192, which computes the
prompt in one forward, as before the change):

    prefill_s_<budget>                      A's step, sent to answered
    bystander_steps_<budget>                B's decode steps answered meanwhile
    bystander_step_ms_max_<budget>          their longest latency (and the median)

Usage: python benchmarks/bench_prefill_fairness.py [--prompt N]
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from pagedkv.client import PoolClient, RunnerClient, SamplingParams, SeqStep
from pagedkv.process.launch import READY_STATE, start_daemon, start_runner

PRESET = "small-llama"
PROMPT = 4000
BUDGETS = (512, 8192)
BLOCK_SIZE = 16
NUM_BLOCKS = 512
GREEDY = SamplingParams(temperature=0.0)


async def measure(daemon: str, runner: str, prompt: int) -> tuple[float, list[float]]:
    """A's prefill time, and B's decode step latencies while it ran (seconds)."""
    async with await PoolClient.connect(daemon) as pool, \
            await RunnerClient.connect(runner) as compute, \
            await pool.open_session("prefill") as a, await pool.open_session("decode") as b:
        first = SeqStep(1, list(range(1, 9)), True, params=GREEDY)
        token = (await compute.step(b, [first]))[0].token_id
        began = time.perf_counter()
        prefill = asyncio.create_task(compute.step(a, [
            SeqStep(1, [(7 * i) % 999 + 1 for i in range(prompt)], True, params=GREEDY)]))
        steps = []
        while not prefill.done():
            sent = time.perf_counter()
            token = (await compute.step(b, [SeqStep(1, [token])]))[0].token_id
            steps.append(time.perf_counter() - sent)
        await prefill
        return time.perf_counter() - began, steps


def run(budget: int, prompt: int) -> tuple[float, list[float]]:
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        with start_daemon(folder, "--model-config", PRESET, "--num-blocks", str(NUM_BLOCKS),
                          "--block-size", str(BLOCK_SIZE), "--shm-dir", str(folder),
                          "--log-level", "warning") as daemon:
            daemon.wait_for_notification(READY_STATE)
            with start_runner(daemon.runners_target, folder, "--random-init", PRESET,
                              "--max-batch-tokens", str(budget),
                              "--log-level", "warning") as runner:
                runner.wait_for_notification(READY_STATE)
                result = asyncio.run(measure(daemon.unix_target, runner.unix_target, prompt))
                runner.stop()
            daemon.stop()
    return result


def main(prompt: int) -> None:
    for budget in BUDGETS:
        prefill_s, steps = run(budget, prompt)
        print(f"prefill_s_{budget}: {prefill_s:.2f} s ({prompt} tokens)")
        print(f"bystander_steps_{budget}: {len(steps)}")
        print(f"bystander_step_ms_max_{budget}: {1000 * max(steps):.0f} ms "
              f"(median {1000 * statistics.median(steps):.0f} ms)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=PROMPT)
    main(parser.parse_args().prompt)
