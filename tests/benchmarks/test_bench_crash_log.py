"""benchmarks/bench_crash_log.py's quick run prints every figure as `name: value unit`, and its
replay gives back the steps it logged."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_crash_log.py"),
                           "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True)
    figures = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(": ")
        value, unit = rest.split()
        figures[name] = (float(value), unit)
    assert set(figures) == {f"wal_{kind}step_p50_{what}" for kind in ("", "service_")
                            for what in ("ms_off", "ms_on", "ratio")} | {
        "wal_bytes_per_step", "wal_checkpoint_ms", "wal_checkpoint_cold_ms",
        "wal_checkpoint_image_ms", "wal_replay_ms", "wal_steps"}
    assert figures["wal_steps"] == (20.0, "steps")
    assert figures["wal_bytes_per_step"][0] > 0
