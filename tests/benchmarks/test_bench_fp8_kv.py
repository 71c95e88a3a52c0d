"""benchmarks/bench_fp8_kv.py's quick run prints every figure as `name: value unit`, and the
capacity figure make bench reports holds: an fp8 view of an arena has twice the fp16 view's
blocks (>= 1.9 asked)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("kl_mean", "kl_max", "greedy_agree", "greedy_first_diff", "rel_err_tensor",
         "rel_err_token_head")


def test_the_quick_run_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fp8_kv.py"),
                           "--tokens", "4", "--families", "gemma2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    figures = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(": ")
        value, unit = rest.split()
        figures[name] = (float(value), unit)
    assert set(figures) == {"fp8_blocks_ratio", *(f"fp8_{n}_gemma2" for n in NAMES)}
    assert figures["fp8_blocks_ratio"][0] >= 1.9
    # The per-tensor scale's error is e4m3's (under 2**-4 relative), as the choice assumes.
    assert figures["fp8_rel_err_tensor_gemma2"][0] < 2**-4
    assert 0 <= figures["fp8_kl_mean_gemma2"][0] <= figures["fp8_kl_max_gemma2"][0]
