"""The runner's models and the daemon's table agree: one preset table and one config reader.

The daemon lays its pool out from pagedkv.vocab.geometry (`--model-config NAME_OR_PATH`); the
runner builds its model from the same preset or config.json and reads the geometry of what it
loaded. If the two ever disagreed, `check_geometry` would refuse every model at start.
Models are built on the meta device: shapes without weights, instantly.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedkv.memory.dtypes import torch_dtype
from pagedkv.model_runner.models import ModelSource, kv_geometry, model_config
from pagedkv.vocab.geometry import PRESETS, ModelGeometry, resolve_geometry

from fixture_files import FIXTURES


def meta_model(source: ModelSource, dtype: str) -> PreTrainedModel:
    """The model `source` names, as load_model builds it, without allocating its weights."""
    with torch.device("meta"):
        # transformers leaves from_config unannotated.
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            model_config(source), dtype=torch_dtype(dtype))
    return model


def kv_of(geometry: ModelGeometry) -> tuple[int, int, int, str]:
    return (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
            geometry.default_dtype)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_the_runner_builds_has_the_daemons_geometry(name: str) -> None:
    daemon = resolve_geometry(name)
    model = meta_model(ModelSource(random_init=name), daemon.default_dtype)
    assert kv_geometry(model) == kv_of(daemon)
    text = model.config.get_text_config()
    assert text.num_attention_heads * daemon.head_dim == text.hidden_size


@pytest.mark.parametrize("fixture", ["qwen2-gqa", "opt-mha", "llama-head-dim"])
def test_runner_reads_a_config_as_the_daemon_does(fixture: str) -> None:
    daemon = resolve_geometry(str(FIXTURES / fixture))
    model = meta_model(ModelSource(random_init=str(FIXTURES / fixture)), daemon.default_dtype)
    assert kv_geometry(model) == kv_of(daemon)


def test_runner_geometry_is_in_the_dtype_the_model_is_loaded_in() -> None:
    model = meta_model(ModelSource(random_init="tiny-llama"), "bf16")
    assert kv_geometry(model)[3] == "bfloat16"
