"""The runner's grammar compiler (model_runner/engine/grammar.py) on a real tokenizer folder (a
byte-level BPE trained here, as tests/support/chat_model.py's model folders hold): each
constraint compiled once and cached, a constraint that does not compile refused naming its field,
and a runner without a tokenizer refusing every constraint."""

import json
from pathlib import Path

import pytest

from pagedkv.client import SamplingParams, SeqStep, StructuredOutputs
from pagedkv.model_runner.engine.grammar import Grammars, choice_grammar
from pagedkv.model_runner.engine.steps import InvalidStep, Unsupported

from chat_model import SENTENCES, train_tokenizer

SCHEMA = StructuredOutputs(json=json.dumps({"type": "object",
                                            "properties": {"ok": {"type": "boolean"}}}))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(SENTENCES).save_pretrained(folder)
    return folder


def step(*constraints: StructuredOutputs | None) -> list[SeqStep]:
    return [SeqStep(i, (1,), True, params=SamplingParams(structured_outputs=c))
            for i, c in enumerate(constraints)]


async def test_each_constraint_is_compiled_once(tokenizer_dir: Path) -> None:
    grammars = Grammars(str(tokenizer_dir), vocab_size=400)
    try:
        first = await grammars.compile(step(SCHEMA, None, SCHEMA))
        again = await grammars.compile(step(StructuredOutputs(json=SCHEMA.json)))
        assert list(first) == [SCHEMA]
        assert again[SCHEMA] is first[SCHEMA]  # the cached compile
        assert first[SCHEMA].tokenizer_info.vocab_size == 400  # the logits' width
        assert await grammars.compile(step(None)) == {}
    finally:
        grammars.close()


@pytest.mark.parametrize(("constraint", "field"), [
    (StructuredOutputs(json='{"type": "nonsense"}'), "structured_outputs.json"),
    (StructuredOutputs(regex="(unclosed"), "structured_outputs.regex"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
async def test_a_constraint_that_does_not_compile_names_its_field(
        tokenizer_dir: Path, constraint: StructuredOutputs, field: str) -> None:
    grammars = Grammars(str(tokenizer_dir), vocab_size=400)
    try:
        with pytest.raises(InvalidStep, match=f"^{field} does not compile: "):
            await grammars.compile(step(SCHEMA, constraint))
        with pytest.raises(InvalidStep):  # a refusal is not cached as a success
            await grammars.compile(step(constraint))
    finally:
        grammars.close()


async def test_no_tokenizer_refuses_structured_outputs_only(tmp_path: Path) -> None:
    for folder in (None, str(tmp_path)):  # a preset; a folder without tokenizer files
        grammars = Grammars(folder, vocab_size=400)
        try:
            assert await grammars.compile(step(None)) == {}
            with pytest.raises(Unsupported, match="structured_outputs needs the model's "
                                                  "tokenizer"):
                await grammars.compile(step(SCHEMA))
        finally:
            grammars.close()


async def test_choices_are_quoted_as_literals(tokenizer_dir: Path) -> None:
    choices = ('say "hi"', "a\\b")
    assert choice_grammar(choices) == r'root ::= "say \"hi\"" | "a\\b"'
    grammars = Grammars(str(tokenizer_dir), vocab_size=400)
    try:
        assert await grammars.compile(step(StructuredOutputs(choice=choices)))
    finally:
        grammars.close()
