"""The runner fuzzer's killed clients: processes SIGKILLed in the middle of a runner step.

    await kill_clients(daemon, runner, seed, corpus, report, deadline)

Each victim is this file run with --victim: it opens a session under the shared cache salt with
a short lease and steps long prompts (whose blocks honest prompts share) and decodes through the
runner until it is killed, at a random moment after its first step began. Its session lapses
with its lease (the runner holds the lease while a step of it is queued or computed); nothing
it held may leak.
"""

import argparse
import asyncio
import contextlib
import random
import sys

from fuzz_runner_corpus import GREEDY, SHARED_SALT, Corpus
from fuzz_runner_report import RunnerFuzzReport

from pagedkv.client import PagedKVError, PoolClient, RunnerClient, SeqStep

# A killed client's lease, and how long it steps before its SIGKILL (after its first step).
VICTIM_LEASE_MS = 1000
VICTIM_LIFE_S = (0.0, 0.6)


async def kill_clients(daemon: str, runner: str, seed: int, corpus: Corpus,
                       report: RunnerFuzzReport, deadline: float) -> None:
    """Start a client process, let it step through the runner, SIGKILL it mid-step; again."""
    rng, loop = random.Random(f"killer-{seed}"), asyncio.get_running_loop()
    while loop.time() < deadline:
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--victim", daemon, runner, str(rng.randrange(1 << 30)),
            str(corpus.vocab_size), str(corpus.block_size), str(seed),
            stdout=asyncio.subprocess.PIPE)
        assert process.stdout is not None
        report.hostile_started("killed_client", f"(pid {process.pid})")
        with contextlib.suppress(TimeoutError):  # its first step began (or it took too long)
            await asyncio.wait_for(process.stdout.readline(), max(1.0, deadline - loop.time()))
        await asyncio.sleep(rng.uniform(*VICTIM_LIFE_S))
        process.kill()
        out, _ = await process.communicate()
        report.hostile_action("killed_client", "killed", f"(pid {process.pid}, in its step "
                              f"{out.count(b'step') + 1})")


async def victim(daemon: str, runner_target: str, seed: int, corpus: Corpus) -> None:
    """Step long prompts and decodes through the runner until SIGKILLed; print a line per
    step sent."""
    rng = random.Random(seed)
    async with await PoolClient.connect(daemon, timeout=30) as pool, \
            await RunnerClient.connect(runner_target) as runner:
        session = await pool.open_session("victim", lease_ttl_ms=VICTIM_LEASE_MS,
                                          cache_salt=SHARED_SALT)
        seq_id = 0
        while True:
            seq_id += 1
            prompt = corpus.prompt(rng) + corpus.tokens(rng, rng.randint(0, 64))
            print("step", flush=True)
            with contextlib.suppress(PagedKVError):
                out = await runner.step(session, [SeqStep(seq_id, prompt, new_sequence=True,
                                                          params=GREEDY)])
                for _ in range(rng.randint(0, 4)):
                    print("step", flush=True)
                    out = await runner.step(session, [SeqStep(seq_id, [out[0].token_id],
                                                              params=GREEDY)])
            print("step", flush=True)
            with contextlib.suppress(PagedKVError):
                await runner.step(session, [], [seq_id])


def main() -> None:
    parser = argparse.ArgumentParser(description="a runner fuzzer client killed mid-step")
    parser.add_argument("--victim", nargs=6, required=True,
                        metavar=("DAEMON", "RUNNER", "SEED", "VOCAB", "BLOCK", "CORPUS_SEED"))
    args = parser.parse_args().victim
    corpus = Corpus(int(args[5]), int(args[3]), int(args[4]))
    asyncio.run(victim(args[0], args[1], int(args[2]), corpus))


if __name__ == "__main__":
    main()
