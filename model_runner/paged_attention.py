"""Our paged kernels as a Hugging Face transformers attention implementation ("pagedkv").

    enable_paged_attention(model)          # registers "pagedkv" and switches the model to it
    model(input_ids, position_ids=..., paged_context=context, use_cache=False)

transformers computes Q/K/V and rotary embeddings and then calls the registered function once per
layer with whatever extra keyword arguments `model(...)` got; the step's batch data rides along
as one `PagedContext` (nano-vllm's Context, passed explicitly instead of as a global). The batch
is packed: all sequences' new tokens form one row ("batch" 1) with explicit `position_ids`, so
there is no padding. Per layer the function writes the new tokens' K/V into their pool slots,
then attends over each sequence's whole paged context: the prefill kernel (causal within the
chunk) or, when every sequence brings exactly one token, the decode kernel. transformers builds
no mask for an implementation it does not know (`attention_mask` is None): causality is the
kernels'. All layers' K/V are written before any layer of a later step reads them, and within a
layer every chunk is written before any chunk attends, so chunks of one step may read each
other's blocks (two prompts sharing a prefix allocated in one batch).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from .attention_backend import AttentionBackend

# The name under which transformers knows our attention.
ATTENTION_NAME = "pagedkv"
# The keyword argument of `model(...)` that carries the PagedContext.
CONTEXT_KWARG = "paged_context"
# Attention variants some models ask for that the kernels do not implement: refused, since
# ignoring them would compute silently wrong outputs (a sliding window, logit soft-capping,
# attention sinks).
UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux")


@dataclass(frozen=True)
class PagedContext:
    """One step's batch, as the kernels want it; build it with `runner.build_context`.

    S sequences bring T new tokens in total, packed back to back in sequence order.
    """

    # The kernels that run (torch or Triton).
    backend: AttentionBackend
    # The pool: [num_layers, 2, num_blocks, block_size, H_kv, D]; layer l's K is pool[l, 0].
    pool: torch.Tensor
    # [T] int64: the slot each new token's K/V goes to; -1 writes nothing.
    slot_mapping: torch.Tensor
    # [S, max_blocks] int32: each sequence's block table, padded past its last block.
    block_tables: torch.Tensor
    # [S] int32: context length of each sequence, its new tokens included.
    seq_lens: torch.Tensor
    # [S + 1] int32: where each sequence's new tokens start in the packed batch.
    query_start_loc: torch.Tensor
    # Every sequence brings exactly one token (T == S): the decode kernel runs.
    is_decode: bool


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The "pagedkv" attention of one layer; query [1, H_q, T, D], key/value [1, H_kv, T, D].

    Returns [1, T, H_q, D] (what transformers reshapes into the output projection) and no
    attention weights. The values were validated when the context was built, so the kernels
    skip their value checks (no device-to-host reads per layer).
    """
    context = _context_of_call(query, attention_mask, dropout, kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # [1, H, T, D] -> [T, H, D]: a view, still contiguous in D as the kernels require.
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{type(module).__name__} has no integer layer_idx to pick its cache")
    k_cache, v_cache = context.pool[layer].unbind(0)
    backend = context.backend
    backend.store_kv(k, v, k_cache, v_cache, context.slot_mapping, check_values=False)
    if context.is_decode:
        out = backend.paged_decode_attention(q, k_cache, v_cache, context.block_tables,
                                             context.seq_lens, scale, check_values=False)
    else:
        out = backend.paged_prefill_attention(q, k_cache, v_cache, context.block_tables,
                                              context.seq_lens, context.query_start_loc, scale,
                                              check_values=False)
    return out.unsqueeze(0), None


def _context_of_call(query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
                     kwargs: dict[str, Any]) -> PagedContext:
    """The call's PagedContext; ValueError for a call the kernels cannot serve exactly."""
    context = kwargs.get(CONTEXT_KWARG)
    if not isinstance(context, PagedContext):
        raise ValueError(f"the {ATTENTION_NAME!r} attention needs `{CONTEXT_KWARG}=PagedContext` "
                         "in the model call: run the model through ModelRunner")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME!r} attention takes one packed row of tokens, "
                         f"got a batch of {query.shape[0]}")
    if attention_mask is not None or dropout != 0.0:
        raise ValueError(f"{ATTENTION_NAME!r} attention is causal over the block tables: "
                         "it takes no attention mask and no dropout")
    unsupported = [name for name in UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"{ATTENTION_NAME!r} attention does not implement {unsupported}")
    return context


def enable_paged_attention(model: PreTrainedModel) -> None:
    """Register "pagedkv" with transformers (idempotent) and make `model` use it."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
