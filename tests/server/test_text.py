"""The server's text pieces, in this process: `TextStream` (incremental detokenization and stop
strings) and `token_text` on the chat model's tokenizer (byte-level BPE trained in the test, its
pieces splitting multi-byte characters); `render_chat` against transformers' own
apply_chat_template; the chat model folder as `pagedkv serve` loads it."""

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedkv.llm.example_model import CHAT_TEMPLATE, SENTENCES, chat_tokenizer, train_tokenizer
from pagedkv.llm.tokenizer import load_tokenizer
from pagedkv.server.chat import render_chat
from pagedkv.server.text import REPLACEMENT, TextStream, token_bytes, token_text

from chat_model import make_chat_model_dir

SENTENCE = "the cat sat on the mat"
MULTI_BYTE = "café 日本語 ☕ 😀"
# Stop strings for the property: across tokens, inside one, multi-byte, never present.
STOPS = ["a", "at o", "the", " ", "日本", "é", "☕ c", "😀", "xyz", "t s"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return chat_tokenizer()


def pieces(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> list[str]:
    return [tokenizer.decode([token_id]) for token_id in ids]


def feed(stream: TextStream, ids: list[int]) -> list[str]:
    """What add() returns for each token, one at a time."""
    return [stream.add([token_id]) for token_id in ids]


def test_stop_string_over_three_tokens_is_held_then_cut(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(SENTENCE)
    assert pieces(tokenizer, ids)[:7] == ["the", " cat", " s", "at", " ", "on", " the"]
    stream = TextStream(tokenizer, ["at on"])
    # " cat" ends with "at" (it could start "at on"): held; " s" releases it; "at", " " are
    # held again, and "on" completes the stop string: the text ends before it.
    assert feed(stream, ids[:6]) == ["the", " c", "at s", "", "", ""]
    assert stream.stopped and stream.num_tokens == 6 and stream.text == "the cat s"
    assert stream.add(ids[6:]) == "" and stream.num_tokens == 6
    assert stream.finish() == "" and stream.text == "the cat s"


def test_stop_string_over_two_tokens_in_one_add(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(SENTENCE)
    stream = TextStream(tokenizer, [" sat"])
    assert feed(stream, ids[:3]) == ["the", " cat", ""]  # " s" could start " sat"
    # The rest in one add: the tokens after the one completing " sat" are not consumed.
    assert stream.add(ids[3:]) == "" and stream.stopped
    assert stream.num_tokens == 4 and stream.text == "the cat"


def test_no_stop_string_ends_a_completion_before_min_tokens(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(SENTENCE)  # "the", " cat", " s", "at", " ", "on", " the", ...
    # " the" first completes at token 7 ("the" at token 1 is not " the"); "the" at token 1
    # would stop at once without min_tokens.
    plain = TextStream(tokenizer, ["the"])
    plain.add(ids)
    assert plain.stopped and plain.num_tokens == 1 and plain.text == ""
    stream = TextStream(tokenizer, ["the"], min_tokens=3)
    stream.add(ids)
    # The "the" of the first token is never looked for again; the next one, at token 7, ends it.
    assert stream.stopped and stream.num_tokens == 7 and stream.text == "the cat sat on "


def test_stop_string_that_never_completes_is_released(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(SENTENCE)
    stream = TextStream(tokenizer, ["at onx"])
    sent = feed(stream, ids)
    # "at on" is held until " the" shows it is not the stop string; the final "at" of "mat"
    # is held until the completion ends.
    assert sent == ["the", " c", "at s", "", "", "", "at on the", " ", "m"]
    assert not stream.stopped and stream.finish() == "at"
    assert "".join(sent) + "at" == stream.text == SENTENCE and stream.num_tokens == len(ids)


def test_earliest_stop_string_wins_whatever_its_place_in_the_list(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(SENTENCE)
    # " cat" completes both; "the c" begins first.
    stream = TextStream(tokenizer, ["cat", "the c", "mat"])
    assert feed(stream, ids[:2]) == ["", ""]
    assert stream.stopped and stream.text == "" and stream.num_tokens == 2


def test_multi_byte_characters_split_over_tokens_come_out_whole(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(MULTI_BYTE)
    alone = pieces(tokenizer, ids)
    assert sum(REPLACEMENT in piece for piece in alone) >= 10  # the pieces split characters
    stream = TextStream(tokenizer)
    sent = []
    for index, token_id in enumerate(ids):
        sent.append(stream.add([token_id]))
        assert REPLACEMENT not in sent[-1]
        # The non-streamed view is decode's, incomplete character included.
        assert stream.text == tokenizer.decode(ids[:index + 1])
    assert "日本" in sent  # the piece "¥æ" ends 日 and begins 本: both come out together
    assert stream.finish() == "" and "".join(sent) == MULTI_BYTE


def test_stop_string_before_an_incomplete_character_stops_at_once(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("café 日本")
    # The token ending 日 also begins 本: the stop string is complete there.
    end = next(i for i in range(len(ids)) if "日" in tokenizer.decode(ids[:i + 1]))
    assert tokenizer.decode(ids[:end + 1]).endswith("日" + REPLACEMENT)
    stream = TextStream(tokenizer, ["日"])
    assert "".join(feed(stream, ids)) == "café "
    assert stream.stopped and stream.num_tokens == end + 1


def test_an_incomplete_last_character_is_released_at_finish(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("déjà")[:-1]  # à's first byte only
    stream = TextStream(tokenizer)
    assert "".join(feed(stream, ids)) == "déj"
    assert stream.finish() == REPLACEMENT and stream.text == "déj" + REPLACEMENT


def test_special_tokens_are_left_out_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = [*tokenizer.encode("hello"), 0]
    skipped, kept = TextStream(tokenizer), TextStream(tokenizer, skip_special_tokens=False)
    assert skipped.add(ids) + skipped.finish() == "hello"
    assert kept.add(ids) + kept.finish() == "hello<eos>"


class CountingTokenizer:
    """The tokenizer, noting how many tokens each decode call is given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.sizes.append(len(token_ids))
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def __len__(self) -> int:
        return len(self.tokenizer)


def test_each_step_decodes_a_window_not_the_completion(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(" ".join([SENTENCE, MULTI_BYTE] * 10))
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, ["xyz"])
    text = "".join(feed(stream, ids)) + stream.finish()
    assert text == tokenizer.decode(ids) and len(ids) > 250
    # A window is the tokens last read and the new ones: those of a character each at most
    # (4 bytes), not the 250 of the completion; two decodes a token at most.
    assert max(counting.sizes) <= 8 and len(counting.sizes) <= 2 * len(ids) + 1


def test_an_empty_stop_string_is_refused(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match=r"^stop\[1\]: "):
        TextStream(tokenizer, ["a", ""])


def reference(tokenizer: PreTrainedTokenizerFast, ids: list[int],
              stops: list[str]) -> tuple[str, int, bool]:
    """The completion's text, token count and whether it stopped, decoding every prefix whole:
    it ends at the first token after which a stop string appears in the whole characters,
    before the earliest."""
    for count in range(1, len(ids) + 1):
        whole = tokenizer.decode(ids[:count], skip_special_tokens=True).rstrip(REPLACEMENT)
        found = [index for stop in stops if (index := whole.find(stop)) >= 0]
        if found:
            return whole[:min(found)], count, True
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids), False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), stops=st.lists(st.sampled_from(STOPS), max_size=3, unique=True))
def test_streamed_text_equals_decode_of_the_kept_tokens(data: st.DataObject,
                                                        stops: list[str]) -> None:
    tokenizer = chat_tokenizer_cached()
    # Text-like ids (encoded sentences) or random ones (stray bytes, <eos>).
    texts = [MULTI_BYTE, SENTENCE, "déjà vu ☕ 日本語のテキスト"]
    ids = data.draw(st.one_of(
        st.sampled_from(texts).map(tokenizer.encode),
        st.lists(st.integers(0, len(tokenizer) - 1), max_size=24)))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    stream = TextStream(tokenizer, stops)
    sent, start = [], 0
    for size in [*chunks, len(ids)]:
        sent.append(stream.add(ids[start:start + size]))
        start += size
        if not stream.stopped:
            assert stream.text == tokenizer.decode(ids[:start], skip_special_tokens=True)
    sent.append(stream.finish())
    assert ("".join(sent), stream.num_tokens, stream.stopped) == reference(tokenizer, ids, stops)
    assert stream.text == "".join(sent)


_TOKENIZER: list[PreTrainedTokenizerFast] = []


def chat_tokenizer_cached() -> PreTrainedTokenizerFast:
    """One tokenizer for every hypothesis example (function fixtures do not mix with @given)."""
    if not _TOKENIZER:
        _TOKENIZER.append(chat_tokenizer())
    return _TOKENIZER[0]


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-like tokenizer: SentencePiece pieces ("▁" starts a word, one character a
    piece here) with byte fallback (<0xC3>) and Llama's decoder, which drops a text's first
    space."""
    chars = sorted(set("".join(SENTENCES)) - {" "})
    pieces = ["<eos>", "\u2581", *chars, *(f"<0x{byte:02X}>" for byte in range(256))]
    tokenizer = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(pieces)},
                                     merges=[], byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def test_the_prompt_gives_a_sentencepiece_completion_its_first_space() -> None:
    tokenizer = sentencepiece_tokenizer()
    prompt, completion = tokenizer.encode("the cat"), tokenizer.encode(" sat on é")
    assert tokenizer.convert_ids_to_tokens(completion)[:2] == ["\u2581", "s"]
    alone = TextStream(tokenizer)
    assert alone.add(completion) + alone.finish() == "sat on é"  # decode drops the space
    stream = TextStream(tokenizer, ["on"], prompt_ids=prompt)
    assert feed(stream, completion[:7]) == [" ", "s", "a", "t", " ", "", ""]  # "o" held
    assert stream.stopped and stream.text == " sat " and stream.num_tokens == 7
    whole = TextStream(tokenizer, prompt_ids=prompt)
    assert "".join(feed(whole, completion)) + whole.finish() == " sat on é"
    assert tokenizer.decode(prompt + completion) == "the cat" + whole.text
    assert whole.num_tokens == len(completion)


def test_token_text_of_sentencepiece_pieces() -> None:
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.encode(" é")
    assert tokenizer.convert_ids_to_tokens(ids) == ["\u2581", "<0xC3>", "<0xA9>"]
    assert [token_text(tokenizer, i) for i in ids] == [" ", "bytes:\\xc3", "bytes:\\xa9"]
    assert b"".join(token_bytes(tokenizer, i) for i in ids[1:]) == "é".encode()


def test_token_text_escapes_the_bytes_of_part_of_a_character(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(MULTI_BYTE)
    assert tokenizer.convert_ids_to_tokens(ids[3:8]) == ["Ã©", "Ġ", "æ", "Ĺ", "¥æ"]
    assert [token_text(tokenizer, i) for i in ids[3:8]] == [
        "é", " ", "bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5\\xe6"]
    assert token_text(tokenizer, 0) == "<eos>"
    assert token_bytes(tokenizer, ids[7]) == b"\xa5\xe6"
    # The bytes of every token, joined, are the text's.
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == MULTI_BYTE.encode()


CONVERSATION: list[object] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "where is"},
                                 {"type": "text", "text": "the cat?"}]},
    {"role": "assistant", "content": "on the mat"},
    {"role": "tool", "content": "日本"},
    {"role": "user", "content": "and the dog?", "name": "ignored"}]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_is_the_chat_template(tokenizer: PreTrainedTokenizerFast,
                                          add_generation_prompt: bool) -> None:
    ids = render_chat(tokenizer, CONVERSATION, add_generation_prompt=add_generation_prompt)
    plain = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": "where is\nthe cat?"},
             {"role": "assistant", "content": "on the mat"}, {"role": "tool", "content": "日本"},
             {"role": "user", "content": "and the dog?"}]
    expected = tokenizer.apply_chat_template(plain, tokenize=True, return_dict=False,
                                             add_generation_prompt=add_generation_prompt)
    assert ids == expected and all(type(token_id) is int for token_id in ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|system|>be brief<eos><|user|>where is\nthe cat?<eos>")
    assert text.endswith("<|assistant|>") == add_generation_prompt


@pytest.mark.parametrize(("messages", "error"), [
    ([], "messages: must be a non-empty list"),
    ("hello", "messages: must be a non-empty list"),
    (["hello"], "messages[0]: must be an object"),
    ([{"content": "hi"}], "messages[0].role: must be one of system, user, assistant, tool"),
    ([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}],
     "messages[1].role: must be one of"),
    ([{"role": ["user"], "content": "hi"}], "messages[0].role: "),
    ([{"role": "user"}], "messages[0].content: must be a string or a list of text parts"),
    ([{"role": "user", "content": 5}], "messages[0].content: "),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[2].content[0].type: only text parts are supported"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]: must be an object"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
     "messages[0].content[0].text: must be a string"),
])
def test_render_chat_refuses_bad_messages_naming_the_field(
        tokenizer: PreTrainedTokenizerFast, messages: Sequence[object], error: str) -> None:
    with pytest.raises(ValueError) as refused:
        render_chat(tokenizer, messages)
    assert str(refused.value).startswith(error)


def test_render_chat_without_a_template_or_refused_by_it() -> None:
    plain = train_tokenizer(SENTENCES)
    with pytest.raises(ValueError, match=r"^the model's tokenizer has no chat template: use "
                                         r"/v1/completions$"):
        render_chat(plain, [{"role": "user", "content": "hi"}])
    plain.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match=r"^messages: .*roles must alternate"):
        render_chat(plain, [{"role": "user", "content": "hi"}])


def test_the_chat_model_folder_loads_its_trained_tokenizer_and_template(
        tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    make_chat_model_dir(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None and getattr(loaded, "chat_template", None) == CHAT_TEMPLATE
    assert loaded.encode(MULTI_BYTE) == tokenizer.encode(MULTI_BYTE)
    assert render_chat(loaded, CONVERSATION) == render_chat(tokenizer, CONVERSATION)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == 0 == getattr(loaded, "eos_token_id", None)
    assert config["vocab_size"] == len(loaded) and config["dtype"] == "float32"
