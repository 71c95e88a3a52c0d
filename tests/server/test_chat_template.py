"""--chat-template read as vLLM reads it: inline when it holds a Jinja character or a newline,
else a file; a malformed template or a missing file fails with the flag named."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedkv.server.chat_template import load_chat_template, use_chat_template

INLINE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_inline_and_file_templates(tmp_path: Path) -> None:
    assert load_chat_template(INLINE) == INLINE
    file = tmp_path / "chat.jinja"
    file.write_text(INLINE)
    assert load_chat_template(str(file)) == INLINE


@pytest.mark.parametrize("value, message", [
    ("/no/such/template.jinja", "--chat-template: '/no/such/template.jinja' is neither a "
                                "template nor a readable file"),
    ("{% for m in messages %}", "--chat-template: the template does not compile"),
])
def test_bad_templates_are_refused_naming_the_flag(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_chat_template(value)


def test_the_template_replaces_the_tokenizers_and_needs_one() -> None:
    tokenizer = SimpleNamespace(chat_template=None)
    use_chat_template(tokenizer, INLINE, "")  # type: ignore[arg-type]
    assert tokenizer.chat_template == INLINE
    with pytest.raises(ValueError, match="--chat-template needs a tokenizer, but the preset"):
        use_chat_template(None, INLINE, "the preset 'tiny' has random weights and no tokenizer")
