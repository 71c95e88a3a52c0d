"""The request bodies of /v1/completions and /v1/chat/completions, read into typed requests.

    request = read_completion(body, limits)      # ApiError(400, param=...) for a bad field

Names, defaults and ranges are OpenAI's, with vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `use_beam_search`, `length_penalty`, `best_of`,
`ignore_eos`, `min_tokens`, `include_stop_str_in_output`, `skip_special_tokens`, structured
outputs, and for chat `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`). Every field the server accepts is honoured or documented as inert;
every other one, known to OpenAI's or vLLM's schemas or not, is refused with a 400 naming it
(fields.py says which and why). Every field is checked before anything is submitted. The
sampling fields become one `SamplingParams` (which checks its own ranges: its messages start
with the field's name, errors.py maps them); the output constraint is structured.py's, the
tools server/tools/'s.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.server.errors import bad_request, from_value_error
from pagedkv.server.fields import CHAT, COMPLETION, check_fields
from pagedkv.server.structured import Constraint, read_constraint
from pagedkv.server.tools.request import ToolPlan, read_tools

# Sampling fields whose checks are SamplingParams' (their errors name them).
SAMPLING_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "n", "best_of", "max_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
    "stop_token_ids", "logprobs", "ignore_eos", "min_tokens"})
# vLLM's stream_options keys, and the value of each that pagedkv honours (None: any bool).
STREAM_OPTIONS = {"include_usage": None, "continuous_usage_stats": False}
# OpenAI's completions default for max_tokens.
COMPLETIONS_MAX_TOKENS = 16
# Most stop strings per request, and most characters in one (OpenAI allows 4; vLLM more).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for (bounded work per call)."""

    # Most top logprobs per token (OpenAI: 5 for completions, 20 for chat).
    max_logprobs: int = 20
    # Most choices one request may make: prompts x n (or best_of, or beams).
    max_choices: int = 64
    # The model's positions: the default max_tokens of a chat request is what is left of them.
    max_model_len: int = 0
    # The parser of tool_choice "auto" (--tool-call-parser with --enable-auto-tool-choice);
    # None: "auto" is refused.
    tool_parser: str | None = None


@dataclass(frozen=True, slots=True)
class Sampling:
    """What both endpoints share: how to generate and what to send back."""

    model: str
    params: SamplingParams
    # Strings that end a completion (cut before them, as OpenAI does).
    stop: tuple[str, ...]
    stream: bool
    # stream_options.include_usage: a last chunk with the usage and no choices.
    include_usage: bool
    # Top logprobs per token; None = no logprobs.
    logprobs: int | None
    # max_tokens given by the client (else the endpoint's default applies).
    max_tokens_given: bool
    # The output constraint and the field that set it (its compile error names that field).
    constraint: Constraint | None = None
    # vLLM's include_stop_str_in_output: the stop string that ended a choice stays in its text.
    include_stop: bool = False
    # vLLM's skip_special_tokens: the text leaves special tokens out (the default).
    skip_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A /v1/completions request."""

    sampling: Sampling
    # The prompts, each text or token ids (checked against the vocabulary when encoded).
    prompts: list[str | list[int]]
    # Return each prompt's text before its completion.
    echo: bool


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A /v1/chat/completions request."""

    sampling: Sampling
    # The conversation, as sent (chat.py checks and renders it).
    messages: list[dict[str, Any]]
    # The tools and the tool choice (what the template sees, the constraint, the parser).
    tools: ToolPlan
    # The template opens the assistant's turn (vLLM's add_generation_prompt, default true), or
    # leaves the last message open for the model to continue (continue_final_message).
    add_generation_prompt: bool
    continue_final_message: bool
    # vLLM's chat_template_kwargs: more variables for the template.
    template_kwargs: dict[str, Any]


def read_completion(body: Mapping[str, Any], limits: Limits) -> CompletionRequest:
    """A /v1/completions body, checked."""
    check_fields(body, COMPLETION)
    prompts = _prompts(body.get("prompt"))
    logprobs = _optional_int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise bad_request("logprobs", f"logprobs must be in [0, {limits.max_logprobs}], got "
                                      f"{logprobs}")
    echo = _bool(body, "echo", False)
    if echo and logprobs is not None:
        raise bad_request("echo", "echo with logprobs asks for the prompt's logprobs, which "
                                  "pagedkv does not compute: drop one of the two")
    sampling = _sampling(body, logprobs, COMPLETIONS_MAX_TOKENS, read_constraint(body))
    _check_choices(sampling, len(prompts), limits)
    return CompletionRequest(sampling, prompts, echo)


