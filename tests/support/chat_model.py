"""Model folders made in a test: the example model of `pagedkv example-model`
(llm/example_model.py: a random Llama, a byte-level BPE tokenizer trained on a few sentences),
with its end-of-sequence token made reachable.

The model's end-of-sequence token is the tokenizer's `<eos>` (id 0). Its embedding and output
rows are swapped with those of a token the random model generates greedily for EOS_PROMPT, so
that prompt ends with `<eos>` after a few tokens (a relabelling of the vocabulary: the model
is otherwise the same random model).

`make_chat_model_dir` uses the example's chat tokenizer (a template; trained on chat turns and
on text with multi-byte characters too, so its byte-level pieces split characters: the text
tests need that).
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from pagedkv.llm.example_model import SENTENCES, chat_tokenizer, random_llama, train_tokenizer

EOS_PROMPT = "a dog ran"


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
    model = random_llama(len(fast))
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


def make_chat_model_dir(folder: Path) -> None:
    """A random Llama (fp32) with the chat tokenizer, saved in `folder` so that
    AutoTokenizer.from_pretrained(folder) loads that tokenizer and its template."""
    make_model_dir(folder, chat_tokenizer())
