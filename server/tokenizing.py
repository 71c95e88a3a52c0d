"""POST /tokenize and POST /detokenize: the served model's tokenizer, in vLLM's shapes.

    {"prompt": "the cat", "add_special_tokens": true, "return_token_strs": false}
    {"messages": [...], "add_generation_prompt": true}        (through the chat template)
        -> {"count": 2, "max_model_len": 256, "tokens": [5, 9], "token_strs": null}
    {"tokens": [5, 9]} -> {"prompt": "the cat"}

`model` is checked as on /v1/ routes. A preset model (token ids only) has no tokenizer: both
routes answer 400 saying why.
"""

from typing import Any, Protocol, cast

from aiohttp import web

from pagedkv.llm.tokenizer import Tokenizer
from pagedkv.server.backend import Backend
from pagedkv.server.chat import render_chat
from pagedkv.server.errors import ApiError, bad_request, from_value_error
from pagedkv.server.generation import token_string
from pagedkv.server.protocol import Limits


async def tokenize(request: web.Request, backend: Backend, body: dict[str, Any],
                   limits: Limits) -> web.StreamResponse:
    tokenizer = _tokenizer(backend, body)
    strings = _flag(body, "return_token_strs", False)
    if "messages" in body:
        try:
            tokens = render_chat(tokenizer, body["messages"],
                                 add_generation_prompt=_flag(body, "add_generation_prompt", True))
        except ValueError as exc:
            raise from_value_error(exc) from exc
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("prompt", "prompt must be a string (or send messages)")
        tokens = _encode(tokenizer, prompt, _flag(body, "add_special_tokens", True))
    return web.json_response({
        "count": len(tokens), "max_model_len": limits.max_model_len, "tokens": tokens,
        "token_strs": [token_string(tokenizer, t) for t in tokens] if strings else None})


async def detokenize(request: web.Request, backend: Backend, body: dict[str, Any],
                     limits: Limits) -> web.StreamResponse:
    tokenizer = _tokenizer(backend, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise bad_request("tokens", "tokens must be a list of token ids")
    if any(not 0 <= t < len(tokenizer) for t in tokens):
        raise bad_request("tokens", f"tokens must be ids in [0, {len(tokenizer)}), the "
                                    "tokenizer's vocabulary")
    return web.json_response({"prompt": tokenizer.decode(tokens)})


def _tokenizer(backend: Backend, body: dict[str, Any]) -> Tokenizer:
    """The served model's tokenizer, once `model` names the served model."""
    backend.check_model(body["model"])
    if backend.tokenizer is None:
        raise ApiError(400, f"tokenizing needs a tokenizer, but {backend.no_tokenizer}")
    return backend.tokenizer


class _SpecialTokens(Protocol):
    """A transformers tokenizer's encode, which adds its special tokens (BOS) or not."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...


def _encode(tokenizer: Tokenizer, prompt: str, special: bool) -> list[int]:
    """`prompt`'s ids, with the tokenizer's special tokens when `special`, as vLLM's."""
    return list(cast(_SpecialTokens, tokenizer).encode(prompt, add_special_tokens=special))


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be true or false, got {value!r}")
    return value
