"""The shape of a model's KV cache: how many bytes one token and one block of tokens take.

Every token caches one key and one value vector per KV head in every layer, so

    bytes_per_token = 2 x num_layers x num_kv_heads x head_dim x dtype_bytes
    bytes_per_block = bytes_per_token x block_size

(the leading 2 is K and V). A geometry comes from the one table below (well-known models and
the small presets the runner random-initializes) or from a local Hugging Face `config.json`,
read here as plain JSON by the one reader of such configs (the runner reads its loaded model's
config through it too). Torch-free, transformers-free: the planner, the daemon's config and
`LLM` use it on machines without either.
"""

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Canonical dtype name -> bytes per element. Names are torch's (`torch.float16` -> "float16");
# pagedkv.memory.dtypes maps them to torch dtypes. float8_e4m3fn (fp8 e4m3) is a KV cache's
# only (`cache_dtype`): weights load in MODEL_DTYPES.
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
# The dtypes a model's weights (and an "auto" cache) come in.
MODEL_DTYPES = ("float16", "bfloat16", "float32")
# The fp8 KV cache's element: e4m3 ("fn": finite, no inf, +-448 the largest), stored with a
# per-tensor scale of 1.0 (vLLM's default k_scale/v_scale): no scale lives in the pool, so an
# fp8 block is exactly half an fp16 block and means the same to every runner of its model.
FP8_DTYPE = "float8_e4m3fn"
# vLLM's --kv-cache-dtype choices: the model's dtype, or fp8 (e4m3; fp8_e4m3 says it twice).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Short spellings people type on a command line -> canonical name.
_DTYPE_ALIASES: dict[str, str] = {"fp16": "float16", "half": "float16", "bf16": "bfloat16",
                                  "fp32": "float32", "float": "float32", "fp8": FP8_DTYPE,
                                  "fp8_e4m3": FP8_DTYPE}


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


def model_dtype(name: str) -> str:
    """The canonical name of a dtype weights load in; ValueError for fp8 (a cache's only:
    `cache_dtype`) or an unknown one."""
    canonical = canonical_dtype(name)
    if canonical not in MODEL_DTYPES:
        raise ValueError(f"dtype {name!r} is a KV cache's only: give kv_cache_dtype fp8 and a "
                         f"model dtype of {', '.join(MODEL_DTYPES)}")
    return canonical


def cache_dtype(model_dtype_name: str, kv_cache_dtype: str = "auto") -> str:
    """The canonical dtype a model's KV cache is stored in: its model's under "auto", fp8
    e4m3 under "fp8" or "fp8_e4m3" (vLLM's --kv-cache-dtype); ValueError naming the choices."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return model_dtype(model_dtype_name) if kv_cache_dtype == "auto" else FP8_DTYPE


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The dimensions of a model that decide the size of its KV cache."""

    # Name shown to people and the model's name in a pool: a table key, or the basename of the
    # config's model folder (`model_name`).
    name: str
    # Transformer layers; each caches its own K and V.
    num_layers: int
    # Key/value heads per layer (fewer than query heads under GQA/MQA).
    num_kv_heads: int
    # Elements per head vector.
    head_dim: int
    # Parameter count, to estimate the weights' memory; None when unknown (e.g. from a config).
    num_params: float | None
    # Canonical dtype name the model is usually served in ("float16", "bfloat16", "float32"),
    # or its KV cache's under kv_cache_dtype fp8 (geometry_from_config_fields' dtype).
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


@dataclass(frozen=True, slots=True)
class Preset:
    """A small Llama for demos, tests and benchmarks: the runner random-initializes it
    (`--random-init NAME`), the daemon lays its pool out for it (`--model-config NAME`)."""

    # Name on both command lines.
    name: str
    # Transformer layers.
    num_layers: int
    # Query heads per layer.
    num_heads: int
    # Key/value heads per layer (GQA when fewer than num_heads).
    num_kv_heads: int
    # Model dimension; a head is hidden_size // num_heads wide.
    hidden_size: int
    # Width of the MLP.
    intermediate_size: int
    # Weights' and pool's dtype: float32, because bf16 `tl.dot` is wrong in the Triton
    # interpreter the CPU runs kernels in.
    dtype: str = "float32"
    # Positions the model takes (its config's max_position_embeddings: vLLM's max_model_len).
    max_positions: int = 4096

    def geometry(self) -> ModelGeometry:
        """The KV geometry of this preset."""
        return ModelGeometry(self.name, self.num_layers, self.num_kv_heads,
                             self.hidden_size // self.num_heads, None, self.dtype)


# The presets, by name. "tiny" is the daemon's default pool (2 layers, 2 KV heads of 64);
# "tiny-llama" the benchmark's model; "small-llama" the overhead benchmark's.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", num_layers=2, num_heads=4, num_kv_heads=2, hidden_size=256,
               intermediate_size=512),
        Preset("tiny-llama", num_layers=2, num_heads=4, num_kv_heads=2, hidden_size=128,
               intermediate_size=256),
        Preset("small-llama", num_layers=4, num_heads=16, num_kv_heads=4, hidden_size=1024,
               intermediate_size=2816),
    )
}

# Every model known by name, keyed lowercase: the presets, then published architecture facts
# of well-known models (their config.json files).
BUILTIN_GEOMETRIES: dict[str, ModelGeometry] = {
    **{name: preset.geometry() for name, preset in PRESETS.items()},
    **{
        g.name: g
        for g in (
            ModelGeometry("llama-3.1-8b", 32, 8, 128, 8.03e9, "bfloat16"),
            ModelGeometry("qwen2.5-7b", 28, 4, 128, 7.62e9, "bfloat16"),
            # No GQA: 40 KV heads x 128 = the 5120 model dimension.
            ModelGeometry("opt-13b", 40, 40, 128, 12.9e9, "float16"),
            ModelGeometry("mistral-7b", 32, 8, 128, 7.24e9, "bfloat16"),
        )
    },
}

