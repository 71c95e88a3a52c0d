"""Backend selection, the interpreter switch, and one prefill-then-decode round on each backend.

Nothing here imports triton directly: pagedkv's triton_env must load it (after TRITON_INTERPRET).
"""

import os
import subprocess
import sys

import pytest
import torch

from pagedkv.model_runner.kernels.attention_backend import (
    CPU_BACKEND,
    TORCH_BACKEND,
    TRITON_BACKEND,
    get_backend,
)
from pagedkv.model_runner.kernels.store_kv import _store_kv_kernel
from pagedkv.model_runner.kernels.triton_env import is_interpreted, triton

from kernel_utils import (
    assert_close_to,
    make_paged_batch,
    oracle_attention,
    random_tokens,
    skip_unless_triton_runs_on,
)


def test_auto_picks_triton_on_cuda_the_c_kernels_on_cpu_and_torch_elsewhere(monkeypatch):
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)  # kernels compiled for CUDA
    assert get_backend("auto", "cuda") is TRITON_BACKEND
    assert get_backend("auto", torch.device("cuda", 1)) is TRITON_BACKEND
    assert get_backend("auto", "cpu") is CPU_BACKEND
    assert get_backend("auto", "meta") is TORCH_BACKEND
    assert get_backend("torch", "cuda") is TORCH_BACKEND


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    skip_unless_triton_runs_on("cpu")
    assert get_backend("triton", "cpu") is TRITON_BACKEND  # triton_env enabled it (no CUDA here)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")
    with pytest.raises(ValueError, match="need CUDA"):
        get_backend("triton", "meta")
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        get_backend("cuda", "cpu")  # type: ignore[arg-type]


def test_the_interpreter_is_refused_on_cuda_tensors(monkeypatch):
    # TRITON_INTERPRET=1 left on a GPU host: every launch would copy the pool to the host
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    for name in ("auto", "triton"):
        with pytest.raises(ValueError, match=r"interpreted \(TRITON_INTERPRET=1\).*cuda:1"):
            get_backend(name, torch.device("cuda", 1))  # type: ignore[arg-type]
    assert get_backend("torch", "cuda") is TORCH_BACKEND


def test_kernels_are_interpreted_without_cuda():
    interpreted = is_interpreted(_store_kv_kernel)
    assert interpreted == (os.environ.get("TRITON_INTERPRET") == "1")
    assert interpreted or torch.cuda.is_available()  # never compiled kernels without a GPU


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="with CUDA, triton_env leaves TRITON_INTERPRET unset")
def test_triton_imported_before_the_switch_is_a_clear_error():
    # triton.language's helpers (tl.sum, tl.max) were decorated as compiled functions, so the
    # interpreted kernels could not call them: the launcher must say why instead.
    script = (
        "import triton, torch\n"
        "from pagedkv.model_runner.kernels.store_kv import store_kv_triton\n"
        "cache = torch.zeros(2, 4, 1, 16)\n"
        "try:\n"
        "    store_kv_triton(cache[0, :1], cache[0, :1], cache, cache, torch.tensor([0]))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert "TRITON_INTERPRET=1 was set after triton was imported" in done.stdout


@pytest.mark.parametrize("backend", [TORCH_BACKEND, CPU_BACKEND, TRITON_BACKEND],
                         ids=lambda b: b.name)
def test_prefill_then_decode_round(backend):
    if backend is TRITON_BACKEND:
        skip_unless_triton_runs_on("cpu")
    # A 20-token prompt is written and attended, then one generated token is appended and decoded.
    batch = make_paged_batch([21], 8, 2, 32, torch.float32, "cpu")
    k_new, v_new = batch.k_cache.clone(), batch.v_cache.clone()
    keys = random_tokens(21, 2, 32, torch.float32, "cpu", seed=5)
    values = random_tokens(21, 2, 32, torch.float32, "cpu", seed=6)
    table = batch.block_tables[0].long()
    slots = table[torch.arange(21) // 8] * 8 + torch.arange(21) % 8
    query = random_tokens(21, 4, 32, torch.float32, "cpu")

    backend.store_kv(keys[:20], values[:20], batch.k_cache, batch.v_cache, slots[:20])
    prompt_lens = torch.tensor([20], dtype=torch.int32)
    prompt_out = backend.paged_prefill_attention(
        query[:20], batch.k_cache, batch.v_cache, batch.block_tables, prompt_lens,
        torch.tensor([0, 20], dtype=torch.int32), 0.2)
    backend.store_kv(keys[20:], values[20:], batch.k_cache, batch.v_cache, slots[20:])
    step_out = backend.paged_decode_attention(query[20:], batch.k_cache, batch.v_cache,
                                              batch.block_tables, batch.seq_lens, 0.2)

    k_new[table[torch.arange(21) // 8], torch.arange(21) % 8] = keys
    v_new[table[torch.arange(21) // 8], torch.arange(21) % 8] = values
    torch.testing.assert_close(batch.k_cache, k_new, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, v_new, atol=0, rtol=0, equal_nan=True)
    expected = oracle_attention(query, batch, [21], 0.2)  # causal: row j sees positions <= j
    assert_close_to(torch.cat([prompt_out, step_out]), expected, torch.float32)
