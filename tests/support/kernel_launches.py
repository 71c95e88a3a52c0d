"""What the Triton launchers launch, recorded instead of run, and the compiled variant each launch
would use on an sm_90 GPU.

    launches = record_launches(monkeypatch)     # kernels record their launches, run nothing
    store_kv_triton(...)                        # -> launches[-1].kernel is _store_kv_kernel
    variant_key(launches[-1])                   # the key Triton's JIT caches its binary under

A kernel's `run` (what `kernel[grid](...)` calls, interpreted or compiled) is replaced for the
test, so a launcher that skips `triton_env.launch` is recorded all the same, with no device
context entered. `variant_key` runs Triton's own binder for the CUDA backend on the launch's real
arguments: the specialization a real launch gives every argument (an integer equal to 1 becomes a
constant, a multiple of 16 or a 16-byte aligned pointer gets an alignment hint, unless the kernel
marks it do_not_specialize), then the cache key `JITFunction.run` looks the binary up by. Two
launches with one key share one compiled kernel; a new key compiles (seconds) on first launch.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from pagedkv.model_runner.kernels import triton_env

# The GPU the variants are computed for: Hopper (H100/H200), warps of 32 threads.
SM90 = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as the launcher made it."""

    kernel: Any  # the @triton.jit function (interpreted or compiled)
    grid: tuple[int, ...]  # programs along each axis
    args: tuple[Any, ...]  # positional arguments: tensors, integers, floats
    kwargs: dict[str, Any]  # constexprs and launch options (num_warps, num_stages)
    # The device whose context was entered around the launch (triton_env.device_context);
    # None when the launch ran outside any.
    device: torch.device | None

    @property
    def name(self) -> str:
        """The kernel's function name."""
        return str(self.kernel.fn.__name__)

    def tensor_devices(self) -> set[torch.device]:
        """The devices of the launch's tensor arguments."""
        return {arg.device for arg in self.args if isinstance(arg, torch.Tensor)}


@dataclass
class _Recorder:
    launches: list[Launch] = field(default_factory=list)
    entered: list[torch.device] = field(default_factory=list)

    @contextlib.contextmanager
    def device_context(self, device: torch.device) -> Iterator[None]:
        self.entered.append(device)
        try:
            yield
        finally:
            self.entered.pop()

    def record(self, kernel: Any, grid: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        device = self.entered[-1] if self.entered else None
        self.launches.append(Launch(kernel, tuple(grid), args, kwargs, device))


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """From now on (for the test), every Triton kernel records its launches instead of running;
    returns the list they go to, in launch order."""
    recorder = _Recorder()

    def run(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorder.record(kernel, grid, args, kwargs)

    monkeypatch.setattr(triton_env, "device_context", recorder.device_context)
    for kernel_class in (InterpretedFunction, JITFunction):
        monkeypatch.setattr(kernel_class, "run", run)
    return recorder.launches


_BINDERS: dict[Any, Any] = {}


def variant_key(launch: Launch) -> str:
    """The key of the binary an sm_90 GPU would run `launch` with (see the module docstring)."""
    kernel = launch.kernel
    if kernel not in _BINDERS:
        jit = kernel
        if isinstance(kernel, InterpretedFunction):  # the same function and options, compiled
            jit = JITFunction(kernel.fn, **kernel.kwargs)
        _BINDERS[kernel] = create_function_from_signature(jit.signature, jit.params,
                                                          make_backend(SM90))
    _, specialization, options = _BINDERS[kernel](*launch.args, **launch.kwargs)
    return f"{launch.name}:{compute_cache_key({}, specialization, options)}"


def compile_launch(launch: Launch) -> Any:
    """The sm_90 binary of `launch`, compiled as `JITFunction.run` would on an H100 (the same
    binder, argument packing and options), without a GPU: Triton's compiler runs on the CPU.
    The kernel must be a compiled one (TRITON_INTERPRET=0)."""
    kernel = launch.kernel
    assert isinstance(kernel, JITFunction), "compile with TRITON_INTERPRET=0"
    backend = make_backend(SM90)
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=SM90, options=options.__dict__)
