"""Where Triton kernels can run, decided once, before any kernel is defined.

Triton compiles for CUDA. Without a CUDA device the only way to run a Triton kernel is its
interpreter (numpy, one program after another), which `@triton.jit` selects when it sees
``TRITON_INTERPRET=1`` at decoration time -- for our kernels and for triton.language's own jitted
helpers (tl.sum, tl.max, tl.cdiv), which are decorated when triton is first imported. The kernel
modules import `triton` and `tl` from here, so on a machine without CUDA the variable is set
before triton loads, provided nothing imported triton earlier (a transformers model class does:
import pagedkv.model_runner first, or set the variable yourself). A machine with CUDA is left
alone: its kernels compile for the device unless the caller asked for the interpreter, which
`require_triton_device` then refuses on CUDA tensors.

Every launcher starts its kernels through `launch`, inside the device context of the kernel's
tensors: Triton launches on the calling thread's current CUDA device, and the forward runs on a
worker thread that never chose one, so without it a pool on cuda:1 would get its kernels on
cuda:0 (an illegal address).
"""

import contextlib
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# These imports must follow the TRITON_INTERPRET decision above.
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["device_context", "interpreter_enabled", "is_interpreted", "launch",
           "require_triton_device", "tl", "triton"]


def interpreter_enabled() -> bool:
    """Whether kernels decorated now become interpreted (CPU) functions."""
    return bool(triton.knobs.runtime.interpret)


def is_interpreted(kernel: object) -> bool:
    """Whether `kernel` was decorated for the interpreter."""
    return isinstance(kernel, InterpretedFunction)


def require_triton_device(device: torch.device, kernel: object | None = None) -> None:
    """Raise ValueError unless Triton can run on tensors that live on `device`.

    `kernel`: the kernel about to run (whether it was decorated as interpreted is what counts);
    None asks about kernels decorated now.
    """
    interpreted = interpreter_enabled() if kernel is None else is_interpreted(kernel)
    if device.type == "cuda":
        if interpreted:
            raise ValueError(
                "Triton kernels are interpreted (TRITON_INTERPRET=1) but the tensors are on "
                f"{device}: every launch would copy the pool to the host and back; unset "
                "TRITON_INTERPRET before triton is imported to compile them for the GPU"
            )
        return
    if device.type != "cpu":
        raise ValueError(f"Triton kernels need CUDA (or CPU with TRITON_INTERPRET=1), got {device}")
    if not interpreted:
        raise ValueError(
            "Triton kernels run on CPU tensors only under the interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported, or use the torch attention backend on CPU"
        )
    if not is_interpreted(tl.cdiv):  # triton.language was loaded before the variable was set
        raise ValueError(
            "TRITON_INTERPRET=1 was set after triton was imported: set it before anything "
            "imports triton (import kernels.triton_env first), or use the torch "
            "backend on CPU"
        )


def device_context(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The context a launch on tensors on `device` runs in: that CUDA device made current (for
    this thread, restored on exit); nothing on the CPU."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def launch(kernel: Any, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """Run `kernel` over `grid` on the device of its tensor arguments (which the launcher's
    checks put on one device): how every launcher starts a kernel."""
    device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
    with device_context(device):
        kernel[grid](*args, **kwargs)
