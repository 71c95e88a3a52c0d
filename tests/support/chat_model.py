"""Model folders made in a test: a random Llama and a byte-level BPE tokenizer trained here on
a few sentences, saved as a PreTrainedTokenizerFast. Nothing is downloaded.

The model's end-of-sequence token is the tokenizer's `<eos>` (id 0). Its embedding and output
rows are swapped with those of a token the random model generates greedily for EOS_PROMPT, so
that prompt ends with `<eos>` after a few tokens (a relabelling of the vocabulary: the model
is otherwise the same random model).

`make_chat_model_dir` adds a chat template, and trains the tokenizer on chat turns and on
text with multi-byte characters too (its byte-level pieces then split characters: the text
tests need that).
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "paged attention keeps kv blocks",
             "hello world, this is pagedkv", "the quick brown fox jumps over the lazy dog"]
# Chat turns and multi-byte text (two- to four-byte characters) for the chat model's tokenizer.
CHAT_SENTENCES = ["<|system|>be brief<eos><|user|>hello<eos><|assistant|>hello world<eos>",
                  "<|user|>where is the cat?<eos><|assistant|>the cat sat on the mat<eos>",
                  "café naïve señor — déjà vu", "日本語のテキスト 日本", "☕ coffee ☕ 😀 emoji 😀"]
# "<|role|>content<eos>" per message; add_generation_prompt opens the assistant's turn.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
                 "<eos>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
EOS_PROMPT = "a dog ran"


def train_tokenizer(sentences: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `sentences`, `<eos>` its id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    assert fast.eos_token_id == 0
    return fast


def hf_generate(model: PreTrainedModel, prompt: list[int], **options: object) -> list[list[int]]:
    """transformers' continuations of `prompt`, cut after the end-of-sequence token (it pads
    finished rows)."""
    rows = model.generate(torch.tensor([prompt]), pad_token_id=0, **options)
    continuations = [row[len(prompt):].tolist() for row in rows]
    return [row[:row.index(0) + 1] if 0 in row else row for row in continuations]


def reference_model(folder: Path) -> PreTrainedModel:
    """The model saved in `folder`, with transformers' eager attention: the reference the
    paged engine's tokens must equal."""
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    model.set_attn_implementation("eager")
    return model


def fast_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in `folder` (its chat template too, if it has one)."""
    return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)


def make_model_dir(folder: Path, tokenizer: PreTrainedTokenizerFast | None = None) -> None:
    """`tokenizer` (else one trained on SENTENCES) and a random Llama whose eos is the
    tokenizer's, saved in `folder`."""
    fast = tokenizer if tokenizer is not None else train_tokenizer(SENTENCES)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2, eos_token_id=0,
                         bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    prompt = fast.encode(EOS_PROMPT)
    generated = hf_generate(model, prompt, max_new_tokens=6, do_sample=False,
                            eos_token_id=None)[0]
    # A token first generated at step >= 2, in neither the prompt nor the steps before.
    token = next(t for i, t in enumerate(generated) if i >= 2 and t != 0
                 and t not in prompt and t not in generated[:i])
    with torch.no_grad():
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight[[0, token]] = weight[[token, 0]]
    model.save_pretrained(folder)
    fast.save_pretrained(folder)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The chat model's tokenizer, with its chat template."""
    fast = train_tokenizer(SENTENCES + CHAT_SENTENCES)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_chat_model_dir(folder: Path) -> None:
    """A random Llama (fp32) with the chat tokenizer, saved in `folder` so that
    AutoTokenizer.from_pretrained(folder) loads that tokenizer and its template."""
    make_model_dir(folder, chat_tokenizer())
