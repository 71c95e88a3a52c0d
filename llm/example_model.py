"""A small random-initialized model folder with a real tokenizer, made here: nothing downloaded.

    pagedkv example-model ./models/example
    pagedkv serve ./models/example                 # text in, text out, chat too

It is for trying pagedkv where no model can be fetched (the README's commands, CI): a Llama of
2 layers whose tokenizer is a byte-level BPE trained on a few built-in sentences and saved as a
`PreTrainedTokenizerFast` (AutoTokenizer loads it as users' tokenizers load), with a chat
template. The weights are random, so the text it writes is noise, but every path a real folder
takes (tokenizer, chat template, end-of-sequence id, safetensors) is the real one.
"""

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "paged attention keeps kv blocks",
             "hello world, this is pagedkv", "the quick brown fox jumps over the lazy dog"]
# Chat turns and multi-byte text (two- to four-byte characters): the tokenizer then knows the
# template's markers, and its byte-level pieces split characters.
CHAT_SENTENCES = ["<|system|>be brief<eos><|user|>hello<eos><|assistant|>hello world<eos>",
                  "<|user|>where is the cat?<eos><|assistant|>the cat sat on the mat<eos>",
                  "café naïve señor — déjà vu", "日本語のテキスト 日本", "☕ coffee ☕ 😀 emoji 😀"]
# "<|role|>content<eos>" per message; add_generation_prompt opens the assistant's turn.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
                 "<eos>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def train_tokenizer(sentences: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `sentences`, `<eos>` its id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # transformers leaves the tokenizer's constructor, from_config and its logging unannotated.
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, eos_token="<eos>")
    assert fast.eos_token_id == 0
    return fast


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The example's tokenizer, with its chat template."""
    fast = train_tokenizer(SENTENCES + CHAT_SENTENCES)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def random_llama(vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """A 2-layer fp32 Llama with random weights (initializer_range 0.2: 0.02 would make every
    position alike), its end-of-sequence id 0."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2, eos_token_id=0,
                         bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config)
    return model


def write_example_model(folder: Path, seed: int = 0) -> None:
    """The example model and its chat tokenizer, saved in `folder`."""
    tokenizer = chat_tokenizer()
    random_llama(len(tokenizer), seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="pagedkv example-model", description=(
        "Write a small random-initialized Llama with a byte-level BPE tokenizer and a chat "
        "template to DIR (nothing is downloaded): a model folder to try pagedkv with."))
    cli.add_argument("folder", metavar="DIR", help="where to write it (made if missing; its "
                                                   "model files are replaced)")
    cli.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    args = cli.parse_args(argv)
    folder = Path(args.folder)
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one file
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_example_model(folder, args.seed)
    except OSError as exc:
        print(f"pagedkv example-model: error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0
