"""`pagedkv serve --chat-template`: the Jinja template the chat endpoint renders messages with,
instead of the tokenizer's own (a tokenizer without one can then chat).

    template = load_chat_template("/etc/pagedkv/chatml.jinja")     # a file
    template = load_chat_template("{% for m in messages %}...")   # or the template itself
    use_chat_template(tokenizer, template, no_tokenizer)   # ValueError when there is none

As vLLM reads its --chat-template: a value holding a Jinja character ("{", "}") or a newline is
the template itself, anything else a path to a file holding it. The template is compiled at
start-up, so a malformed one fails the start (exit 2) instead of every chat request.
"""

from pathlib import Path
from typing import cast

from pagedkv.llm.tokenizer import Tokenizer
from pagedkv.server.chat import ChatTokenizer

# Characters only an inline template holds (vLLM's rule for telling it from a path).
INLINE_MARKERS = ("{", "}", "\n")


def load_chat_template(value: str) -> str:
    """The template `value` gives, inline or from its file; ValueError naming --chat-template
    when the file cannot be read or the template does not compile."""
    if any(marker in value for marker in INLINE_MARKERS):
        template = value
    else:
        try:
            template = Path(value).expanduser().read_text()
        except OSError as exc:
            raise ValueError(f"--chat-template: {value!r} is neither a template nor a readable "
                             f"file ({exc.strerror})") from exc
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # transformers renders chat templates in this environment
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: the template does not compile: {exc}") from exc
    return template


def use_chat_template(tokenizer: Tokenizer | None, template: str, no_tokenizer: str) -> None:
    """Make `template` the one `tokenizer` renders chats with (server/chat.py reads the
    tokenizer's chat_template); ValueError when there is no tokenizer (`no_tokenizer`: why)."""
    if tokenizer is None:
        raise ValueError(f"--chat-template needs a tokenizer, but {no_tokenizer}")
    # transformers' apply_chat_template renders the tokenizer's chat_template attribute.
    cast(ChatTokenizer, tokenizer).chat_template = template
