"""The ten model families the step engine serves, tiny and random-initialized, and their
reference outputs by transformers (eager attention): what the engine's tokens and logits must
equal. tests/model_runner/engine/test_families.py runs every family; the other step-engine tests
there use the Llama family's model over the same daemon (their conftest.py's fixtures).

Ten families, each random-initialized (fp32, initializer_range 0.2) from a tiny config: Llama
(GQA, RoPE), Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral, Gemma (scaled embeddings), Gemma2
(soft caps, query_pre_attn_scalar), Phi3 (fused qkv), GPT-2 and OPT (learned positions), GPT-NeoX
(partial rotary). Their KV geometry is the same (2 layers, 2 KV heads, head_dim 32, float32:
GQA families have 4 query heads of 32, the others 2), so one daemon, its pool laid out from the
Llama config.json, serves them all.
"""

import copy
import functools
from collections.abc import Sequence

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pagedkv.client import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 128
VOCAB = 128
NEW_TOKENS = 8
# Inside one block, just past one, just past two: prefill and decode cross block boundaries.
PROMPT_LENS = (5, 17, 33)
# Greedy, with the whole raw distribution (logprobs of every token of the vocabulary).
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=VOCAB)

# Shared by every config: two layers, no special tokens (generate must neither stop early nor
# infer an attention mask from a pad id), a wide initialization so logits are far from uniform.
COMMON = {"vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 256,
          "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
# GQA families: 4 query heads sharing 2 KV heads of 32.
GQA = {**COMMON, "hidden_size": 128, "intermediate_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 32, "initializer_range": 0.2}
# Families without GQA: 2 heads of 32.
MHA = {**COMMON, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
       "initializer_range": 0.2}
FAMILIES: dict[str, tuple[type[PreTrainedModel], PretrainedConfig]] = {
    "llama": (LlamaForCausalLM, LlamaConfig(**GQA)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**GQA)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**GQA)),
    # A window shorter than the longer prompts (else Mistral is Llama): chunks, cached prefixes
    # and forks all attend through it.
    "mistral": (MistralForCausalLM, MistralConfig(sliding_window=12, **GQA)),
    # Gemma scales its embeddings by sqrt(hidden_size); with the output layer tied to them, a
    # tiny random Gemma predicts its input token again and again: untied, its tokens vary.
    "gemma": (GemmaForCausalLM, GemmaConfig(tie_word_embeddings=False, **GQA)),
    # Soft caps small enough to bend the scores; the attention scale is not head_dim's.
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(attn_logit_softcapping=5.0,
                                               final_logit_softcapping=8.0,
                                               query_pre_attn_scalar=24,
                                               tie_word_embeddings=False, **GQA)),
    "phi3": (Phi3ForCausalLM, Phi3Config(**{k: v for k, v in GQA.items() if k != "head_dim"})),
    "gpt2": (GPT2LMHeadModel, GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=2, n_inner=128,
        initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # OPT initializes from init_std; its learned positions are offset by 2.
    "opt": (OPTForCausalLM, OPTConfig(
        ffn_dim=128, word_embed_proj_dim=64, init_std=0.2,
        **{k: v for k, v in MHA.items() if k not in ("intermediate_size", "initializer_range")})),
    # A quarter of each head's dimensions rotated (rotary_pct 0.25, NeoX's default).
    "gpt_neox": (GPTNeoXForCausalLM, GPTNeoXConfig(rotary_pct=0.25, **MHA)),
}


# ------------------------------------------------------------------------------ the models


@functools.cache
def reference_model(family: str) -> PreTrainedModel:
    """The family's model with transformers' eager attention: what the engine must agree with."""
    model_class, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(copy.deepcopy(config)).eval()
    model.set_attn_implementation("eager")
    return model


@functools.cache
def paged_model(family: str) -> PreTrainedModel:
    """The same weights, for the runner to switch to paged attention."""
    return copy.deepcopy(reference_model(family))


@functools.cache
def expected_ids(family: str, prompt: tuple[int, ...], n: int = NEW_TOKENS) -> torch.Tensor:
    """[1, len(prompt) + n] the prompt and its greedy continuation by transformers."""
    ids = torch.tensor([prompt])
    output: torch.Tensor = reference_model(family).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
        do_sample=False)
    return output


def expected_tokens(family: str, prompt: Sequence[int], n: int = NEW_TOKENS) -> list[int]:
    prompt = tuple(prompt)
    return list(expected_ids(family, prompt, n)[0, len(prompt):].tolist())


def eager_logits(family: str, prompt: Sequence[int]) -> torch.Tensor:
    """[NEW_TOKENS, V] an eager forward's logits at every position greedy decoding sampled from:
    the prompt's last token, then each generated token but the last."""
    ids = expected_ids(family, tuple(prompt))
    with torch.no_grad():
        logits: torch.Tensor = reference_model(family)(ids[:, :-1]).logits
    return logits[0, len(prompt) - 1:].float()
