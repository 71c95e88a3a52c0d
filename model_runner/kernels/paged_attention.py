"""Our paged kernels as a Hugging Face transformers attention implementation ("pagedkv").

    enable_paged_attention(model)          # registers "pagedkv" and switches the model to it
    model(input_ids, position_ids=..., paged_context=context, use_cache=False)

transformers computes Q/K/V and rotary embeddings and then calls the registered function once per
layer with whatever extra keyword arguments `model(...)` got; the step's batch data rides along
as one `PagedContext` (nano-vllm's Context, passed explicitly instead of as a global). The batch
is packed: all sequences' new tokens form one row ("batch" 1) with explicit `position_ids`, so
there is no padding. Per layer the function writes the new tokens' K/V into their pool slots,
then attends over each sequence's whole paged context: the decode kernel for the sequences that
bring one token (the runner packs them first), the prefill kernel (causal within the chunk) for
the others, both in the same layer call when decodes join a prefill. transformers builds
no mask for an implementation it does not know (`attention_mask` is None): causality is the
kernels', and so is the sliding window its masks would have applied, which the hook reads from
the config once per forward for every layer (`layer_windows`); a logit softcap comes as the
layer's `softcap` argument, as transformers' own attention functions get it. All layers' K/V
are written before any layer of a later step reads them, and within a layer every chunk is
written before any chunk attends, so chunks of one step may read each other's blocks (two
prompts sharing a prefix allocated in one batch).

A model whose attention the kernels cannot compute exactly (another layer type, bidirectional
attention, attention sinks) is refused by `enable_paged_attention`, before any
forward: running it anyway would produce silently wrong tokens.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from pagedkv.model_runner.kernels.attention_backend import AttentionBackend
from pagedkv.model_runner.kernels.per_forward import PerForward, shared

# The name under which transformers knows our attention.
ATTENTION_NAME = "pagedkv"
# The keyword argument of `model(...)` that carries the PagedContext.
CONTEXT_KWARG = "paged_context"
# Attention variants some models ask for that the kernels do not implement: refused, since
# ignoring them would compute silently wrong outputs (attention sinks).
UNSUPPORTED_KWARGS = ("s_aux",)
# `config.layer_types` entries the kernels implement, and the one that takes the sliding window.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
SLIDING_LAYER_TYPE = "sliding_attention"


@dataclass(frozen=True)
class PagedContext:
    """One step's batch, as the kernels want it; build it with `runner.build_context`.

    S sequences bring T new tokens in total, packed back to back in sequence order.
    """

    # The kernels that run (torch or Triton).
    backend: AttentionBackend
    # The pool: [num_blocks, num_layers, 2, block_size, H_kv, D]; layer l's K is pool[:, l, 0].
    pool: torch.Tensor
    # [T] int64: the slot each new token's K/V goes to; -1 writes nothing.
    slot_mapping: torch.Tensor
    # [S, max_blocks] int32: each sequence's block table, padded past its last block.
    block_tables: torch.Tensor
    # [S] int32: context length of each sequence, its new tokens included.
    seq_lens: torch.Tensor
    # [S + 1] int32: where each sequence's new tokens start in the packed batch.
    query_start_loc: torch.Tensor
    # The first `num_decodes` sequences bring one new token each and their tokens are the first
    # rows of the batch: the decode kernel computes them, the prefill kernel the others.
    num_decodes: int
    # The longest context among those sequences (0 without any), known on the host: it sizes
    # the decode kernel's split-K (no read-back of seq_lens).
    max_decode_len: int
    # The longest chunk among the other sequences, known on the host: it sizes the prefill
    # kernel's grid with no read-back (a CUDA graph captures no device-to-host sync); None reads
    # it back once per forward.
    max_q_len: int | None = None
    # What the attention of the first layer computes for every layer (gather indices, the
    # launch grid): one fresh dict per forward (per_forward.py).
    per_forward: PerForward = field(default_factory=dict)


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
    q, k, v = (_token_rows(x) for x in (query, key, value))
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{type(module).__name__} has no integer layer_idx to pick its cache")
    per_forward = context.per_forward
    window = _window_of_call(module, layer, kwargs.get("sliding_window"), per_forward)
    softcap = kwargs.get("softcap")
    k_cache, v_cache = (_layer_cache(context.pool, layer, kv) for kv in (0, 1))
    backend = context.backend
    backend.store_kv(k, v, k_cache, v_cache, context.slot_mapping, check_values=False,
                     per_forward=per_forward)
    decodes, outs = context.num_decodes, []
    tables, lens = context.block_tables, context.seq_lens
    if decodes:  # the first `decodes` rows and sequences: views, no copy
        outs.append(backend.paged_decode_attention(
            _rows(q, 0, decodes), k_cache, v_cache, _rows(tables, 0, decodes),
            _rows(lens, 0, decodes), scale, sliding_window=window, softcap=softcap,
            check_values=False, per_forward=per_forward, max_seq_len=context.max_decode_len))
    if decodes < lens.shape[0]:
        outs.append(backend.paged_prefill_attention(
            _rows(q, decodes), k_cache, v_cache, _rows(tables, decodes), _rows(lens, decodes),
            prefill_query_start_loc(context), scale, sliding_window=window, softcap=softcap,
            check_values=False, per_forward=per_forward, max_q_len=context.max_q_len))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(0), None


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D]: x[0].transpose(0, 1), a view still contiguous in D as the
    kernels require, in one aten op instead of two (each with a nested one): three a layer."""
    _, heads, tokens, head_dim = x.shape
    return x.as_strided((tokens, heads, head_dim), (x.stride(2), x.stride(1), x.stride(3)),
                        x.storage_offset())


