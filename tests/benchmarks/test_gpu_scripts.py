"""`make gpu-check` and `make bench-gpu` fail, not pass, on a machine without CUDA: exit status 1
and one line that says why, so a session that expected a GPU cannot mistake no check for a
passing one. (On a CUDA machine they are the checks themselves: `make gpu-check`.)"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CUDA is here: run make gpu-check itself")


@pytest.mark.parametrize(("target", "script"), [("gpu-check", "gpu_check.py"),
                                                ("bench-gpu", "bench_kernels_gpu.py")])
def test_without_cuda_the_gpu_target_fails_with_one_line(target: str, script: str) -> None:
    recipe = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    assert f"benchmarks/{script}" in recipe
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{target}: torch sees no CUDA device"), \
        done.stderr
