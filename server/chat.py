"""A chat request's messages as prompt token ids, through the model's chat template.

The messages come from the request body unchecked: each is checked here, and a bad one is a
ValueError whose message starts with its path in the body ("messages[2].content[0].type: ..."),
which the server maps to a 400 naming that field. Only text is supported: a content part of
another type (an image, audio) is refused. Parts are joined with newlines, as vLLM does for a
template that takes string content. The template sees each message's role and content only.
"""

from collections.abc import Sequence
from typing import Protocol, cast

from pagedkv.llm.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


class ChatTokenizer(Protocol):
    """What rendering uses of a transformers tokenizer."""

    chat_template: str | dict[str, str] | None

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool, return_dict: bool) -> list[int]: ...


def render_chat(tokenizer: Tokenizer, messages: Sequence[object], *,
                add_generation_prompt: bool = True) -> list[int]:
    """The prompt token ids of `messages` through the tokenizer's chat template (opening the
    assistant's turn when `add_generation_prompt`); ValueError naming the field for a message
    of a shape not supported, or when the tokenizer has no chat template."""
    conversation = check_messages(messages)
    chat = cast(ChatTokenizer, tokenizer)
    if not getattr(chat, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: use /v1/completions")
    from jinja2 import TemplateError

    try:
        ids = chat.apply_chat_template(conversation, tokenize=True, return_dict=False,
                                       add_generation_prompt=add_generation_prompt)
    except TemplateError as exc:  # the template's own raise_exception("...")
        raise ValueError(f"messages: the model's chat template refused them: {exc}") from exc
    return [int(token_id) for token_id in ids]


def check_messages(messages: object) -> list[dict[str, str]]:
    """The messages as the template takes them ({"role", "content"} strings each), checked."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of messages")
    return [_check_message(message, f"messages[{index}]")
            for index, message in enumerate(messages)]


def _check_message(message: object, path: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise ValueError(f"{path}: must be an object with a role and a content")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"{path}.role: must be one of {', '.join(ROLES)}, not {role!r}")
    return {"role": role, "content": _content_text(message.get("content"), f"{path}.content")}


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
