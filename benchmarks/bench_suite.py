"""The suite's wall time, the figure issue 30 names (`make test` in at most 10 minutes on the
2-core VM), measured as `make test` runs it:

    make_test_checks_s   ruff, mypy and the protobuf check (`make lint typecheck proto-check`;
                         ~30 s with mypy's cache cold, a few seconds warm)
    suite_wall_s         the suite (`make pytest`: two workers, a file each)
    make_test_wall_s     their sum: `make test` on a machine whose venv is set up (a fresh
                         machine adds `make setup`, ~75 s here)
    suite_passed, suite_failed   the suite's counts

Usage: python benchmarks/bench_suite.py (the repository's root is its working directory)
"""

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 600


def timed_make(*targets: str) -> tuple[float, str]:
    """Seconds `make targets` took, and what it printed; exits if it failed."""
    start = time.perf_counter()
    done = subprocess.run(["make", *targets], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"bench_suite: make {' '.join(targets)} failed:\n{done.stdout[-4000:]}"
                 f"{done.stderr[-2000:]}")
    return seconds, done.stdout


def count(summary: str, outcome: str) -> int:
    match = re.search(rf"(\d+) {outcome}", summary)
    return int(match[1]) if match else 0


def main() -> None:
    checks_s, _ = timed_make("lint", "typecheck", "proto-check")
    suite_s, output = timed_make("pytest")
    summary = output.strip().splitlines()[-1]
    print(f"make_test_checks_s: {checks_s:.1f} s")
    print(f"suite_wall_s: {suite_s:.1f} s")
    print(f"make_test_wall_s: {checks_s + suite_s:.1f} s (goal <= {GOAL_S} s)")
    print(f"suite_passed: {count(summary, 'passed')}")
    print(f"suite_failed: {count(summary, 'failed')}")


if __name__ == "__main__":
    main()
