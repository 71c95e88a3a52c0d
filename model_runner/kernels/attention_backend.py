"""Which attention implementation runs: the Triton kernels or their vectorized torch twins.

Both implement the same three calls on one layer's paged cache (see store_kv, paged_decode,
paged_prefill for shapes). "auto" picks Triton on CUDA and torch elsewhere. Triton can be forced on
CPU only under Triton's interpreter (TRITON_INTERPRET=1, which triton_env sets on machines
without CUDA); it is exact but slow there, so the CPU default is torch. The interpreter is
refused on CUDA tensors, "auto" included: it would copy the pool to the host at every launch.
"""

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

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

BackendName = Literal["auto", "triton", "torch"]


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

    name: Literal["triton", "torch"]  # which implementation the calls below are
    store_kv: StoreKV  # write new tokens' K/V into their slots
    paged_decode_attention: PagedDecodeAttention  # one new query per sequence
    paged_prefill_attention: PagedPrefillAttention  # a causal chunk of new queries per sequence


TRITON_BACKEND = AttentionBackend(
    "triton", store_kv_triton, paged_decode_attention_triton, paged_prefill_attention_triton
)
TORCH_BACKEND = AttentionBackend(
    "torch", store_kv_torch, paged_decode_attention_torch, paged_prefill_attention_torch
)


def get_backend(name: BackendName = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend `name` for tensors on `device`; ValueError if it cannot run there."""
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TORCH_BACKEND
    if name in ("auto", "triton"):
        require_triton_device(device)  # refuses the interpreter on CUDA, and CPU without it
        return TRITON_BACKEND
    raise ValueError(f"unknown attention backend {name!r}: expected 'auto', 'triton' or 'torch'")