# The geometry the CPU daemon and the demo run with when no model is named.
TINY_CPU_GEOMETRY = BUILTIN_GEOMETRIES["tiny"]


def _config_dtype(text: Mapping[str, Any]) -> str:
    """The canonical dtype a Hugging Face text config names (`dtype`, or the older
    `torch_dtype`); float32 when it names none, as transformers loads such a model."""
    return canonical_dtype(str(text.get("dtype") or text.get("torch_dtype") or "float32"))


# Families whose config.json stores a shape field under another key (their config class's
# `attribute_map` in transformers): GPT-2 saves `n_head` where Llama saves num_attention_heads.
_GPT2_KEYS = {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
              "hidden_size": "n_embd", "max_position_embeddings": "n_positions"}
_STORED_AS: dict[str, dict[str, str]] = {
    "gpt2": _GPT2_KEYS,
    "gptj": _GPT2_KEYS,
    "codegen": _GPT2_KEYS,
    "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
    "gpt_neo": {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"},
}


def _stored_key(text: Mapping[str, Any], key: str) -> str:
    """The key under which a config of this family saves the shape field `key`."""
    return _STORED_AS.get(str(text.get("model_type", "")), {}).get(key, key)


def _shape_field(text: Mapping[str, Any], key: str) -> Any:
    """A shape field of a config as saved: under the key its family stores it as."""
    value = text.get(_stored_key(text, key))
    return text.get(key) if value is None else value


def _kv_heads(text: Mapping[str, Any], heads: int) -> int:
    """KV heads per layer: `num_key_value_heads`, else one per query head (no GQA). Falcon says
    it its own way: one shared KV head under multi_query (its default), `num_kv_heads` under the
    new decoder architecture or without multi_query."""
    if text.get("model_type") == "falcon":
        if text.get("multi_query", True) and not text.get("new_decoder_architecture", False):
            return 1
        return int(text.get("num_kv_heads") or heads)
    return int(_shape_field(text, "num_key_value_heads") or heads)


def geometry_from_config_fields(text: Mapping[str, Any], name: str,
                                dtype: str) -> ModelGeometry:
    """The geometry of a Hugging Face text config's fields (as config.json holds them), served
    in `dtype`.

    KV heads: _kv_heads; head_dim is `head_dim` when the config sets it, else
    hidden_size // num_attention_heads; keys follow the family's _STORED_AS.
    """
    try:
        heads = int(_required(text, "num_attention_heads"))
        kv_heads = _kv_heads(text, heads)
        head_dim = int(_shape_field(text, "head_dim")
                       or int(_required(text, "hidden_size")) // heads)
        layers = int(_required(text, "num_hidden_layers"))
    except KeyError as exc:
        raise ValueError(f"model config {name} has no {exc.args[0]}") from exc
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"model config {name} has a malformed size: {exc}") from exc
    return ModelGeometry(name=name, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                         num_params=None, default_dtype=canonical_dtype(dtype))


def _required(text: Mapping[str, Any], key: str) -> Any:
    """A shape field the geometry cannot do without; KeyError naming it (and the key its family
    saves it under) when the config lacks it."""
    value = _shape_field(text, key)
    if value is None:
        stored = _stored_key(text, key)
        raise KeyError(key if stored == key else f"{key} ({stored})")
    return value


def _read_text_config(path: str | Path) -> dict[str, Any]:
    """The text model's fields of a local Hugging Face config (a config.json file or its
    directory); ValueError when there is none or it is not JSON. Never downloads."""
    local = Path(path)
    if not local.exists():
        raise ValueError(f"no model config at {local}")
    file = local / "config.json" if local.is_dir() else local
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a model config from {local}: {exc}") from exc
    # Multimodal configs nest the language model's config; text models are their own.
    text = config.get("text_config", config) if isinstance(config, dict) else None
    if not isinstance(text, dict):
        raise ValueError(f"cannot read a model config from {local}: not a JSON object")
    return text


def geometry_from_hf_config(path: str | Path) -> ModelGeometry:
    """The geometry of a local Hugging Face config, in the dtype it names, named after its
    model folder (`model_name`)."""
    text = _read_text_config(path)
    geometry = geometry_from_config_fields(text, str(Path(path)), _config_dtype(text))
    return dataclasses.replace(geometry, name=model_name(str(path)))


def max_positions_from_hf_config(path: str | Path) -> int | None:
    """The positions a local Hugging Face config's model takes (max_position_embeddings, GPT-2's
    n_positions), or None when it names none (a model without learned positions, e.g. ALiBi)."""
    value = _shape_field(_read_text_config(path), "max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def model_name(name_or_path: str) -> str:
    """The name a model goes by in a pool when none is given (kvpool.proto's "Models and
    pages"): a built-in's own name, else the basename of a local model folder (a config.json's
    folder). The daemon names its own model so from its model_config, and a runner its model
    from --model or --random-init, so one model named both ways gets one name."""
    builtin = BUILTIN_GEOMETRIES.get(name_or_path.strip().lower())
    if builtin is not None:
        return builtin.name
    path = Path(name_or_path).absolute()
    return path.parent.name if path.suffix == ".json" else path.name


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
