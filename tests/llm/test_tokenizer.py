"""`decoder`: a transformers fast tokenizer's text straight from its Rust decoder, the same text
as its decode, and decode itself whenever that could differ (clean_up_tokenization_spaces, a
class that overrides decoding, a tokenizer that is not transformers')."""

from collections.abc import Sequence

import pytest
from transformers import PreTrainedTokenizerFast

from pagedkv.llm.tokenizer import decoder

from chat_model import chat_tokenizer

# Token id lists a stream decodes: plain text, special tokens (<eos> is 0), and pieces of a
# multi-byte character alone.
SAMPLES = ["hello world, the cat sat", "caf\u00e9 \u2014 na\u00efve \u00fcber", "<eos> again"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return chat_tokenizer()


def id_lists(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    encoded = [tokenizer.encode(text) for text in SAMPLES]
    return [*encoded, *([ids[i]] for ids in encoded for i in range(len(ids))), [0, 5, 0], []]


class Refused:
    """An instance decode that fails: the Rust path never calls it."""

    def __call__(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        raise AssertionError("decode called")


def test_the_rust_decoder_gives_decodes_text(tokenizer: PreTrainedTokenizerFast) -> None:
    """Every id list, special tokens skipped or not, decodes to the same text, without calling
    the Python decode."""
    assert not tokenizer.clean_up_tokenization_spaces
    expected = {(tuple(ids), skip): tokenizer.decode(ids, skip_special_tokens=skip)
                for ids in id_lists(tokenizer) for skip in (True, False)}
    assert any("\ufffd" in text for text in expected.values())  # a character cut in pieces
    tokenizer.decode = Refused()  # type: ignore[method-assign]
    try:
        decode = decoder(tokenizer)
        assert {key: decode(list(key[0]), key[1]) for key in expected} == expected
    finally:
        del tokenizer.decode


class Cleaned(PreTrainedTokenizerFast):
    """A class that rewrites decode's text, as some model tokenizers do."""

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
                clean_up_tokenization_spaces: bool | None = None, **kwargs: object) -> str:
        return "<" + str(super()._decode(token_ids, skip_special_tokens)) + ">"


def test_decode_that_may_differ_goes_through_the_tokenizer(
        tokenizer: PreTrainedTokenizerFast) -> None:
    """clean_up_tokenization_spaces, an overriding class and a non-transformers tokenizer each
    keep their own decode."""
    ids = tokenizer.encode(SAMPLES[0])
    cleaning = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer,
                                       clean_up_tokenization_spaces=True)
    calls: list[list[int]] = []
    cleaning.decode = lambda token_ids, skip_special_tokens=False: (  # type: ignore[method-assign]
        calls.append(list(token_ids)) or "cleaned")
    assert decoder(cleaning)(ids, True) == "cleaned" and calls == [ids]
    cleaned = Cleaned(tokenizer_object=tokenizer.backend_tokenizer)
    assert decoder(cleaned)(ids, True) == "<" + tokenizer.decode(ids) + ">"

    class Plain:
        def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
            return f"{len(token_ids)} {skip_special_tokens}"

    assert decoder(Plain())(ids, True) == f"{len(ids)} True"  # type: ignore[arg-type]
