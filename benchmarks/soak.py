"""`make soak`: the stateful fuzzers and the load run at full size, each on fresh processes.

    fuzz         30,000 seeded calls on a 256-block pool (block size 16), six sessions
    load         8 client processes for 60 s on a 4,096-block pool, and a victim process with
                 500 ms leases SIGKILLed every 1.5-4 s
    runner fuzz  a pagedkvd and a runner (tiny Llama) for 120 s: 3 honest clients checked token
                 by token against a private recomputation (some followed by the runner: its
                 pushes checked, stale plans refused), a hostile client, client processes
                 SIGKILLed mid-step (fuzz_runner.py)
    paused runner  a pagedkvd and two runners (tiny Llama) for 60 s: runner A stopped (SIGSTOP)
                 at random points while honest clients step on both, an impatient client
                 closing its session directly meanwhile; the daemon fences A (SIGKILL), it is
                 restarted; every token checked against a private recomputation
                 (paused_runners.py)

Prints every figure as `name: value unit` (fuzz_calls, fuzz_internal_errors, fuzz_leaked_blocks,
load_ops_per_s, load_step_p99_ms, load_healthy_sessions_expired, load_blocks_leaked,
runner_fuzz_steps, runner_fuzz_wrong_tokens, runner_fuzz_leaked_blocks,
paused_runner_wrong_tokens, paused_runner_fences, ...), then `# ` lines
naming any finding; exits 1 if there is one (malformed bytes answered UNKNOWN and over-long
error details are counted, not failed: known findings).
Usage: python benchmarks/soak.py [--seed 1] [--calls 30000] [--clients 8] [--seconds 60]
       [--runner-seconds 120] [--paused-seconds 60]
"""

import argparse
import sys

import fuzz_daemon
import load_daemon
from daemon_process import running_pagedkvd
from fuzz_daemon import FuzzConfig, run_fuzz
from fuzz_runner import RunnerFuzzConfig, run_runner_fuzz, running_stack
from load_daemon import LoadConfig, run_load
from paused_runners import PausedConfig, pause_runners


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30_000)
    parser.add_argument("--fuzz-seconds", type=float, default=900.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runner-seconds", type=float, default=120.0)
    parser.add_argument("--paused-seconds", type=float, default=60.0)
    args = parser.parse_args()
    findings: list[str] = []

    with running_pagedkvd(*fuzz_daemon.DAEMON_ARGS) as daemon:
        fuzz = run_fuzz(daemon.target, daemon.metrics, FuzzConfig(seed=args.seed, calls=args.calls,
                                                  seconds=args.fuzz_seconds))
    for line in fuzz.figures():
        print(line, flush=True)
    findings += fuzz.findings()
    if fuzz.leaked_blocks != 0:
        findings.append(f"fuzz: {fuzz.leaked_blocks} blocks leaked")
    if daemon.exit_code != 0:
        findings.append(f"fuzz: pagedkvd exited {daemon.exit_code}:\n{daemon.log[-2000:]}")

    with running_pagedkvd(*load_daemon.DAEMON_ARGS) as daemon:
        config = LoadConfig(clients=args.clients, seconds=args.seconds, seed=args.seed)
        load = run_load(daemon.target, daemon.metrics, config)
    for line in load.figures():
        print(line, flush=True)
    if load.healthy_sessions_expired or load.blocks_leaked or load.sequences_leaked:
        findings.append(f"load: {load.healthy_sessions_expired} healthy sessions expired, "
                        f"{load.blocks_leaked} blocks and {load.sequences_leaked} sequences "
                        "leaked")
    unexpected = {name: n for name, n in load.errors.items() if name != "PoolExhausted"}
    if unexpected:
        findings.append(f"load: unexpected errors {unexpected}")
    if daemon.exit_code != 0:
        findings.append(f"load: pagedkvd exited {daemon.exit_code}:\n{daemon.log[-2000:]}")

    with running_stack() as stack:
        runner_fuzz = run_runner_fuzz(stack.daemon, stack.runner, stack.metrics, stack.tenancy,
                                      RunnerFuzzConfig(seed=args.seed,
                                                       seconds=args.runner_seconds))
    for line in runner_fuzz.figures():
        print(line, flush=True)
    findings += [f"runner fuzz: {finding}" for finding in runner_fuzz.findings()]
    if stack.exit_codes != (0, 0):
        findings.append(f"runner fuzz: pagedkvd and the runner exited {stack.exit_codes}:\n"
                        f"{stack.logs}")

    paused = pause_runners(PausedConfig(seed=args.seed, seconds=args.paused_seconds))
    for line in paused.figures():
        print(line, flush=True)
    findings += [f"paused runner: {finding}" for finding in paused.findings()]

    for finding in [*findings, *fuzz.trailer_overflows[:3]]:
        print(f"# {finding}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
