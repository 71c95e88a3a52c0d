"""The capacity planner and the byte sizes it reads, checked against the seeds' worked examples."""

import re

import pytest

from pagedkv.daemon.memory.planner import main, plan
from pagedkv.vocab.geometry import BUILTIN_GEOMETRIES
from pagedkv.vocab.units import format_bytes, parse_bytes

from fixture_files import FIXTURES

GIB = 2**30


def figures(output: str) -> dict[str, tuple[int, str]]:
    """The `name: value unit` lines of the planner's output, as {name: (value, unit)}."""
    result = {}
    for line in output.splitlines():
        name, sep, rest = line.partition(": ")
        value, _, unit = rest.partition(" ")
        if sep and value.isdigit():
            result[name] = (int(value), unit)
    return result


def test_qwen_on_a_24gb_card_cli(capsys: pytest.CaptureFixture[str]) -> None:
    # Seed: 24 GB - 15.2 GB weights - 1 GB reserve = 7.8 GB (GB = 10^9) for KV;
    # 7.8e9 / 917,504 B per block = 8501 blocks; x 16 tokens = 136,016 (~136,000).
    rc = main(["--model", "qwen2.5-7b", "--device-memory", "24GB", "--weights-memory", "15.2GB",
               "--reserve", "1GB", "--block-size", "16", "--dtype", "float16"])
    assert rc == 0
    out = figures(capsys.readouterr().out)
    assert out["bytes_per_token"] == (57_344, "B")
    assert out["bytes_per_block"] == (917_504, "B")
    assert out["kv_budget"] == (7_800_000_000, "B")
    assert out["num_blocks"] == (8501, "blocks")
    assert out["token_capacity"] == (136_016, "tokens")
    # Defaults: seq_len 256 -> 16 blocks each; max_model_len 2048 -> 2048 x 57,344 B each.
    assert out["paged_seqs"] == (8501 // 16, "seqs")
    assert out["contiguous_seqs"] == (7_800_000_000 // (2048 * 57_344), "seqs")


def test_opt_13b_worked_example_8_contiguous_vs_71_paged() -> None:
    # The seed's arithmetic is binary throughout: 800 KB/token is 2x40x5120x2 = 819,200 B
    # = 800 KiB, a 2048-token slab "1600 MB" = 1600 MiB, and "14 GB" of KV budget = 14 GiB.
    # 14 GiB / 1600 MiB = 8.96 -> 8 contiguous sequences.
    # 14 GiB / 13,107,200 B per block = 1146 blocks; / ceil(256/16) = 16 -> 71 paged (71.6).
    # (Read decimally, 14e9 B would give 66 paged, not the seed's 71.)
    p = plan(BUILTIN_GEOMETRIES["opt-13b"], device_memory=40 * GIB, weights_memory=26 * GIB,
             reserve=0, block_size=16, dtype_bytes=2, seq_len=256, max_model_len=2048)
    assert p.bytes_per_token == 800 * 1024
    assert p.kv_budget == 14 * GIB
    assert p.max_model_len * p.bytes_per_token == 1600 * 2**20
    assert p.num_blocks == 1146
    assert p.blocks_per_seq == 16
    assert p.contiguous_seqs == 8
    assert p.paged_seqs == 71


def test_weights_estimated_from_parameter_count() -> None:
    # 7.62e9 parameters x 2 bytes = 15.24 GB, the seed's "~15.2 GB".
    p = plan(BUILTIN_GEOMETRIES["qwen2.5-7b"], device_memory=24 * 10**9, weights_memory=None,
             reserve=10**9, block_size=16, dtype_bytes=2, seq_len=256, max_model_len=2048)
    assert p.weights_memory == 15_240_000_000
    assert p.kv_budget == 7_760_000_000
    assert p.num_blocks == 7_760_000_000 // 917_504


def test_model_from_a_config_path(capsys: pytest.CaptureFixture[str]) -> None:
    # 3 layers x 2 KV heads x 64 in bf16 (the config's dtype): 2 x 3 x 2 x 64 x 2 = 1536 B/token.
    rc = main(["--model", str(FIXTURES / "qwen2-gqa"), "--device-memory", "1MiB",
               "--weights-memory", "0", "--block-size", "8", "--seq-len", "20",
               "--max-model-len", "64"])
    assert rc == 0
    out = figures(capsys.readouterr().out)
    assert out["bytes_per_token"] == (1536, "B")
    assert out["num_blocks"] == (2**20 // (8 * 1536), "blocks")  # 85
    assert out["paged_seqs"] == (85 // 3, "seqs")  # ceil(20 / 8) = 3 blocks each
    assert out["contiguous_seqs"] == (2**20 // (64 * 1536), "seqs")  # 10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "opt-13b", "--device-memory", "24GB"], "no memory left for the KV cache"),
        (["--model", "gpt-9", "--device-memory", "24GB"], "unknown model"),
        (["--model", "tiny", "--device-memory", "1GB"], "parameter count .* is unknown"),
        (["--model", "opt-13b", "--device-memory", "24 gigs"], "not a byte size"),
        (["--model", "opt-13b", "--device-memory", "80GB", "--dtype", "int4"], "unknown dtype"),
        (["--model", "opt-13b", "--device-memory", "80GB", "--block-size", "0"],
         "block_size must be positive"),
        (["--model", "opt-13b", "--device-memory", "80GB", "--seq-len", "4096"],
         "exceeds max_model_len"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "pagedkv plan: error:" in captured.err
    assert re.search(message, captured.err)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24_000_000_000), ("15.2GB", 15_200_000_000), ("1GiB", 2**30),
        ("512 MiB", 512 * 2**20), ("3kb", 3000), ("2KiB", 2048), ("7MB", 7_000_000),
        ("1TB", 10**12), ("1TiB", 2**40), ("1048576", 1_048_576), ("12B", 12), (" 0 ", 0),
        (4096, 4096),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "1.5", "1 gigabyte", "1e9", "0.3B", "1,5GB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        parse_bytes(text)
    with pytest.raises(ValueError, match="cannot be negative"):
        parse_bytes(-1)


def test_format_bytes() -> None:
    assert format_bytes(7_800_000_000) == "7.80 GB"
    assert format_bytes(917_504) == "917.50 KB"
    assert format_bytes(917_504, binary=True) == "896.00 KiB"
    assert format_bytes(512) == "512 B"
