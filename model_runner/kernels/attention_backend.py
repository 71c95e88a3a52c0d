"""Which attention implementation runs: the Triton kernels, the CPU's C kernels, or their
vectorized torch twins.

All three implement the same three calls on one layer's paged cache (see store_kv, paged_decode,
paged_prefill for shapes). "auto" picks Triton on CUDA, "cpu" on CPU tensors and torch elsewhere.
"cpu" runs all three in C (cpu_paged: in place in the pool, no per-forward plan). "torch" stays
selectable everywhere: it is the reference both the Triton and the C kernels are tested against.
Triton can be forced on CPU only under Triton's interpreter (TRITON_INTERPRET=1, which
triton_env sets on machines without CUDA); it is exact but slow there. The interpreter is
refused on CUDA tensors, "auto" included: it would copy the pool to the host at every launch.
"""

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from pagedkv.model_runner.kernels.cpu_paged import (
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    store_kv_cpu,
)
from pagedkv.model_runner.kernels.paged_decode import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from pagedkv.model_runner.kernels.paged_prefill import (
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)
from pagedkv.model_runner.kernels.per_forward import PerForward
from pagedkv.model_runner.kernels.store_kv import store_kv_torch, store_kv_triton
from pagedkv.model_runner.kernels.triton_env import require_triton_device

BackendName = Literal["auto", "triton", "cpu", "torch"]


class StoreKV(Protocol):
    def __call__(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                 check_values: bool = True, per_forward: PerForward | None = None) -> None: ...


class PagedDecodeAttention(Protocol):
    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 num_splits: int | None = None, *, sliding_window: int | None = None,
                 softcap: float | None = None, check_values: bool = True,
                 per_forward: PerForward | None = None,
                 max_seq_len: int | None = None) -> torch.Tensor: ...


class PagedPrefillAttention(Protocol):
    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float, *,
                 sliding_window: int | None = None, softcap: float | None = None,
                 check_values: bool = True, per_forward: PerForward | None = None,
                 max_q_len: int | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionBackend:
    """The three paged-attention calls of one implementation."""

    name: Literal["triton", "cpu", "torch"]  # which implementation the calls below are
    store_kv: StoreKV  # write new tokens' K/V into their slots
    paged_decode_attention: PagedDecodeAttention  # one new query per sequence
    paged_prefill_attention: PagedPrefillAttention  # a causal chunk of new queries per sequence


TRITON_BACKEND = AttentionBackend(
    "triton", store_kv_triton, paged_decode_attention_triton, paged_prefill_attention_triton
)
CPU_BACKEND = AttentionBackend(
    "cpu", store_kv_cpu, paged_decode_attention_cpu, paged_prefill_attention_cpu
)
TORCH_BACKEND = AttentionBackend(
    "torch", store_kv_torch, paged_decode_attention_torch, paged_prefill_attention_torch
)


def get_backend(name: BackendName = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend `name` for tensors on `device`: "auto" is "triton" on CUDA, "cpu" on the CPU
    and "torch" elsewhere; ValueError if the backend cannot run there ("cpu" off the CPU,
    "triton" without CUDA or the interpreter)."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if device.type == "cpu" else "torch"
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU tensors, not {device}: "
                             "use 'auto', 'triton' or 'torch'")
        return CPU_BACKEND
    if name == "triton":
        require_triton_device(device)  # refuses the interpreter on CUDA, and CPU without it
        return TRITON_BACKEND
    raise ValueError(f"unknown attention backend {name!r}: expected 'auto', 'triton', 'cpu' "
                     "or 'torch'")
