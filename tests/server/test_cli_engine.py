"""`pagedkv serve` with vLLM's engine flags, as a real process through the real `openai` client:
the issue's line (a positional model, --max-model-len, --gpu-memory-utilization,
--enable-prefix-caching) serves; every --served-model-name is a model; --chat-template lets a
tokenizer without a template chat; $PAGEDKV_API_KEY is a key clients must send."""

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from pagedkvd_process import short_tmp_dir, start_serve

KEY = "sk-from-the-environment"
NAMES = ("first-name", "second-name")
# A template the model folder's tokenizer lacks (make_model_dir saves none).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "the cat sat on"}]


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The issue's line, with two served names, a template file and the key in the
    environment (8 sequences: the pool is sized to them)."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with short_tmp_dir() as folder:
        process, port = start_serve(
            folder, str(model_dir), "--max-model-len", "256", "--gpu-memory-utilization", "0.5",
            "--enable-prefix-caching", "--max-num-seqs", "8", "--served-model-name", NAMES[0],
            "--served-model-name", NAMES[1], "--chat-template", str(template),
            env={"PAGEDKV_API_KEY": KEY})
        try:
            yield port
        finally:
            assert process.stop() == 0, process.stderr()


@pytest.fixture(scope="module")
def client(server: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0)


def test_every_served_name_is_a_model_and_the_first_is_reported(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [model.id for model in models] == list(NAMES)
    assert {model.model_extra["max_model_len"] for model in models  # type: ignore[index]
            if model.model_extra} == {256}
    for name in NAMES:
        out = client.completions.create(model=name, prompt="the cat", max_tokens=2,
                                        temperature=0)
        assert out.model == name and out.usage is not None
        assert out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError, match="serves `first-name`, `second-name`"):
        client.completions.create(model="other", prompt="the cat", max_tokens=2)


def models_status(port: int, headers: dict[str, str]) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_key_of_the_environment_is_required(server: int) -> None:
    assert models_status(server, {}) == 401
    assert models_status(server, {"Authorization": f"Bearer {KEY}"}) == 200


def test_max_model_len_bounds_prompt_and_completion(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="exceed the model's 256 positions"):
        client.completions.create(model=NAMES[0], prompt=[5] * 250, max_tokens=10)
    out = client.completions.create(model=NAMES[0], prompt=[5] * 250, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens <= 6


def test_the_chat_template_flag_renders_the_chat(client: openai.OpenAI,
                                                 tokenizer: PreTrainedTokenizerFast) -> None:
    assert not tokenizer.chat_template
    out = client.chat.completions.create(model=NAMES[0], messages=MESSAGES,  # type: ignore[arg-type]
                                         max_tokens=3, temperature=0)
    rendered = "user: the cat sat on\nassistant:"
    assert out.usage is not None and out.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert out.choices[0].message.role == "assistant"
