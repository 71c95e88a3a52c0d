"""A chat request's messages as prompt token ids, through the model's chat template.

The messages come from the request body unchecked: each is checked here, and a bad one is a
ValueError whose message starts with its path in the body ("messages[2].content[0].type: ..."),
which the server maps to a 400 naming that field. Only text is supported: a content part of
another type (an image, audio) is refused. Parts are joined with newlines, as vLLM does for a
template that takes string content. The template sees each message's role and content, an
assistant message's `tool_calls` (their arguments as objects, as vLLM hands them to templates,
which write them with `tojson`), a tool message's `tool_call_id`, and the request's tools and
chat_template_kwargs (a key that is an argument of `apply_chat_template` itself is refused).
"""

import inspect
import json
from collections.abc import Sequence
from typing import Any, Protocol, cast

from pagedkv.llm.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


class ChatTokenizer(Protocol):
    """What rendering uses of a transformers tokenizer."""

    chat_template: str | dict[str, str] | None

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, tokenize: bool,
                            add_generation_prompt: bool, return_dict: bool,
                            **kwargs: Any) -> list[int]: ...


def render_chat(tokenizer: Tokenizer, messages: Sequence[object], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt token ids of `messages` through the tokenizer's chat template (opening the
    assistant's turn when `add_generation_prompt`, leaving the last message open when
    `continue_final_message`), the template given `tools` and `template_kwargs`; ValueError
    naming the field for a message of a shape not supported, or when the tokenizer has no chat
    template."""
    conversation = check_messages(messages)
    chat = cast(ChatTokenizer, tokenizer)
    if not getattr(chat, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: use /v1/completions")
    kwargs = dict(template_kwargs or {})
    reserved = set(inspect.signature(chat.apply_chat_template).parameters) | {"messages"}
    for key in kwargs:
        if key in reserved:
            raise ValueError(f"chat_template_kwargs.{key}: is set by the server (send the "
                             "request's own field instead)")
    from jinja2 import TemplateError

    try:
        ids = chat.apply_chat_template(conversation, tokenize=True, return_dict=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       tools=tools, **kwargs)
    except (TemplateError, ValueError) as exc:  # the template's own raise_exception("...")
        raise ValueError(f"messages: the model's chat template refused them: {exc}") from exc
    return [int(token_id) for token_id in ids]


def check_messages(messages: object) -> list[dict[str, Any]]:
    """The messages as the template takes them, checked."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of messages")
    return [_check_message(message, f"messages[{index}]")
            for index, message in enumerate(messages)]


def _check_message(message: object, path: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ValueError(f"{path}: must be an object with a role and a content")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"{path}.role: must be one of {', '.join(ROLES)}, not {role!r}")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise ValueError(f"{path}.tool_calls: only an assistant message makes tool calls")
    content = message.get("content")
    checked: dict[str, Any] = {"role": role, "content": (
        "" if content is None and calls else _content_text(content, f"{path}.content"))}
    if calls is not None:
        checked["tool_calls"] = _tool_calls(calls, f"{path}.tool_calls")
    if role == "tool" and message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise ValueError(f"{path}.tool_call_id: must be a string")
        checked["tool_call_id"] = message["tool_call_id"]
    return checked


def _tool_calls(calls: object, path: str) -> list[dict[str, Any]]:
    """An assistant message's calls, their arguments read into objects for the template."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{path}: must be a non-empty list of tool calls")
    checked = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise ValueError(f"{path}[{index}].function: must be an object with a name and "
                             "arguments (JSON text)")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise ValueError(f"{path}[{index}].function.arguments: is not valid JSON") from None
        checked.append({"id": call.get("id"), "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


def _content_text(content: object, path: str) -> str:
    """A message's content: a string, or a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{path}: must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        part_path = f"{path}[{index}]"
        if not isinstance(part, dict):
            raise ValueError(f"{part_path}: must be an object with a type and a text")
        if part.get("type") != "text":
            raise ValueError(f"{part_path}.type: only text parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{part_path}.text: must be a string")
        texts.append(text)
    return "\n".join(texts)
