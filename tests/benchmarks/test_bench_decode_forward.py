"""benchmarks/bench_decode_forward.py's quick run prints every figure as `name: value unit`, and
the runner's greedy tokens (the CPU's default backend, and the torch twin's) equal transformers'
own decode loop's for every sequence."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = {"torch_threads", "decode_forward_ms", "hf_decode_step_ms", "decode_forward_vs_hf_step",
           "decode_attention_frac", "hf_attention_frac", "decode_tokens_match_hf",
           "runner_aten_calls_per_step", "hf_aten_calls_per_step", "decode_forward_twin_ms",
           "decode_forward_vs_twin"}


def test_the_quick_run_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_forward.py"),
                           "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=True)
    figures = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(": ")
        value, unit = rest.split()
        figures[name] = (float(value), unit)
    profiled = {name for name in figures if "_op_ms_" in name}
    assert set(figures) - profiled == FIGURES
    assert {name.split("_op_ms_")[0] for name in profiled} == {"runner", "hf"}
    assert figures["decode_tokens_match_hf"] == (1.0, "ratio")
    assert 0 < figures["decode_attention_frac"][0] < 1
    assert 0 < figures["hf_attention_frac"][0] < 1
