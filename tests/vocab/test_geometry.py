"""Model geometry: KV bytes per token/block, the built-in table, local HF configs, dtypes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.memory.dtypes import torch_dtype
from pagedkv.vocab.geometry import (
    BUILTIN_GEOMETRIES,
    TINY_CPU_GEOMETRY,
    ModelGeometry,
    canonical_dtype,
    dtype_bytes,
    geometry_from_hf_config,
    resolve_geometry,
)

from fixture_files import FIXTURES


def test_opt_13b_token_is_800_kib_in_fp16() -> None:
    # 2 (K and V) x 40 layers x 40 heads x 128 = 2 x 40 x 5120 elements of 2 bytes.
    opt = BUILTIN_GEOMETRIES["opt-13b"]
    assert opt.bytes_per_token(2) == 2 * 40 * 5120 * 2 == 819_200 == 800 * 1024


def test_qwen_block_matches_the_seed_formula() -> None:
    qwen = BUILTIN_GEOMETRIES["qwen2.5-7b"]
    assert qwen.bytes_per_block(16, 2) == 2 * 28 * 4 * 128 * 16 * 2 == 917_504


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head_dim", "params"),
    [
        ("llama-3.1-8b", 32, 8, 128, 8.03e9),
        ("qwen2.5-7b", 28, 4, 128, 7.62e9),
        ("opt-13b", 40, 40, 128, 12.9e9),
        ("mistral-7b", 32, 8, 128, 7.24e9),
    ],
)
def test_builtin_table_facts(name: str, layers: int, kv_heads: int, head_dim: int,
                             params: float) -> None:
    g = BUILTIN_GEOMETRIES[name]
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.num_params) == (
        layers, kv_heads, head_dim, params)


def test_tiny_cpu_default() -> None:
    assert resolve_geometry("tiny") is TINY_CPU_GEOMETRY
    assert TINY_CPU_GEOMETRY.bytes_per_token(4) == 2 * 2 * 2 * 64 * 4


def test_resolve_is_case_insensitive() -> None:
    assert resolve_geometry("  Qwen2.5-7B ") is BUILTIN_GEOMETRIES["qwen2.5-7b"]


def test_resolve_unknown_name_lists_the_table() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gpt-9'.*llama-3\.1-8b"):
        resolve_geometry("gpt-9")


def test_invalid_geometry_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_kv_heads must be positive"):
        ModelGeometry("broken", 2, 0, 64, None, "float16")
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelGeometry("broken", 2, 2, 64, None, "int3")


def test_config_with_gqa_and_derived_head_dim() -> None:
    # num_key_value_heads = 2; no head_dim, so hidden 256 / 4 heads = 64.
    g = geometry_from_hf_config(FIXTURES / "qwen2-gqa")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.default_dtype) == (3, 2, 64, "bfloat16")
    assert g.num_params is None


def test_config_file_without_kv_heads_falls_back_to_attention_heads() -> None:
    g = geometry_from_hf_config(FIXTURES / "opt-mha" / "config.json")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.default_dtype) == (2, 4, 64, "float16")


def test_config_head_dim_wins_over_hidden_size_ratio() -> None:
    # head_dim 32 is set explicitly though 256 / 4 = 64; no dtype: float32, as transformers
    # loads and random-initializes such a model (so the runner's model fits the pool).
    g = resolve_geometry(str(FIXTURES / "llama-head-dim"))
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.default_dtype) == (5, 1, 32, "float32")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (FIXTURES / "bad-json", "cannot read a model config"),
        (FIXTURES / "no-such-model", "no model config"),
        (FIXTURES, "cannot read a model config"),  # a directory without config.json
    ],
)
def test_bad_config_paths_raise_value_error(path: Path, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        geometry_from_hf_config(path)


@pytest.mark.parametrize(
    ("spelling", "canonical", "size"),
    [("fp16", "float16", 2), ("float16", "float16", 2), ("BF16", "bfloat16", 2),
     ("bfloat16", "bfloat16", 2), ("fp32", "float32", 4), ("torch.float32", "float32", 4)],
)
def test_dtype_spellings(spelling: str, canonical: str, size: int) -> None:
    assert canonical_dtype(spelling) == canonical
    assert dtype_bytes(spelling) == size
    assert torch_dtype(spelling).itemsize == size
    assert str(torch_dtype(spelling)) == f"torch.{canonical}"


def test_unknown_dtype() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'.*bf16"):
        dtype_bytes("int8")
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'.*bf16"):
        torch_dtype("int8")


def test_multimodal_config_is_read_from_its_text_config(tmp_path: Path) -> None:
    text = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
            "num_hidden_layers": 6, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text,
                                                      "vision_config": {"hidden_size": 64}}))
    g = geometry_from_hf_config(tmp_path)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.default_dtype) == (6, 2, 64, "bfloat16")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_size": 256, "num_attention_heads": 4}, "has no num_hidden_layers"),
        ({"num_attention_heads": 4, "num_hidden_layers": 2}, "has no hidden_size"),
        ({"hidden_size": 256, "num_attention_heads": 0, "num_hidden_layers": 2}, "malformed"),
        ({"hidden_size": "wide", "num_attention_heads": 4, "num_hidden_layers": 2}, "malformed"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_config_without_its_sizes_raises_value_error(tmp_path: Path, config: object,
                                                     message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        geometry_from_hf_config(tmp_path)


def test_geometry_and_planner_import_without_torch() -> None:
    code = ("import sys; import pagedkv.daemon.memory.planner, pagedkv.vocab.geometry, "
            "pagedkv.vocab.pool_sizing; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
