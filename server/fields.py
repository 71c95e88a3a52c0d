"""Every top-level field a request body may carry: honoured, or refused with a 400 naming it.

    check_fields(body, CHAT)            # ApiError(400, param=<field>) for one not honoured

The rule: a field the server accepts changes the answer as OpenAI and vLLM define it, or is
documented as inert (`user`, `safety_identifier`, `prompt_cache_key` label the request for
OpenAI's own monitoring and routing: the output does not depend on them). A field of OpenAI's
or vLLM's schemas that pagedkv does not honour (REFUSED) is accepted only with a value that
changes nothing (null, its default), else refused naming it and why. A field in neither schema
is refused as OpenAI's API refuses it ("Unrecognized request argument"): vLLM ignores it with a
warning, but a misspelt `guided_jsn` would then give free text with a 200.
"""

import json
from collections.abc import Mapping
from typing import Any

from pagedkv.server.errors import bad_request

COMPLETION = "completion"
CHAT = "chat"
# Honoured by both endpoints (protocol.py, structured.py).
BOTH = frozenset({
    "model", "stream", "stream_options", "temperature", "top_p", "n", "seed", "stop",
    "max_tokens", "presence_penalty", "frequency_penalty", "best_of", "logprobs", "top_k",
    "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "use_beam_search",
    "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "user", "safety_identifier", "prompt_cache_key"})
HONOURED = {
    COMPLETION: BOTH | {"prompt", "echo", "return_token_ids"},
    CHAT: BOTH | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                  "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
                  "chat_template_kwargs"},
}
# Labels with no effect on the output: any string is accepted.
INERT_STRINGS = ("user", "safety_identifier", "prompt_cache_key")
_TEXT_ONLY = "pagedkv serves text only"
_NOT_STORED = "pagedkv stores no completions"
# Known fields not honoured: the values that change nothing (null always does), and why.
REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "logit_bias": (({},), "the sampler has no logit bias"),
    "suffix": (("",), "there is no fill-in-the-middle"),
    "prompt_logprobs": ((), "prompt logprobs are not computed"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "truncate_prompt_tokens": ((), "prompts are not truncated: send a shorter one"),
    "allowed_token_ids": ((), "the sampler cannot restrict the vocabulary: use "
                              "structured_outputs.choice or .regex"),
    "bad_words": (([],), "the sampler bans no words"),
    "spaces_between_special_tokens": ((True,), "decoding keeps the tokenizer's spacing"),
    "priority": ((0,), "requests are served first come first served, as vLLM's default "
                       "scheduler refuses it"),
    "request_id": ((), "the request id is the X-Request-Id header"),
    "logits_processors": (([],), "no logits processors are loaded"),
    "return_tokens_as_token_ids": ((False,), "logprobs show each token's text"),
    "cache_salt": ((), "the prefix cache is salted per API key group (--api-key-file)"),
    "kv_transfer_params": ((), "there is no disaggregated prefill"),
    "vllm_xargs": (({},), "no extension reads them"),
    "guided_decoding_backend": (("xgrammar", "auto"), "the grammar engine is xgrammar"),
    "guided_whitespace_pattern": ((), "xgrammar's JSON whitespace is not configurable"),
    "structural_tag": ((), "structural tags are not supported"),
    "mm_processor_kwargs": ((), _TEXT_ONLY),
    "media_io_kwargs": ((), _TEXT_ONLY),
    "modalities": ((["text"],), _TEXT_ONLY),
    "audio": ((), _TEXT_ONLY),
    "include_reasoning": ((True,), "there is no reasoning parser: reasoning stays in content"),
    "reasoning_effort": ((), "the model's reasoning is not configurable"),
    "verbosity": ((), "the model's verbosity is not configurable"),
    "store": ((False,), _NOT_STORED),
    "metadata": (({},), _NOT_STORED),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "prediction": ((), "there are no predicted outputs"),
    "web_search_options": ((), "there is no web search"),
    "moderation": ((), "there is no moderation"),
    "prompt_cache_retention": ((), "the prefix cache keeps blocks while the pool has room"),
    "prompt_cache_options": ((), "the prefix cache keeps blocks while the pool has room"),
    "functions": (([],), "the legacy function fields are not mapped: send tools"),
    "function_call": (("none",), "the legacy function fields are not mapped: send "
                                 "tool_choice"),
    "chat_template": ((), "a request's template would run on the server: start the server "
                          "with --chat-template"),
    "documents": ((), "templates get no documents"),
    "echo": ((False,), "a chat answer does not repeat the last message"),
    "return_token_ids": ((False,), "a chat answer carries no token ids"),
}
# add_special_tokens: the default of each endpoint is what it does (completions encode with
# the tokenizer's special tokens; the chat template puts its own).
ADD_SPECIAL_TOKENS = {COMPLETION: True, CHAT: False}


def check_fields(body: Mapping[str, Any], endpoint: str) -> None:
    """A 400 naming the first field of `body` that the endpoint does not honour."""
    honoured = HONOURED[endpoint]
    for name, value in body.items():
        if name in honoured:
            if name in INERT_STRINGS and value is not None and not isinstance(value, str):
                raise bad_request(name, f"{name} must be a string")
        elif name == "add_special_tokens":
            _check_inert(name, value, (ADD_SPECIAL_TOKENS[endpoint],),
                         "prompts are encoded as the endpoint's default does")
        elif name in REFUSED:
            _check_inert(name, value, *REFUSED[name])
        else:
            raise bad_request(name, f"Unrecognized request argument supplied: {name}")


def _check_inert(name: str, value: object, inert: tuple[object, ...], why: str) -> None:
    if value is None or any(value == v and type(value) is type(v) for v in inert):
        return
    accepted = " or ".join(json.dumps(v) for v in inert)
    allowed = f"leave it out or send {accepted}" if accepted else "leave it out"
    raise bad_request(name, f"{name} is not supported ({why}): {allowed}")
