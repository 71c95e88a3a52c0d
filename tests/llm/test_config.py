"""LLMConfig, the one set of engine settings `LLM(...)`, `pagedkv generate` and `pagedkv serve`
take: both commands declare every flag of it (one declaration, vLLM's names), a flag given is
the field, and the settings of started services are refused with a running daemon. Nothing is
started here."""

import argparse

import pytest

from pagedkv.llm import cli as generate_cli
from pagedkv.llm.config import CLI_FLAGS, STARTED_ONLY, LLMConfig
from pagedkv.llm.model_ref import resolve_model
from pagedkv.server import cli as serve_cli

# A value per flag (a flag's text as typed), and the field it gives.
FLAG_VALUES: dict[str, tuple[list[str], object]] = {
    "model": (["tiny-llama"], "tiny-llama"),
    "tokenizer": (["/models/tok"], "/models/tok"),
    "dtype": (["bf16"], "bfloat16"),
    "kv_cache_dtype": (["fp8"], "fp8"),
    "device": (["cpu"], "cpu"),
    "max_model_len": (["256"], 256),
    "block_size": (["32"], 32),
    "gpu_memory_utilization": (["0.5"], 0.5),
    "kv_cache_memory": (["2MiB"], "2MiB"),
    "num_blocks": (["64"], 64),
    "max_num_seqs": (["8"], 8),
    "max_num_batched_tokens": (["512"], 512),
    "enable_prefix_caching": ([], True),
    "host_tier_memory": (["1MiB"], "1MiB"),
    "swap": (["never"], "never"),
    "seed": (["7"], 7),
    "daemon": (["unix:///d.sock"], "unix:///d.sock"),
    "runner": (["unix:///r.sock"], "unix:///r.sock"),
}
# Flags that cannot go together in one config: a running daemon, and the pool in blocks.
APART = {"daemon", "runner", "num_blocks"}


def argv_of(names: list[str]) -> list[str]:
    return [word for name in names
            for word in (f"--{name.replace('_', '-')}", *FLAG_VALUES[name][0])]


@pytest.mark.parametrize("parser", [generate_cli.parser, serve_cli.parser],
                         ids=["generate", "serve"])
def test_both_commands_declare_every_engine_flag(parser: argparse.ArgumentParser) -> None:
    assert set(FLAG_VALUES) == set(CLI_FLAGS)
    names = [name for name in CLI_FLAGS if name not in APART]
    config = LLMConfig.from_cli_args(parser().parse_args(argv_of(names)))
    assert {name: getattr(config, name) for name in names} \
        == {name: FLAG_VALUES[name][1] for name in names}
    running = parser().parse_args(argv_of(["model", "daemon", "runner", "seed"]))
    assert LLMConfig.from_cli_args(running) == LLMConfig(
        model="tiny-llama", daemon="unix:///d.sock", runner="unix:///r.sock", seed=7)
    # Flags not given keep the dataclass's defaults.
    assert LLMConfig.from_cli_args(parser().parse_args(["--model", "m"])) == LLMConfig(model="m")
    pool = parser().parse_args(["--model", "m", "--num-blocks", "64", "--no-enable-prefix-caching"])
    assert LLMConfig.from_cli_args(pool) == LLMConfig(model="m", num_blocks=64,
                                                      enable_prefix_caching=False)


def test_serve_takes_the_model_first_or_as_a_flag() -> None:
    line = ["m", "--max-model-len", "256", "--gpu-memory-utilization", "0.5",
            "--enable-prefix-caching"]
    config = serve_cli.engine_config(serve_cli.parser().parse_args(line))
    assert (config.model, config.max_model_len, config.gpu_memory_utilization,
            config.enable_prefix_caching) == ("m", 256, 0.5, True)
    assert serve_cli.engine_config(serve_cli.parser().parse_args(["m", "--model", "m"])).model \
        == "m"
    with pytest.raises(ValueError, match="the model is given twice: 'a' and --model 'b'"):
        serve_cli.engine_config(serve_cli.parser().parse_args(["a", "--model", "b"]))
    with pytest.raises(ValueError, match=r"give the model: pagedkv serve MODEL"):
        serve_cli.engine_config(serve_cli.parser().parse_args([]))
    # With --daemon alone, the runner is the one of the first served name.
    alone = serve_cli.parser().parse_args(["m", "--daemon", "unix:///d", "--served-model-name",
                                           "a", "--served-model-name", "b"])
    assert serve_cli.engine_config(alone).model_name == "a"


@pytest.mark.parametrize("name", STARTED_ONLY)
def test_started_services_settings_are_refused_with_a_running_daemon(name: str) -> None:
    value = FLAG_VALUES[name][1]
    with pytest.raises(ValueError, match=f"{name} sets the daemon and runner LLM starts"):
        LLMConfig(model="m", daemon="unix:///d", runner="unix:///r", **{name: value})


@pytest.mark.parametrize("options, message", [
    ({"max_model_len": 0}, "max_model_len must be >= 1"),
    ({"block_size": 24}, "block_size must be a positive power of two"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of auto, fp8, fp8_e4m3"),
    ({"dtype": "fp8"}, "dtype 'fp8' is a KV cache's only: give kv_cache_dtype fp8"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"max_num_batched_tokens": 0}, "max_num_seqs and max_num_batched_tokens must be >= 1"),
])
def test_bad_settings_are_refused_naming_them(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLMConfig(model="m", **options)  # type: ignore[arg-type]


def test_max_model_len_past_the_models_positions_is_refused() -> None:
    tiny = resolve_model("tiny-llama")
    tiny.check_max_model_len(4096)
    with pytest.raises(ValueError, match="max_model_len 4097 exceeds the 4096 positions "
                                         "'tiny-llama' takes"):
        tiny.check_max_model_len(4097)
