"""Every Triton kernel variant the runner can launch compiles for a Hopper GPU (sm_90) within an
H100's shared memory and without spilling registers, checked on a machine without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler, so a construct the compiler
rejects (a dot shape, a constexpr rule, a loop form), a tile that needs more shared memory than an
H100 block may use, or one that spills registers to local memory (a slow kernel, never a wrong
one) would pass every CPU test. Triton compiles ahead of time without a device: this module, run
as a script with TRITON_INTERPRET=0, calls the real launchers on CPU tensors standing in for CUDA
ones, records their launches instead of running them (kernel_launches), and compiles each
distinct variant exactly as `JITFunction.run` would on an H100: the same binder (so every integer
and pointer gets the specialization a real launch gives it), constexprs and options. Cases: the
head dims the families use (64, 128, 256) in fp16, bf16 and fp32, with a sliding window and a
softcap (Gemma2's layers: the most code), decode with one split and with several. The bundled
`cuobjdump -res-usage` reads each binary's registers and stack (STACK:0: no spills).
"""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

# Shared memory one block may use on sm_90 (227 KiB, opt-in maximum).
SM90_MAX_SHARED = 227 * 1024
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16", "float32")
# `<kernel> D=<head_dim> <dtype>: shared=<bytes> stack=<bytes> regs=<registers>`
LINE = re.compile(r"(\w+) D=(\d+) (\w+): shared=(\d+) stack=(\d+) regs=(\d+)")


def test_every_launchable_variant_compiles_for_sm90_without_spills():
    env = os.environ | {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [LINE.fullmatch(line) for line in done.stdout.splitlines()]
    assert all(rows), done.stdout
    cases = len(HEAD_DIMS) * len(DTYPES)
    # decode's split kernel twice per case: one split (writes the output) and several
    assert Counter(row[1] for row in rows if row) == {
        "_store_kv_kernel": cases, "_decode_split_kernel": 2 * cases,
        "_decode_merge_kernel": cases, "_prefill_kernel": cases}, done.stdout
    spilled = [row[0] for row in rows if row and int(row[5]) != 0]
    assert not spilled, "\n".join(spilled)
    too_big = [row[0] for row in rows if row and int(row[4]) > SM90_MAX_SHARED]
    assert not too_big, "\n".join(too_big)


def _launch_all(head_dim: int, dtype: object) -> None:
    """Launch store_kv, decode (one split, then two) and prefill once each: 2 KV heads with 4
    query heads each, a window and a softcap, on CPU tensors."""
    import torch

    from pagedkv.model_runner.kernels.paged_decode import paged_decode_attention_triton
    from pagedkv.model_runner.kernels.paged_prefill import paged_prefill_attention_triton
    from pagedkv.model_runner.kernels.store_kv import store_kv_triton

    assert isinstance(dtype, torch.dtype)
    pool = torch.zeros(8, 2, 2, 16, 2, head_dim, dtype=dtype)
    k_cache, v_cache = pool[:, 1].unbind(1)
    tables = torch.arange(8, dtype=torch.int32)[None]
    seq_lens = torch.tensor([128], dtype=torch.int32)
    store_kv_triton(torch.zeros(1, 2, head_dim, dtype=dtype), torch.zeros(1, 2, head_dim,
                    dtype=dtype), k_cache, v_cache, torch.tensor([0]))
    variants = {"sliding_window": 100, "softcap": 30.0}
    query = torch.zeros(4, 8, head_dim, dtype=dtype)
    for splits in (1, 2):
        paged_decode_attention_triton(query[:1], k_cache, v_cache, tables, seq_lens, 0.1,
                                      num_splits=splits, **variants)
    paged_prefill_attention_triton(query, k_cache, v_cache, tables, seq_lens,
                                   torch.tensor([0, 4], dtype=torch.int32), 0.1, **variants)


def _stack_and_registers(cubin: bytes, workdir: Path) -> tuple[int, int]:
    """(stack bytes per thread, registers per thread) of a one-kernel cubin."""
    import triton

    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True,
                           text=True, check=True).stdout
    stack = re.search(r"STACK:(\d+)", usage)
    registers = re.search(r"REG:(\d+)", usage)
    assert stack and registers, usage
    return int(stack[1]), int(registers[1])


def _compile_all() -> None:
    """Compile every variant the cases launch; print one LINE per variant."""
    import tempfile

    import pytest
    import torch

    from pagedkv.model_runner.kernels import paged_decode, paged_prefill, store_kv
    from pagedkv.model_runner.kernels.triton_env import is_interpreted

    sys.path.insert(0, str(Path(__file__).parents[2] / "support"))
    from kernel_launches import compile_launch, record_launches, variant_key

    assert not is_interpreted(store_kv._store_kv_kernel), "run with TRITON_INTERPRET=0"
    with pytest.MonkeyPatch.context() as monkeypatch, tempfile.TemporaryDirectory() as tmp:
        for module in (store_kv, paged_decode, paged_prefill):  # CPU tensors stand in for CUDA
            monkeypatch.setattr(module, "require_triton_device", lambda device, kernel: None)
        launches = record_launches(monkeypatch)
        for head_dim in HEAD_DIMS:
            for dtype in DTYPES:
                launches.clear()
                _launch_all(head_dim, getattr(torch, dtype))
                variants = {variant_key(launch): launch for launch in launches}
                for launch in variants.values():
                    kernel = compile_launch(launch)
                    stack, registers = _stack_and_registers(kernel.asm["cubin"], Path(tmp))
                    print(f"{launch.name} D={head_dim} {dtype}: shared={kernel.metadata.shared} "
                          f"stack={stack} regs={registers}", flush=True)


if __name__ == "__main__":
    _compile_all()
