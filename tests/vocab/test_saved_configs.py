"""The torch-free config reader reads every family from the folder transformers writes.

Each family's tiny model is built from its transformers config, saved with `save_pretrained`
(config.json as users' folders hold it: GPT-2, GPT-J and Bloom save `n_head`/`n_layer`/`n_embd`,
Falcon says its KV heads its own way), and the geometry read from that folder must equal the
shape of the K/V a real forward of the model caches: layers, KV heads and head_dim.
"""

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedkv.llm.model_ref import resolve_model
from pagedkv.vocab.geometry import geometry_from_hf_config

# Two layers of 2 KV heads where the family has GQA, distinct sizes otherwise, so a field read
# from the wrong key shows.
GQA = {"vocab_size": 64, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**GQA),
    "qwen2": Qwen2Config(**GQA),
    "qwen3": Qwen3Config(**GQA),
    "mistral": MistralConfig(**GQA),
    "gemma": GemmaConfig(**GQA),
    "gemma2": Gemma2Config(**GQA),
    "phi3": Phi3Config(pad_token_id=None, **{k: v for k, v in GQA.items() if k != "head_dim"}),
    "gpt2": GPT2Config(vocab_size=64, n_embd=48, n_layer=3, n_head=4, n_positions=64),
    "opt": OPTConfig(vocab_size=64, hidden_size=48, ffn_dim=64, num_hidden_layers=3,
                     num_attention_heads=4, word_embed_proj_dim=48),
    "gpt_neox": GPTNeoXConfig(vocab_size=64, hidden_size=48, intermediate_size=64,
                              num_hidden_layers=3, num_attention_heads=4),
    "gptj": GPTJConfig(vocab_size=64, n_embd=48, n_layer=3, n_head=4, rotary_dim=4,
                       n_positions=64),
    "bloom": BloomConfig(vocab_size=64, hidden_size=48, n_layer=3, n_head=4),
    # Falcon-7B's layout (one shared KV head), Falcon-40B's (grouped), and neither.
    "falcon-mqa": FalconConfig(vocab_size=64, hidden_size=48, num_hidden_layers=3,
                               num_attention_heads=4),
    "falcon-new": FalconConfig(vocab_size=64, hidden_size=48, num_hidden_layers=3,
                               num_attention_heads=4, num_kv_heads=2,
                               new_decoder_architecture=True),
    "falcon-mha": FalconConfig(vocab_size=64, hidden_size=48, num_hidden_layers=3,
                               num_attention_heads=4, multi_query=False),
}


def cached_kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of the K a forward of `model` caches."""
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
    keys = [layer.keys for layer in cache.layers]
    assert all(k.shape == keys[0].shape for k in keys)
    _, kv_heads, tokens, head_dim = keys[0].shape
    assert tokens == 3
    return len(keys), kv_heads, head_dim


@pytest.mark.parametrize("family", list(CONFIGS))
def test_geometry_of_a_saved_folder_is_the_shape_the_model_caches(
        family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]).eval()
    model.save_pretrained(tmp_path)
    geometry = geometry_from_hf_config(tmp_path)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == \
        cached_kv_shape(model)
    # LLM(model=DIR) reads the folder through the same reader (it failed here for GPT-2).
    assert geometry.default_dtype == resolve_model(str(tmp_path)).config_dtype() == "float32"


def test_a_missing_field_names_the_key_the_family_saves_it_under(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 8}')
    with pytest.raises(ValueError, match=r"has no num_attention_heads \(n_head\)"):
        geometry_from_hf_config(tmp_path)