def _rows(x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
    """x[start:stop], x itself (no aten op) when that is all of it: a decode step's batch."""
    if start == 0 and stop in (None, x.shape[0]):
        return x
    return x[start:stop]


def _layer_cache(pool: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
    """pool[:, layer, kv]: the layer's K (kv 0) or V (kv 1) cache, strided [num_blocks, B,
    H_kv, D], in one aten op instead of two selects (each with a nested one)."""
    strides = pool.stride()
    return pool.as_strided(pool.shape[:1] + pool.shape[3:], strides[:1] + strides[3:],
                           pool.storage_offset() + layer * strides[1] + kv * strides[2])


def prefill_query_start_loc(context: PagedContext) -> torch.Tensor:
    """[S - num_decodes + 1] int32: where each prefill sequence's tokens start among the rows
    past the decodes; computed on the device once per forward (per_forward), never read back."""
    decodes = context.num_decodes
    if not decodes:
        return context.query_start_loc
    return shared(context.per_forward, ("prefill_rows",),
                  lambda: context.query_start_loc[decodes:] - decodes)


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


def _window_of_call(module: nn.Module, layer: int, passed: object,
                    per_forward: PerForward) -> int | None:
    """The layer's sliding window from its config (every layer's read once per forward);
    ValueError if the window the layer passed (what transformers' flash-attention path would
    use) says otherwise."""
    config = getattr(module, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"{type(module).__name__} has no config to read its sliding window from")
    window = shared(per_forward, ("windows", id(config)), lambda: layer_windows(config))[layer]
    if passed is not None and passed != window:
        raise ValueError(f"layer {layer} of {config.model_type} was called with "
                         f"sliding_window={passed!r}, but its config gives {window!r}")
    return window


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """layer_sliding_window of every layer of a model with this config (or its text config)."""
    text_config = config.get_text_config()
    return tuple(layer_sliding_window(text_config, layer)
                 for layer in range(text_config.num_hidden_layers))


def layer_sliding_window(config: PretrainedConfig, layer: int) -> int | None:
    """The sliding window transformers' masks give `layer` of a model with this text config.

    With `config.layer_types` (Qwen2 and Qwen3 derive them from use_sliding_window and
    max_window_layers, Gemma2 alternates), a "sliding_attention" layer has config.sliding_window
    and a "full_attention" layer none. A family without layer types whose config class declares
    `sliding_window` (Mistral, Phi3) applies it to every layer (None: no window); other families
    never window, even if a config.json carries the key. ValueError for a layer type the kernels
    do not implement, or a sliding layer without a window.
    """
    family = config.model_type
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        declared = hasattr(type(config), "sliding_window")
        window = getattr(config, "sliding_window", None) if declared else None
    elif layer_types[layer] not in SUPPORTED_LAYER_TYPES:
        raise ValueError(f"{ATTENTION_NAME!r} attention cannot run {family}: layer {layer} is "
                         f"{layer_types[layer]!r}, the kernels implement {SUPPORTED_LAYER_TYPES}")
    elif layer_types[layer] == SLIDING_LAYER_TYPE:
        window = config.sliding_window
        if window is None:
            raise ValueError(f"{family} layer {layer} is {SLIDING_LAYER_TYPE!r} but the config "
                             "has no sliding_window")
    else:
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{family} has sliding_window={window!r}: expected an int >= 1 or None")
    return window


def check_supported(model: PreTrainedModel) -> None:
    """ValueError naming the family and the feature if the kernels cannot compute `model`'s
    attention exactly: another layer type (Llama 4's chunked attention, linear attention),
    bidirectional attention (Gemma 3 use_bidirectional_attention), attention sinks (gpt-oss)."""
    family = model.config.get_text_config().model_type
    layer_windows(model.config)
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "layer_idx", None), int):
            continue
        if getattr(module, "is_causal", True) is False:
            raise ValueError(f"{ATTENTION_NAME!r} attention cannot run {family}: {name} is "
                             "bidirectional, the kernels are causal")
        if getattr(module, "sinks", None) is not None:
            raise ValueError(f"{ATTENTION_NAME!r} attention cannot run {family}: {name} has "
                             "attention sinks, which the kernels do not implement")


def enable_paged_attention(model: PreTrainedModel) -> None:
    """Register "pagedkv" with transformers (idempotent) and make `model` use it; ValueError,
    with the model unchanged, if the kernels cannot compute its attention (check_supported)."""
    check_supported(model)
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
