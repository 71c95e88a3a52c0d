"""benchmarks/bench_daemon_crash_restore.py's quick run prints every figure as `name: value
unit`: through a daemon crash restored from its crash log no stream fails and the runner
computes again exactly the tokens past the daemon's committed ones; with the crash log off
every stream fails and is submitted again."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_prints_every_figure() -> None:
    done = subprocess.run([sys.executable,
                           str(ROOT / "benchmarks" / "bench_daemon_crash_restore.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=True)
    figures = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(": ")
        value, unit = rest.split()
        figures[name] = (float(value), unit)
    assert set(figures) == {"recomputed_tokens_after_daemon_crash", "tokens_uncommitted_at_crash",
                            "recomputed_equals_uncommitted", "requests_failed_after_daemon_crash",
                            "recomputed_tokens_after_daemon_crash_cold",
                            "requests_failed_after_daemon_crash_cold"}
    recomputed, unit = figures["recomputed_tokens_after_daemon_crash"]
    assert unit == "tokens" and recomputed > 0
    assert figures["recomputed_equals_uncommitted"] == (1.0, "bool")
    assert figures["requests_failed_after_daemon_crash"] == (0.0, "requests")
    assert figures["requests_failed_after_daemon_crash_cold"] == (2.0, "requests")
    assert figures["recomputed_tokens_after_daemon_crash_cold"][0] > recomputed
