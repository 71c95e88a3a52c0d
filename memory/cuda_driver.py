"""Whether the NVIDIA driver can run the CUDA build of torch installed here: asked before the
daemon (its pool) or the runner (its model) opens a CUDA device.

    require_driver_for_torch()          # CudaDriverTooOld, with what to install, if it cannot
    why_no_cuda()                       # why torch sees no CUDA device, in one line (or None)

torch built for CUDA X.Y runs on a driver that supports CUDA X.0 or later: CUDA's minor
version compatibility lets a CUDA 12.8 build run on a CUDA 12.2 driver, never a CUDA 13.0 build
on a CUDA 12.8 one. Without this check torch only says that it sees no CUDA device. The
driver's version is cuDriverGetVersion's (libcuda.so.1, through ctypes: 12080 for 12.8); the
rule is `driver_too_old`, a pure function.
"""

import ctypes

import torch


class CudaDriverTooOld(RuntimeError):
    """The driver supports an older CUDA than the one torch was built for."""


def driver_cuda_version() -> int | None:
    """The newest CUDA the NVIDIA driver supports, as 1000 * major + 10 * minor (12080 for
    12.8); None without a driver (no libcuda.so.1) or when it does not answer."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:  # CUDA_SUCCESS is 0
        return None
    return version.value


def driver_version_text(version: int) -> str:
    """12080 -> "12.8"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_too_old(torch_version: str, torch_cuda: str | None,
                   driver_version: int | None) -> str | None:
    """Why a driver supporting CUDA `driver_version` (cuDriverGetVersion's number) cannot run
    torch `torch_version` built for CUDA `torch_cuda` ("13.0"); None when it can, or when
    either is unknown (a CPU or ROCm build, no driver: torch says so itself)."""
    if not torch_cuda or driver_version is None:
        return None
    built_major, driver_major = int(torch_cuda.split(".")[0]), driver_version // 1000
    if driver_major >= built_major:
        return None
    return (f"torch {torch_version} was built for CUDA {torch_cuda}, but the NVIDIA driver "
            f"supports CUDA up to {driver_version_text(driver_version)}: install a driver for "
            f"CUDA {built_major}.0 or newer, or a torch built for CUDA {driver_major}.x (PyTorch's "
            f"cu{driver_major}x wheels)")


def require_driver_for_torch() -> None:
    """CudaDriverTooOld unless the driver can run this torch's CUDA build (see the module)."""
    problem = driver_too_old(torch.__version__, torch.version.cuda, driver_cuda_version())
    if problem is not None:
        raise CudaDriverTooOld(problem)


def why_no_cuda() -> str | None:
    """Why torch cannot use a CUDA device here, in one line (a driver too old for the build
    named as such); None when it can."""
    driver = driver_cuda_version()
    too_old = driver_too_old(torch.__version__, torch.version.cuda, driver)
    if too_old is not None:  # asked first: torch would warn about it on stderr
        return too_old
    if torch.cuda.is_available():
        return None
    supports = "none" if driver is None else f"CUDA {driver_version_text(driver)}"
    return (f"torch sees no CUDA device (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda or 'none'}, driver: {supports})")
