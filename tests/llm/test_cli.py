"""`pagedkv generate`'s command line, without starting anything: the engine's flags are
LLMConfig's (tests/llm/test_config.py), the positional arguments stay prompts, and a bad
setting exits 2 naming it before any process starts."""

import pytest

from pagedkv.llm.cli import main, parser


def test_positional_arguments_are_prompts_and_the_model_a_flag() -> None:
    args = parser().parse_args(["--model", "tiny-llama", "tiny", "hello", "--seed", "3"])
    assert (args.model, args.prompts, args.seed) == ("tiny-llama", ["tiny", "hello"], 3)


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny-llama", "--max-model-len", "5000", "hi"],
     "max_model_len 5000 exceeds the 4096 positions"),
    (["--model", "tiny-llama", "--daemon", "unix:///x", "--runner", "unix:///y",
      "--no-enable-prefix-caching", "hi"], "enable_prefix_caching sets the daemon and runner"),
    (["--model", "tiny-llama", "--kv-cache-memory", "1MiB", "--num-blocks", "4", "hi"],
     "kv_cache_memory or num_blocks, not both"),
    (["--model", "tiny-llama", "--block-size", "3", "hi"], "block_size must be a positive power"),
])
def test_bad_settings_exit_2_before_anything_starts(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
