"""benchmarks/bench_restart_snapshot.py's quick run prints every figure as `name: value unit`,
and restores every sequence it wrote."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_restart_snapshot.py"),
                           "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True)
    figures = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(": ")
        value, unit = rest.split()
        figures[name] = (float(value), unit)
    assert set(figures) == {"snapshot_write_ms", "snapshot_restore_ms", "snapshot_check_ms",
                            "snapshot_bytes", "snapshot_sequences", "snapshot_blocks"}
    assert figures["snapshot_sequences"] == (32.0, "sequences")
