"""The shape of a model's KV cache: how many bytes one token and one block of tokens take.

Every token caches one key and one value vector per KV head in every layer, so

    bytes_per_token = 2 x num_layers x num_kv_heads x head_dim x dtype_bytes
    bytes_per_block = bytes_per_token x block_size

(the leading 2 is K and V). A geometry comes from the built-in table of well-known models or
from a local Hugging Face `config.json`. This module must stay importable without torch (the
planner CLI uses it); torch is imported only by `torch_dtype`, transformers only by
`geometry_from_hf_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Canonical dtype name -> bytes per element. Names are torch's (`torch.float16` -> "float16").
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
# Short spellings people type on a command line -> canonical name.
_DTYPE_ALIASES: dict[str, str] = {"fp16": "float16", "half": "float16", "bf16": "bfloat16",
                                  "fp32": "float32", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """The canonical name of a dtype spelling ("fp16" -> "float16"); ValueError if unknown."""
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted([*DTYPE_BYTES, *_DTYPE_ALIASES]))
        raise ValueError(f"unknown dtype {name!r}; known: {known}")
    return key


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype given by any accepted spelling."""
    return DTYPE_BYTES[canonical_dtype(name)]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype spelling (imports torch, unlike the rest of this module)."""
    import torch

    dtype = getattr(torch, canonical_dtype(name))
    assert isinstance(dtype, torch.dtype), f"torch.{name} is not a dtype"
    return dtype


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The dimensions of a model that decide the size of its KV cache."""

    # Name shown to people: a table key or the config's path.
    name: str
    # Transformer layers; each caches its own K and V.
    num_layers: int
    # Key/value heads per layer (fewer than query heads under GQA/MQA).
    num_kv_heads: int
    # Elements per head vector.
    head_dim: int
    # Parameter count, to estimate the weights' memory; None when unknown (e.g. from a config).
    num_params: float | None
    # Canonical dtype name the model is usually served in ("float16", "bfloat16", "float32").
    default_dtype: str

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{field_name} must be positive in geometry {self.name!r}")
        canonical_dtype(self.default_dtype)

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """One physical block of `block_size` token slots, all layers, K and V."""
        return self.bytes_per_token(dtype_bytes) * block_size


# The geometry the CPU daemon and the demo run with when no model is named: small enough for
# the Triton interpreter and for tests, float32 because bf16 `tl.dot` is wrong in the interpreter.
TINY_CPU_GEOMETRY = ModelGeometry(name="tiny", num_layers=2, num_kv_heads=2, head_dim=64,
                                  num_params=None, default_dtype="float32")

# Published architecture facts of well-known models (their config.json files), keyed lowercase.
BUILTIN_GEOMETRIES: dict[str, ModelGeometry] = {
    g.name: g
    for g in (
        TINY_CPU_GEOMETRY,
        # The runner's --random-init presets of the same names (pagedkv.model_runner.models).
        ModelGeometry("tiny-llama", 2, 2, 32, None, "float32"),
        ModelGeometry("small-llama", 4, 4, 64, None, "float32"),
        ModelGeometry("llama-3.1-8b", 32, 8, 128, 8.03e9, "bfloat16"),
        ModelGeometry("qwen2.5-7b", 28, 4, 128, 7.62e9, "bfloat16"),
        # No GQA: 40 KV heads x 128 = the 5120 model dimension.
        ModelGeometry("opt-13b", 40, 40, 128, 12.9e9, "float16"),
        ModelGeometry("mistral-7b", 32, 8, 128, 7.24e9, "bfloat16"),
    )
}


def geometry_from_hf_config(path: str | Path) -> ModelGeometry:
    """Read a local Hugging Face config (a config.json file or its directory); never downloads.

    KV heads are `num_key_value_heads`, or `num_attention_heads` for models without GQA;
    head_dim is `head_dim` when the config sets it, else hidden_size // num_attention_heads.
    """
    from transformers import AutoConfig

    local = Path(path)
    if not local.exists():
        raise ValueError(f"no model config at {local}")
    try:
        config = AutoConfig.from_pretrained(str(local), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read a model config from {local}: {exc}") from exc
    # Multimodal configs nest the language model's config; text models return themselves.
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    # A config without a dtype loads (and random-initializes) in float32 in transformers.
    dtype = str(getattr(text, "dtype", None) or "float32").removeprefix("torch.")
    return ModelGeometry(name=str(local), num_layers=int(text.num_hidden_layers),
                         num_kv_heads=int(kv_heads), head_dim=int(head_dim),
                         num_params=None, default_dtype=canonical_dtype(dtype))


def resolve_geometry(name_or_path: str) -> ModelGeometry:
    """A built-in model by name (case-insensitive), else a local config path."""
    builtin = BUILTIN_GEOMETRIES.get(name_or_path.strip().lower())
    if builtin is not None:
        return builtin
    if Path(name_or_path).exists():
        return geometry_from_hf_config(name_or_path)
    known = ", ".join(sorted(BUILTIN_GEOMETRIES))
    raise ValueError(f"unknown model {name_or_path!r}: not a built-in ({known}) "
                     "nor a local config.json path")
