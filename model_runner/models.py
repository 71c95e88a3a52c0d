"""Where the runner's model comes from, and the check that it fits the daemon's pool.

    model = load_model(ModelSource(path="/models/qwen2.5-0.5b"))          # local HF directory
    model = load_model(ModelSource(random_init="tiny-llama", seed=0))     # preset or config.json
    check_geometry(model, pool_info)   # refuses a model the pool is not laid out for

Nothing is ever downloaded: a path is read with `local_files_only`, and random-initialized models
are built from a config (a preset of pagedkv.vocab.geometry.PRESETS, or a config.json), seeded,
for demos and tests. The daemon plans its pool from the same config (`pagedkvd --model-config
PRESET_OR_PATH`), through the same table and the same config reader.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from pagedkv.client import PoolInfo
from pagedkv.memory.dtypes import torch_dtype
from pagedkv.vocab.geometry import (
    PRESETS,
    Preset,
    cache_dtype,
    geometry_from_config_fields,
    model_name,
)


def preset_config(preset: Preset) -> LlamaConfig:
    """The transformers config of a preset (pagedkv.vocab.geometry.PRESETS holds its sizes),
    with a vocabulary of 1000 and no special tokens."""
    return LlamaConfig(vocab_size=1000, hidden_size=preset.hidden_size,
                       intermediate_size=preset.intermediate_size,
                       num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
                       num_key_value_heads=preset.num_kv_heads,
                       max_position_embeddings=preset.max_positions,
                       initializer_range=0.2, dtype=preset.dtype, eos_token_id=None,
                       bos_token_id=None, pad_token_id=None)


class ModelMismatch(ValueError):
    """The model's KV geometry is not the pool's; the message names both."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the runner's model comes from: exactly one of `path` and `random_init`."""

    # A local Hugging Face model directory (config, safetensors weights, tokenizer).
    path: str | None = None
    # A preset name (PRESETS) or a config.json path, randomly initialized.
    random_init: str | None = None
    # Seed of the random initialization.
    seed: int = 0
    # The dtype to load the weights in ("float16", "bfloat16", "float32"); None: the config's.
    dtype: str | None = None
    # The KV cache's (vLLM's --kv-cache-dtype): "auto" (the weights' dtype) or "fp8"/"fp8_e4m3"
    # (e4m3, vocab/geometry.py's FP8_DTYPE); the daemon's format for the model must match it.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if (self.path is None) == (self.random_init is None):
            raise ValueError("give exactly one of --model PATH and --random-init CONFIG")
        cache_dtype("float16", self.kv_cache_dtype)  # ValueError naming the choices

    @property
    def name(self) -> str:
        return self.path or f"random-init:{self.random_init}"

    @property
    def pool_name(self) -> str:
        """The name the runner registers the model under by default: the one the daemon gives
        its own model when its model_config names the same preset or folder."""
        target = self.path or self.random_init
        assert target is not None
        return model_name(target)


def model_config(source: ModelSource) -> PretrainedConfig:
    """The model's config, read locally."""
    target = source.path or source.random_init
    assert target is not None
    if source.random_init in PRESETS:
        # A new one each time: a model owns its config (transformers writes the attention
        # choice into it).
        return preset_config(PRESETS[source.random_init])
    if not Path(target).exists():
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"no model at {target!r}: not a local path nor a preset ({known})")
    config: PretrainedConfig = AutoConfig.from_pretrained(target, local_files_only=True)
    return config


def load_model(source: ModelSource, device: str = "cpu") -> PreTrainedModel:
    """The model in eval mode on `device`, in `source.dtype`, else its config's dtype (float32
    when it names none)."""
    config = model_config(source)
    # A loaded config's dtype is a torch.dtype, a string, or None (float32 then).
    config_dtype = getattr(config.get_text_config(), "dtype", None) or "float32"
    dtype = torch_dtype(source.dtype or str(config_dtype))
    model: PreTrainedModel
    if source.path is not None:
        model = AutoModelForCausalLM.from_pretrained(source.path, local_files_only=True,
                                                     dtype=dtype)
    else:
        torch.manual_seed(source.seed)
        # transformers leaves from_config unannotated.
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=dtype)
    # nn.Module's own methods: transformers' wrappers of to() and eval() are untyped.
    torch.nn.Module.to(model, torch.device(device))
    torch.nn.Module.eval(model)
    return model


def kv_geometry(model: PreTrainedModel, kv_cache_dtype: str = "auto") -> tuple[int, int, int, str]:
    """(layers, KV heads, head dim, dtype name) the model's attention caches, in its own dtype
    or fp8 (`kv_cache_dtype`)."""
    # The fields as config.json holds them, read by the daemon's reader: one rule for both.
    fields = model.config.get_text_config().to_dict()
    dtype = cache_dtype(str(model.dtype).removeprefix("torch."), kv_cache_dtype)
    geometry = geometry_from_config_fields(fields, "of the runner's model", dtype)
    return (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
            geometry.default_dtype)


def check_geometry(model: PreTrainedModel, info: PoolInfo, kv_cache_dtype: str = "auto") -> None:
    """Refuse, before any step, a model whose K/V does not fit the pool's layout."""
    have = kv_geometry(model, kv_cache_dtype)
    pool = (info.num_layers, info.num_kv_heads, info.head_dim, info.dtype)
    if have != pool:
        names = ("layers", "KV heads", "head dim", "dtype")
        diff = ", ".join(f"{n}: model {a}, pool {b}" for n, a, b in zip(names, have, pool,
                                                                       strict=True) if a != b)
        weights = str(model.dtype).removeprefix("torch.")
        raise ModelMismatch(f"the model does not fit the daemon's pool ({diff}); start the "
                            f"daemon for this model (pagedkvd --model-config <its config> "
                            f"--dtype {weights} --kv-cache-dtype {kv_cache_dtype})")