def read_chat(body: Mapping[str, Any], limits: Limits) -> ChatRequest:
    """A /v1/chat/completions body, checked (its messages by chat.py, when rendered)."""
    check_fields(body, CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty list of messages")
    top = _optional_int(body, "top_logprobs")
    if top is not None and not 0 <= top <= limits.max_logprobs:
        raise bad_request("top_logprobs", f"top_logprobs must be in [0, "
                                          f"{limits.max_logprobs}], got {top}")
    wanted = _bool(body, "logprobs", False)
    if top is not None and not wanted:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if wanted else None
    completion_tokens = _optional_int(body, "max_completion_tokens")
    if completion_tokens is not None:  # OpenAI's newer name wins; its errors name it
        if completion_tokens < 1:
            raise bad_request("max_completion_tokens", f"max_completion_tokens must be >= 1, "
                                                       f"got {completion_tokens}")
        body = {**body, "max_tokens": completion_tokens}
    # A chat request without max_tokens may use what is left of the model's positions: the
    # engine takes min(max_tokens, positions left) per sequence.
    tools = read_tools(body, limits.tool_parser)
    constraint = read_constraint(body)
    if tools.constraint is not None and constraint is not None:
        raise bad_request(constraint.field, f"{constraint.field} and tool_choice "
                                            f"{tools.choice!r} both constrain the output: send "
                                            "one of them")
    sampling = _sampling(body, logprobs, limits.max_model_len or COMPLETIONS_MAX_TOKENS,
                         tools.constraint or constraint)
    _check_choices(sampling, 1, limits)
    generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final = _bool(body, "continue_final_message", False)
    if generation_prompt and continue_final:
        raise bad_request("continue_final_message", "continue_final_message needs "
                                                    "add_generation_prompt: false")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs", "chat_template_kwargs must be an object")
    return ChatRequest(sampling, messages, tools, generation_prompt, continue_final, kwargs)


def _sampling(body: Mapping[str, Any], logprobs: int | None, max_tokens: int,
              constraint: Constraint | None) -> Sampling:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "model must name the served model (GET /v1/models)")
    beam = _bool(body, "use_beam_search", False)
    n = _optional_int(body, "n")
    best_of = _optional_int(body, "best_of")
    options: dict[str, Any] = {
        name: body[name] for name in ("temperature", "top_p", "min_p", "seed", "max_tokens",
                                      "presence_penalty", "frequency_penalty",
                                      "repetition_penalty", "length_penalty")
        if body.get(name) is not None}
    options.setdefault("max_tokens", max_tokens)
    if body.get("top_k") is not None:
        options["top_k"] = body["top_k"]
    options["stop_token_ids"] = tuple(_int_list(body, "stop_token_ids"))
    options["ignore_eos"] = _bool(body, "ignore_eos", False)
    options["min_tokens"] = _optional_int(body, "min_tokens") or 0
    options["structured_outputs"] = constraint.outputs if constraint is not None else None
    if beam:  # vLLM's rule: best_of (else n) beams, n best returned, greedy
        options.update(beam_width=best_of or n or 1, temperature=0.0)
    elif best_of is not None:
        options["best_of"] = best_of
    try:
        params = SamplingParams(n=n or 1, logprobs=logprobs, **options)
    except (ValueError, TypeError) as exc:
        raise from_value_error(ValueError(str(exc)), SAMPLING_FIELDS) from exc
    stream = _bool(body, "stream", False)
    if stream and (params.beam_width or params.num_samples != params.n):
        raise bad_request("stream", "streaming needs best_of == n and no beam search: the "
                                    "outputs are chosen only at the end")
    return Sampling(model, params, _stop(body.get("stop")), stream, _include_usage(body),
                    logprobs, body.get("max_tokens") is not None, constraint,
                    _bool(body, "include_stop_str_in_output", False),
                    _bool(body, "skip_special_tokens", True))


def _include_usage(body: Mapping[str, Any]) -> bool:
    """stream_options.include_usage, its other keys checked (each honoured or refused)."""
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("stream_options", "stream_options must be an object")
    if stream_options and body.get("stream") is not True:
        raise bad_request("stream_options", "stream_options needs stream: true")
    for key, value in stream_options.items():
        param = f"stream_options.{key}"
        if key not in STREAM_OPTIONS:
            raise bad_request(param, f"Unrecognized request argument supplied: {param}")
        if value is not None and not isinstance(value, bool):
            raise bad_request(param, f"{param} must be true or false, got {value!r}")
        if value is not None and STREAM_OPTIONS[key] not in (None, value):
            raise bad_request(param, f"{param} is not supported: usage comes in the last chunk")
    return bool(stream_options.get("include_usage"))


def _check_choices(sampling: Sampling, prompts: int, limits: Limits) -> None:
    params = sampling.params
    width = max(params.num_samples, params.beam_width)
    if prompts * width > limits.max_choices:
        raise bad_request("n", f"{prompts} prompt(s) x {width} sequences each is more than the "
                               f"{limits.max_choices} this server computes for one request")


def _prompts(prompt: object) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: a text, texts, token ids, lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt", "prompt must be a string, a list of strings, a list of "
                                    "token ids or a list of such lists, and not empty")
    if all(_is_int(t) for t in prompt):
        return [list(prompt)]
    prompts: list[str | list[int]] = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            prompts.append(list(item))
        else:
            raise bad_request("prompt", f"prompt[{index}] must be a non-empty string or list of "
                                        "token ids")
    return prompts


def _stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if (not isinstance(strings, list) or len(strings) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in strings)):
        raise bad_request("stop", f"stop must be a string or a list of at most "
                                  f"{MAX_STOP_STRINGS} non-empty strings of at most "
                                  f"{MAX_STOP_CHARS} characters")
    return tuple(strings)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(name, f"{name} must be an integer, got {value!r}")
    return int(value)


def _int_list(body: Mapping[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise bad_request(name, f"{name} must be a list of integers")
    return list(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be true or false, got {value!r}")
    return value
