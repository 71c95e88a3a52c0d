"""benchmarks/bench_release_batch.py runs and prints its figures as `name: value unit`."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_release_batch.py"),
                           "--rounds", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert set(figures) == {"release_batch_ms", "release_batch_ops"}
    assert float(figures["release_batch_ms"].split()[0]) > 0
    assert figures["release_batch_ops"] == "65 ops"
