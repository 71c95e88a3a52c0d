"""Structured outputs and min_tokens end to end (`LLM.generate` -> the engine -> runner.proto ->
the runner's sampler), with real processes: a daemon and a runner started by the LLM, on a real
transformers model folder with a real tokenizer (tests/support/chat_model.py's `make_model_dir`:
its `<eos>`, id 0, ends EOS_PROMPT after a few greedy tokens). Also a runner killed mid-request:
its restart rebuilds the constraint from the resent history."""

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from pagedkv.client import Engine, InvalidArgument, Unsupported
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.llm import LLM, SamplingParams, StructuredOutputs
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.model_ref import resolve_model
from pagedkv.llm.services import start_services

from chat_model import EOS_PROMPT, fast_tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
JSON = StructuredOutputs(json=json.dumps(SCHEMA))
EOS = 0


def constrained(constraint: StructuredOutputs, **options: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 64,
                             "structured_outputs": constraint, **options})


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model=str(model_dir), kv_cache_memory="4MiB", max_num_seqs=8) as started:
        yield started


def test_greedy_json_validates_against_the_schema(llm: LLM) -> None:
    free, strict = llm.generate(["the cat sat on"] * 2, [SamplingParams(temperature=0,
                                                                        max_tokens=64),
                                                         constrained(JSON)])
    with pytest.raises(ValueError):  # the random model writes no JSON by itself
        json.loads(free.outputs[0].text)
    output = strict.outputs[0]
    jsonschema.validate(json.loads(output.text), SCHEMA)
    assert output.finish_reason == "stop" and output.token_ids[-1] == EOS


def test_regex_choice_and_json_object(llm: LLM) -> None:
    regex, choice, anything = llm.generate(["hello world"] * 3, [
        constrained(StructuredOutputs(regex="[0-9]{3}-[a-z]{2}")),
        constrained(StructuredOutputs(choice=("yes", "no", "maybe"))),
        constrained(StructuredOutputs(json_object=True))])
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.outputs[0].text)
    assert choice.outputs[0].text in ("yes", "no", "maybe")
    assert isinstance(json.loads(anything.outputs[0].text), dict)


def test_the_constraint_ends_the_output_even_with_ignore_eos(llm: LLM) -> None:
    output = llm.generate(["hello world"], constrained(StructuredOutputs(choice=("yes", "no")),
                                                       ignore_eos=True))[0].outputs[0]
    assert output.text in ("yes", "no")
    assert output.finish_reason == "stop" and output.token_ids[-1] == EOS


def test_parallel_samples_all_match(llm: LLM) -> None:
    outputs = llm.generate(["the cat"], constrained(JSON, temperature=1.0, seed=5, n=2,
                                                    best_of=3))[0].outputs
    assert len(outputs) == 2
    for output in outputs:
        jsonschema.validate(json.loads(output.text), SCHEMA)


def test_min_tokens_holds_back_the_stop_token(llm: LLM) -> None:
    free = llm.generate([EOS_PROMPT], SamplingParams(temperature=0, max_tokens=16))
    first_stop = len(free[0].outputs[0].token_ids)
    assert free[0].outputs[0].token_ids[-1] == EOS and first_stop < 8
    held = llm.generate([EOS_PROMPT], SamplingParams(temperature=0, max_tokens=16,
                                                     min_tokens=8))[0].outputs[0]
    assert len(held.token_ids) >= 8
    assert EOS not in held.token_ids[:7]
    assert held.token_ids[:first_stop - 1] == free[0].outputs[0].token_ids[:first_stop - 1]


def test_a_bad_schema_names_the_field_and_changes_nothing(llm: LLM) -> None:
    before = llm.generate(["hello world"], constrained(JSON))[0].outputs[0].token_ids
    with pytest.raises(InvalidArgument, match=r"structured_outputs\.json does not compile"):
        llm.generate(["hello world"], constrained(StructuredOutputs(json='{"type": "nope"}')))
    assert llm.generate(["hello world"], constrained(JSON))[0].outputs[0].token_ids == before


def test_beam_search_refuses_a_constraint() -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(temperature=0, beam_width=2, structured_outputs=JSON)


def test_a_preset_without_a_tokenizer_refuses_structured_outputs() -> None:
    with LLM(model="tiny-llama", kv_cache_memory="4MiB", max_num_seqs=4) as preset:
        with pytest.raises(Unsupported, match="--tokenizer"):
            preset.generate([[1, 2, 3]], constrained(JSON))
        assert preset.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


async def test_a_restarted_runner_keeps_the_constraint(model_dir: Path) -> None:
    """The runner is SIGKILLed mid-output; its supervisor starts another, the engine resends
    the sequence with its history and sampling, and the new runner's matcher replays the
    output: the result is the uninterrupted one."""
    config = LLMConfig(model=str(model_dir), kv_cache_memory="4MiB", device="cpu")
    params = constrained(JSON, ignore_eos=True)
    with contextlib.ExitStack() as resources:
        services = start_services(config, resolve_model(str(model_dir)), resources,
                                  supervise=True)
        supervisor = services.runner_supervisor
        assert supervisor is not None
        async with await Engine.connect(services.daemon_target, services.runner_target,
                                        runner_restart_wait_s=RESTART_WAIT_S) as engine:
            prompt = [5, 6, 7, 8]
            uninterrupted = await engine.generate(prompt, params)
            killed_at = 0
            async for output in engine.stream(prompt, params):
                if not killed_at and len(output.outputs[0].token_ids) >= 4:
                    killed_at = len(output.outputs[0].token_ids)
                    os.kill(supervisor.pid, signal.SIGKILL)
                final = output
    assert 0 < killed_at < len(final.outputs[0].token_ids) and supervisor.restarts == 1
    assert final.outputs[0].token_ids == uninterrupted.outputs[0].token_ids
    text = fast_tokenizer(model_dir).decode(list(final.outputs[0].token_ids),
                                            skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
