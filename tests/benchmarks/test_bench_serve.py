"""benchmarks/bench_serve.py keeps working: its reduced run (`--quick`) starts `pagedkv serve` and
an offline `LLM` on each of its two model folders, checks that every request ran to max_tokens
with ignore_eos (through aiohttp and the real openai client), and prints each figure of both
models as `name: value unit`."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURE = re.compile(r"^([a-z0-9_]+): ([0-9.]+) (\S+)$")
# The quick run's concurrency levels (the full run's are 1, 8 and 32).
QUICK_STREAMS = (1, 2)


@pytest.mark.slow
def test_the_quick_serve_benchmark_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"),
                           "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {match[1]: (float(match[2]), match[3])
               for line in done.stdout.splitlines() if (match := FIGURE.match(line))}
    expected = {f"{name}{model}": unit for model in ("", "_tiny") for name, unit in (
        ("llm_tok_s", "tok/s"), ("serve_tok_s", "tok/s"), ("serve_vs_llm_tok_s", "ratio"),
        ("llm_cpu_us_per_tok", "us"), ("serve_cpu_us_per_tok", "us"),
        ("server_cpu_us_per_tok", "us"))}
    for streams in QUICK_STREAMS:
        expected |= {f"serve_ttft_p50_ms_c{streams}": "ms", f"serve_itl_p50_ms_c{streams}": "ms"}
    assert {name: unit for name, (_, unit) in figures.items()} == expected, done.stdout
    # CPU time is counted in clock ticks: a quick round may take fewer than one.
    assert all(value > 0 or unit == "us" for value, unit in figures.values()), done.stdout
