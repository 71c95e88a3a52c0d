"""A model folder for tool calls and structured outputs: the random Llama of chat_model.py with
a tokenizer trained here on chat turns, JSON and hermes tool calls, and a Qwen2-style chat
template that renders `tools`, assistant `tool_calls` and `tool` messages (as Qwen2.5's does,
in a shorter form), and a `be_brief` template variable (chat_template_kwargs). Saved with
save_pretrained, so `pagedkv serve` and its runner load it as a user's folder is loaded.
"""

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from chat_model import SENTENCES, make_model_dir, train_tokenizer

# The name the tool server serves it as (tests/server/conftest.py).
TOOL_MODEL = "tool-model"

TOOL_SENTENCES = [
    '<|system|>You may call tools.<eos><|user|>weather in Paris?<eos><|assistant|><tool_call>'
    '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><eos>',
    '<|tool|>{"temperature": 21}<eos><|assistant|>It is 21 degrees.<eos>',
    '[{"name": "get_time", "parameters": {}}] {"ok": true, "color": "red"} null false 0123',
]
TOOL_TEMPLATE = (
    "{%- if be_brief %}<|system|>be brief<eos>{%- endif %}"
    "{%- if tools %}<|system|>You may call tools:{% for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<eos>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|assistant|>"
    "{{ message.content or '' }}{%- for call in message.tool_calls %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "</tool_call>{%- endfor %}<eos>"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}<eos>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}")


def tool_tokenizer() -> PreTrainedTokenizerFast:
    fast = train_tokenizer(SENTENCES + TOOL_SENTENCES)
    fast.chat_template = TOOL_TEMPLATE
    return fast


def make_tool_model_dir(folder: Path) -> None:
    """The random Llama with the tool tokenizer and its template, saved in `folder`."""
    make_model_dir(folder, tool_tokenizer())
