"""pagedkv.memory.cuda_driver: which drivers can run which CUDA build of torch (no GPU needed: the
versions are arguments, or monkeypatched), and what the daemon and the runner say at start."""

import ctypes
import re

import pytest
import torch

from pagedkv.memory import cuda_driver
from pagedkv.memory.cuda_driver import (
    CudaDriverTooOld,
    driver_cuda_version,
    driver_too_old,
    driver_version_text,
    require_driver_for_torch,
    why_no_cuda,
)


@pytest.mark.parametrize(("version", "text"), [(12080, "12.8"), (13000, "13.0"), (13010, "13.1"),
                                               (11040, "11.4"), (12020, "12.2")])
def test_driver_versions_read_as_major_dot_minor(version: int, text: str) -> None:
    assert driver_version_text(version) == text


@pytest.mark.parametrize(("torch_cuda", "driver"), [
    ("13.0", 13000),  # the same version
    ("12.8", 13000),  # a newer driver runs every older build
    ("12.8", 12020),  # minor version compatibility: a 12.x build on any 12.x driver
    ("13.1", 13000),
    (None, 12080),  # a CPU (or ROCm) build of torch
    ("13.0", None),  # no driver: torch says it sees no device
])
def test_a_driver_of_the_same_or_a_newer_major_version_runs_the_build(
        torch_cuda: str | None, driver: int | None) -> None:
    assert driver_too_old("2.13.0", torch_cuda, driver) is None


def test_an_older_major_version_is_refused_naming_both_and_what_to_install() -> None:
    assert driver_too_old("2.13.0", "13.0", 12080) == (
        "torch 2.13.0 was built for CUDA 13.0, but the NVIDIA driver supports CUDA up to 12.8: "
        "install a driver for CUDA 13.0 or newer, or a torch built for CUDA 12.x (PyTorch's "
        "cu12x wheels)")
    message = driver_too_old("2.5.1+cu121", "12.1", 11080)
    assert message is not None and "built for CUDA 12.1" in message and "up to 11.8" in message
    assert "CUDA 11.x" in message


def fake_driver(monkeypatch: pytest.MonkeyPatch, torch_cuda: str | None,
                driver: int | None) -> None:
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(cuda_driver, "driver_cuda_version", lambda: driver)


def test_require_driver_for_torch_reads_this_torch_and_this_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_driver(monkeypatch, "13.0", 12080)
    with pytest.raises(CudaDriverTooOld, match=rf"torch {re.escape(torch.__version__)} was built "
                                                r"for CUDA 13\.0, but .* up to 12\.8"):
        require_driver_for_torch()
    fake_driver(monkeypatch, "13.0", 13000)
    require_driver_for_torch()
    fake_driver(monkeypatch, None, None)  # this machine, as CI runs it
    require_driver_for_torch()


def test_why_no_cuda_says_it_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake_driver(monkeypatch, None, None)
    assert why_no_cuda() == (f"torch sees no CUDA device (torch {torch.__version__}, CUDA build: "
                             "none, driver: none)")
    fake_driver(monkeypatch, "13.0", 13000)  # a build and a driver, but no visible device
    assert why_no_cuda() == (f"torch sees no CUDA device (torch {torch.__version__}, CUDA build: "
                             "13.0, driver: CUDA 13.0)")
    fake_driver(monkeypatch, "13.0", 12080)  # the driver is the reason: said so
    assert why_no_cuda() == driver_too_old(torch.__version__, "13.0", 12080)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake_driver(monkeypatch, "13.0", 13000)
    assert why_no_cuda() is None


class FakeLibcuda:
    """libcuda.so.1's cuDriverGetVersion: writes `version` and returns `status`."""

    def __init__(self, version: int, status: int = 0) -> None:
        self.version, self.status = version, status

    def cuDriverGetVersion(self, pointer: object) -> int:
        pointer._obj.value = self.version  # type: ignore[attr-defined]  # a byref's target
        return self.status


def test_the_driver_version_comes_from_libcuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibcuda(12080))
    assert driver_cuda_version() == 12080
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibcuda(12080, status=3))
    assert driver_cuda_version() is None  # CUDA_ERROR_NOT_INITIALIZED: no answer

    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert driver_cuda_version() is None
