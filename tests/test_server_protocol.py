"""Request bodies read into typed requests (server/protocol.py), without a server: a bad field
is a 400 naming the field the client sent."""

import pytest

from pagedkv.server.errors import ApiError
from pagedkv.server.protocol import Limits, read_chat

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value", [0, "8", 1.5])
def test_a_bad_max_completion_tokens_names_that_field(value: object) -> None:
    with pytest.raises(ApiError) as refused:
        read_chat({"model": "m", "messages": MESSAGES, "max_completion_tokens": value},
                  Limits(max_model_len=64))
    assert refused.value.status == 400 and refused.value.param == "max_completion_tokens"
    assert refused.value.message.startswith("max_completion_tokens")


def test_max_completion_tokens_null_leaves_max_tokens() -> None:
    chat = read_chat({"model": "m", "messages": MESSAGES, "max_tokens": 5,
                      "max_completion_tokens": None}, Limits(max_model_len=64))
    assert chat.sampling.params.max_tokens == 5 and chat.sampling.max_tokens_given
