"""The model a test's runner process serves, and the same model built in the test's process.

The daemon plans its pool from a config.json and the runner random-initializes that config
with seed 0, so `reference_model` is the identical model, and transformers' greedy `generate`
on it gives the tokens the runner must give.

    @pytest.fixture(scope="module")
    def config_path(tmp_path_factory): return write_config(TINY, tmp_path_factory)
"""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel

from pagedkv.model_runner.models import ModelSource, load_model

# Random weights with initializer_range=0.2 (0.02 hides position bugs); no EOS, so every
# sequence generates exactly what it asks.
TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                   pad_token_id=None)


def write_config(config: PretrainedConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`config` saved in a fresh folder: the path of its config.json."""
    folder = tmp_path_factory.mktemp("model")
    config.save_pretrained(folder)
    return folder / "config.json"


def reference_model(config_path: Path, attention: str | None = None) -> PreTrainedModel:
    """The runner's model, built the same way in this process (`attention`: transformers'
    implementation to use, else its default)."""
    model = load_model(ModelSource(random_init=str(config_path), seed=0))
    if attention is not None:
        model.set_attn_implementation(attention)
    return model


def hf_greedy(reference: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `prompt`."""
    output = reference.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)
    return list(output[0, len(prompt):].tolist())
