"""Sliding-window and soft-capped families through a real pagedkvd: Mistral, Qwen2, Gemma2.

Each model is random-initialized (fp32, initializer_range 0.2) from a tiny config whose sliding
window is shorter than the contexts, so the window cuts every long prompt and decode step:
Mistral windows every layer, Qwen2 (use_sliding_window, max_window_layers=1) only layer 1,
Gemma2 only layer 0, with attention-logit and final-logit softcaps small enough to bend the
scores and a query_pre_attn_scalar that is not head_dim. The runner's greedy tokens (through its
step engine, `engine_driver.greedy`) must equal transformers' `generate` with eager attention,
and every step's logits its eager forward's (within 1e-4).
The pool depends only on geometry (2 layers, 2 KV heads, head_dim 16), which the three configs
share, so one daemon serves them all.
"""

import copy
from collections.abc import Iterator, Sequence

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pagedkv.client import PoolClient, Session
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.kernels.paged_attention import (
    enable_paged_attention,
    layer_sliding_window,
)
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk

from engine_driver import greedy
from kernel_utils import skip_unless_triton_runs_on
from pagedkvd_process import Pagedkvd, pagedkvd

BLOCK_SIZE = 16
NEW_TOKENS = 10
# Prompts inside one block, just past one, past two: longer than every window below.
PROMPT_LENS = (5, 17, 33)
# What every config shares: the pool's geometry, a small vocabulary, no special tokens.
SHARED = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "initializer_range": 0.2, "eos_token_id": None, "bos_token_id": None,
          "pad_token_id": None}
FAMILIES: dict[str, tuple[type[PreTrainedModel], PretrainedConfig]] = {
    "mistral": (MistralForCausalLM, MistralConfig(sliding_window=7, **SHARED)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(use_sliding_window=True, sliding_window=12,
                                            max_window_layers=1, **SHARED)),
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(sliding_window=10, head_dim=16,
                                               query_pre_attn_scalar=24,
                                               attn_logit_softcapping=2.0,
                                               final_logit_softcapping=5.0, **SHARED)),
}
# The windows transformers gives each layer of those configs.
EXPECTED_WINDOWS = {"mistral": [7, 7], "qwen2": [None, 12], "gemma2": [10, None]}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pagedkvd]:
    config_dir = tmp_path_factory.mktemp("model")
    FAMILIES["mistral"][1].save_pretrained(config_dir)
    with pagedkvd("--model-config", str(config_dir / "config.json"), "--dtype", "float32",
                  "--block-size", str(BLOCK_SIZE), "--num-blocks", "32") as running:
        yield running
        assert running.stop() == 0



@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, SHARED["vocab_size"], (n,), generator=generator).tolist()
            for n in PROMPT_LENS]


def reference_model(family: str) -> PreTrainedModel:
    """The family's model with transformers' eager attention: what the runner must agree with."""
    model_class, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(copy.deepcopy(config)).eval()
    model.set_attn_implementation("eager")
    return model


class LogitsRunner(ModelRunner):
    """A runner that keeps every step's logits."""

    logits: list[torch.Tensor]

    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        logits = super().step(chunks)
        self.logits.append(logits)  # [S, vocab]
        return logits


def test_config_windows_per_layer():
    for family, (_, config) in FAMILIES.items():
        windows = [layer_sliding_window(config, layer) for layer in range(2)]
        assert windows == EXPECTED_WINDOWS[family], family
    assert layer_sliding_window(LlamaConfig(sliding_window=5), 0) is None  # Llama never windows
    assert layer_sliding_window(MistralConfig(sliding_window=None), 0) is None


# Every family on the torch kernels; Gemma2 (a windowed and a full layer, both soft-capped) on the
# Triton kernels too, whose interpreter is slow on CPU (the kernel tests cover them broadly).
PARITY_CASES = [*((family, "torch") for family in FAMILIES), ("gemma2", "triton")]


@pytest.mark.parametrize(("family", "backend"), PARITY_CASES)
async def test_greedy_tokens_and_logits_match_eager_transformers(
    runner_client: PoolClient, session: Session, prompts: list[list[int]], family: str,
    backend: str,
) -> None:
    if backend == "triton":
        skip_unless_triton_runs_on("cpu")
    reference = reference_model(family)
    runner = LogitsRunner.attach(copy.deepcopy(reference), await runner_client.pool_info(),
                                 get_backend(backend))
    runner.logits = []
    results = await greedy(runner_client, runner, session.session_id, prompts, NEW_TOKENS)
    worst = 0.0
    for index, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, do_sample=False)
        assert result.tokens == expected[0, len(prompt):].tolist()
        # Eager logits of every position the runner computed: prompt's last, then each token's.
        with torch.no_grad():
            eager = reference(expected[:, :-1]).logits[0, len(prompt) - 1:]  # [NEW_TOKENS, V]
        paged = torch.stack([logits[index] for logits in runner.logits])
        worst = max(worst, float((paged - eager).abs().max()))
    assert worst < 1e-4


def test_unsupported_attention_is_refused_before_any_forward():
    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    refused = [
        (Gemma3ForCausalLM(Gemma3TextConfig(use_bidirectional_attention=True, **small)),
         "cannot run gemma3_text: model.layers.0.self_attn is bidirectional"),
        (GptOssForCausalLM(GptOssConfig(num_local_experts=2, num_experts_per_tok=1, **small)),
         "cannot run gpt_oss: model.layers.0.self_attn has attention sinks"),
    ]
    for model, message in refused:
        before = model.config._attn_implementation
        with pytest.raises(ValueError, match=message):
            enable_paged_attention(model)
        assert model.config._attn_implementation == before  # left as it was
    linear = Qwen2Config(layer_types=["full_attention", "linear_attention"], **small)
    with pytest.raises(ValueError, match="cannot run qwen2: layer 1 is 'linear_attention'"):
        layer_sliding_window(linear, 1)
