"""Where Triton kernels can run, decided once, before any kernel is defined.

Triton compiles for CUDA. Without a CUDA device the only way to run a Triton kernel is its
interpreter (numpy, one program after another), which `@triton.jit` selects when it sees
``TRITON_INTERPRET=1`` at decoration time. The kernel modules import `triton` and `tl` from here,
so on a machine without CUDA the variable is set before their kernels are decorated, whichever
module (a test, the model runner) happens to import them first. A machine with CUDA is left alone:
its kernels compile for the device unless the caller asked for the interpreter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# These imports must follow the TRITON_INTERPRET decision above.
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["require_triton_device", "tl", "triton"]


def require_triton_device(device: torch.device, kernel: object) -> None:
    """Raise ValueError unless `kernel` can run on tensors that live on `device`."""
    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type == "cuda" or (device.type == "cpu" and interpreted):
        return
    if device.type == "cpu":
        raise ValueError(
            "Triton kernels run on CPU tensors only under the interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported, or use the torch attention backend on CPU"
        )
    raise ValueError(f"Triton kernels need CUDA (or CPU with TRITON_INTERPRET=1), got {device}")
