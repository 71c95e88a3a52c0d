"""What `LLM(model=...)` names: a local Hugging Face model directory, or a preset randomly
initialized for demos. Resolved and checked before any process starts; nothing is downloaded."""

from dataclasses import dataclass
from pathlib import Path

from pagedkv.vocab.geometry import (
    PRESETS,
    ModelGeometry,
    dtype_bytes,
    geometry_from_hf_config,
    max_positions_from_hf_config,
)

# Checkpoint files whose sizes add up to the weights' memory; safetensors when there are any
# (a folder may hold both formats of the same weights).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A model the embedded runner can load."""

    # The model as the caller named it: a directory or a preset name.
    name: str
    # The resolved local directory; None for a preset.
    path: Path | None

    def daemon_args(self) -> list[str]:
        """The daemon's flags that lay its pool out for this model."""
        config = self.name if self.path is None else str(self.path / "config.json")
        return ["--model-config", config]

    def runner_args(self, seed: int) -> list[str]:
        """The runner's flags that load this model."""
        if self.path is None:
            return ["--random-init", self.name, "--seed", str(seed)]
        return ["--model", str(self.path)]

    def config_dtype(self) -> str:
        """The dtype the config names (the checkpoint's, usually); float32 when it names none,
        as transformers loads it. A preset's is its table's."""
        if self.path is None:
            return PRESETS[self.name].dtype
        return geometry_from_hf_config(self.path).default_dtype

    def geometry(self) -> ModelGeometry:
        """The model's KV geometry (what one token's K and V take)."""
        if self.path is None:
            return PRESETS[self.name].geometry()
        return geometry_from_hf_config(self.path)

    def max_positions(self) -> int | None:
        """The positions the model takes (vLLM's max_model_len); None when its config names
        none."""
        if self.path is None:
            return PRESETS[self.name].max_positions
        return max_positions_from_hf_config(self.path)

    def check_max_model_len(self, max_model_len: int | None) -> None:
        """ValueError when `max_model_len` exceeds the positions the model takes."""
        positions = self.max_positions()
        if max_model_len is not None and positions is not None and max_model_len > positions:
            raise ValueError(f"max_model_len {max_model_len} exceeds the {positions} positions "
                             f"{self.name!r} takes (its max_position_embeddings)")

    def weights_bytes(self, dtype: str) -> int:
        """Memory of the weights loaded in `dtype`: the checkpoint files' size, scaled from the
        config's dtype. A preset's weights are small enough to count as none."""
        if self.path is None:
            return 0
        for pattern in WEIGHT_PATTERNS:
            files = sorted(self.path.glob(pattern))
            if files:
                stored = sum(file.stat().st_size for file in files)
                return stored * dtype_bytes(dtype) // dtype_bytes(self.config_dtype())
        return 0


def resolve_model(model: str) -> ModelRef:
    """The model `model` names (a local directory wins over a preset of the same name);
    ValueError naming what is wrong when it names none."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{model!r} has no config.json: not a Hugging Face model directory")
        return ModelRef(model, path.resolve())
    if model in PRESETS:
        return ModelRef(model, None)
    presets = ", ".join(sorted(PRESETS))
    raise ValueError(f"no model at {model!r}: not a local directory nor a preset ({presets}); "
                     "pagedkv never downloads a model")
