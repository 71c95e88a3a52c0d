"""Where the runner's model comes from, and the check that it fits the daemon's pool.

    model = load_model(ModelSource(path="/models/qwen2.5-0.5b"))          # local HF directory
    model = load_model(ModelSource(random_init="tiny-llama", seed=0))     # preset or config.json
    check_geometry(model, pool_info)   # refuses a model the pool is not laid out for

Nothing is ever downloaded: a path is read with `local_files_only`, and random-initialized models
are built from a config (a named preset below, or a config.json), seeded, for demos and tests.
The daemon plans its pool from the same config (`pagedkvd --model-config PRESET_OR_PATH`): the
presets' geometries are in the daemon's built-in table under the same names.
"""

import copy
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


def _tiny_llama(hidden: int, heads: int, kv_heads: int, layers: int,
                intermediate: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=4096,
                       initializer_range=0.2, dtype="float32", eos_token_id=None,
                       bos_token_id=None, pad_token_id=None)


# Named configs for --random-init. "tiny" matches the daemon's default pool (2 layers, 2 KV heads
# of 64, float32); "tiny-llama" is the benchmark's model (2 layers, hidden 128, 4 heads, 2 KV
# heads, intermediate 256, vocab 1000); "small-llama" is the overhead benchmark's (4 layers,
# hidden 1024).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": _tiny_llama(hidden=256, heads=4, kv_heads=2, layers=2, intermediate=512),
    "tiny-llama": _tiny_llama(hidden=128, heads=4, kv_heads=2, layers=2, intermediate=256),
    "small-llama": _tiny_llama(hidden=1024, heads=16, kv_heads=4, layers=4, intermediate=2816),
}


# The dtypes a model may be loaded in (the pool's: pagedkv.vocab.geometry.DTYPE_BYTES).
LOADABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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

    def __post_init__(self) -> None:
        if (self.path is None) == (self.random_init is None):
            raise ValueError("give exactly one of --model PATH and --random-init CONFIG")

    @property
    def name(self) -> str:
        return self.path or f"random-init:{self.random_init}"


def model_config(source: ModelSource) -> PretrainedConfig:
    """The model's config, read locally."""
    target = source.path or source.random_init
    assert target is not None
    if source.random_init in PRESETS:
        # A copy: a model owns its config (transformers writes the attention choice into it).
        return copy.deepcopy(PRESETS[source.random_init])
    if not Path(target).exists():
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"no model at {target!r}: not a local path nor a preset ({known})")
    config: PretrainedConfig = AutoConfig.from_pretrained(target, local_files_only=True)
    return config


def load_model(source: ModelSource, device: str = "cpu") -> PreTrainedModel:
    """The model in eval mode on `device`, in `source.dtype`, else its config's dtype (float32
    when it names none)."""
    config = model_config(source)
    dtype = torch_dtype(source.dtype or getattr(config.get_text_config(), "dtype", None))
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


def torch_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """A dtype named as configs and flags name it ("float16", "torch.bfloat16"); None is
    float32, transformers' default; ValueError for anything else."""
    if name is None:
        return torch.float32
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name.strip().removeprefix("torch."), None)
    if dtype not in LOADABLE_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: float16, bfloat16, float32")
    assert isinstance(dtype, torch.dtype)
    return dtype


def kv_geometry(model: PreTrainedModel) -> tuple[int, int, int, str]:
    """(layers, KV heads, head dim, dtype name) the model's attention caches."""
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return int(text.num_hidden_layers), kv_heads, head_dim, str(model.dtype).removeprefix("torch.")


def check_geometry(model: PreTrainedModel, info: PoolInfo) -> None:
    """Refuse, before any step, a model whose K/V does not fit the pool's layout."""
    have = kv_geometry(model)
    pool = (info.num_layers, info.num_kv_heads, info.head_dim, info.dtype)
    if have != pool:
        names = ("layers", "KV heads", "head dim", "dtype")
        diff = ", ".join(f"{n}: model {a}, pool {b}" for n, a, b in zip(names, have, pool,
                                                                       strict=True) if a != b)
        raise ModelMismatch(f"the model does not fit the daemon's pool ({diff}); start the "
                            f"daemon for this model (pagedkvd --model-config <its config> "
                            f"--dtype {have[3]})")
