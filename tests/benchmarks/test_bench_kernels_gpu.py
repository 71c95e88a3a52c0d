"""benchmarks/bench_kernels_gpu.py (`make bench-gpu`) on a machine without a GPU: it imports, its
case list covers the matrix issue 33 asks for (decode and prefill x fp16 and bf16 x D=128 and
D=256, and the fp8 cache), its layer loop is 32 layers, the datasheet table knows the usual data
centre GPUs and says "unknown" for others, and the correctness check passes under the
interpreter on tiny shapes. (Without CUDA the script itself fails: test_gpu_scripts.)"""

import sys
from itertools import product
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kernels_gpu
import layer_loop_bench
from device_bandwidth import datasheet_bandwidth


def test_the_cases_cover_the_matrix() -> None:
    cells = {(case.kernel, case.head_dim, case.dtype, case.kv_dtype)
             for case in bench_kernels_gpu.CASES}
    for kernel, head_dim, dtype in product(("decode", "prefill"), (128, 256),
                                           (torch.float16, torch.bfloat16)):
        assert (kernel, head_dim, dtype, dtype) in cells
        assert (kernel, head_dim, dtype, torch.float8_e4m3fn) in cells
    assert len({case.name for case in bench_kernels_gpu.CASES if case.kernel == "decode"}) == 8
    for case in bench_kernels_gpu.CASES:  # each head dim has its geometry
        assert bench_kernels_gpu.GEOMETRIES[case.head_dim].head_dim == case.head_dim


def test_the_layer_loop_is_a_32_layer_forward() -> None:
    assert layer_loop_bench.LOOP_LAYERS == 32
    assert set(layer_loop_bench.QUICK_LOOP_POINTS) <= set(layer_loop_bench.LOOP_POINTS)


@pytest.mark.parametrize(("name", "tbps"), [
    ("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA H100 PCIe", 2.0), ("NVIDIA H100 NVL", 3.9),
    ("NVIDIA H200", 4.8), ("NVIDIA GH200 480GB", 4.0), ("NVIDIA A100-SXM4-80GB", 2.039),
    ("NVIDIA A100 80GB PCIe", 1.935), ("NVIDIA A100-SXM4-40GB", 1.555), ("NVIDIA L40S", 0.864),
    ("NVIDIA L4", 0.3)])
def test_the_datasheet_table_knows_the_usual_devices(name: str, tbps: float) -> None:
    assert datasheet_bandwidth(name) == pytest.approx(tbps * 1e12)


def test_an_unknown_device_has_no_datasheet_figure() -> None:
    assert datasheet_bandwidth("NVIDIA GeForce RTX 4090") is None
    assert datasheet_bandwidth("") is None


def test_the_correctness_check_passes_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_kernels_gpu.main(["--cpu-check"]) == 0
    assert "check_passed: 1 bool" in capsys.readouterr().out
