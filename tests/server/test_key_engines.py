"""Every API key gets its share in `pagedkv serve` (server/key_engines.py), through the real
`openai` client against a server process that starts its own daemon and runner (the tiny-llama
preset, token-id prompts, 16-slot blocks):

- a key cannot read another key's prompt through the prefix cache (`cached_tokens` of a guess),
  keys the operator groups do share it, and /metrics carries no prefix-cache figures;
- a key flooding the server does not keep another key's request behind its queue, and its
  request past --max-waiting-per-key gets 429 naming the setting.
"""

import contextlib
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import openai
import pytest

from pagedkv.server.key_engines import parse_keys

from metrics_text import sample_value
from pagedkvd_process import short_tmp_dir, start_serve

MODEL = "tiny-llama"
SECRET = [(17 * i) % 200 + 3 for i in range(64)]  # four full blocks


@contextlib.contextmanager
def served(*args: str) -> Iterator[int]:
    """A server started with `args`, stopped at the end; its port."""
    with short_tmp_dir() as folder:
        process, port = start_serve(folder, "--model", MODEL, *args)
        try:
            yield port
        finally:
            assert process.stop() == 0, process.stderr()


def client(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def cached(port: int, key: str, prompt: list[int]) -> int:
    out = client(port, key).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def test_a_key_reads_only_its_own_groups_cache() -> None:
    with served("--num-blocks", "64", "--api-key", "sk-a", "--api-key", "sk-b",
                "--api-key", "sk-c team", "--api-key", "sk-d team") as port:
        check_cache_groups(port)


def check_cache_groups(serve: int) -> None:
    assert cached(serve, "sk-a", SECRET) == 0
    assert cached(serve, "sk-a", SECRET[:48]) == 48  # a key's own cache serves it
    assert cached(serve, "sk-b", SECRET[:16]) == 0  # another key's guess learns nothing
    assert cached(serve, "sk-b", SECRET[:48]) == 16  # (its own first guess is cached)
    assert cached(serve, "sk-c", SECRET) == 0
    assert cached(serve, "sk-d", SECRET[:48]) == 48  # the operator grouped c and d
    text = metrics(serve)
    assert "pagedkv:prefix_cache_hits" not in text and "prefix_cache_queries" not in text
    assert sample_value(text, "pagedkv:num_requests_running") == 0


def test_key_lines_name_their_group_and_are_checked() -> None:
    a, c, d = parse_keys(["sk-a", "sk-c team", "sk-d team"])
    assert (a.name, a.group, a.salt) == ("key-0", "key-0", b"")
    assert c.group == d.group == "team" and c.salt == d.salt == b"pagedkv-serve:team"
    with pytest.raises(ValueError, match="`KEY` or `KEY GROUP`"):
        parse_keys(["sk-a team extra"])
    with pytest.raises(ValueError, match="given twice"):
        parse_keys(["sk-a", "sk-a team"])


def test_a_flooding_key_does_not_hold_another_keys_request() -> None:
    """A's two long streams take the two sequence slots of its engine; three more wait; B's
    one-token request is answered before any of those three starts (before: behind them)."""
    with served("--num-blocks", "256", "--max-num-seqs", "2", "--api-key", "sk-a",
                "--api-key", "sk-b", "--max-waiting-per-key", "3") as port:
        check_flood(port)


def check_flood(serve: int) -> None:
    first_token: dict[int, float] = {}

    def flood(index: int) -> None:
        stream = client(serve, "sk-a").completions.create(
            model=MODEL, prompt=[index + 3] * 4, max_tokens=1000, temperature=0, stream=True)
        for _ in stream:
            first_token.setdefault(index, time.monotonic())

    with ThreadPoolExecutor(5) as pool:
        floods: list[Future[None]] = []
        for index in range(5):  # two run, then three wait (A's cap of waiting requests)
            floods.append(pool.submit(flood, index))
            wait_for(lambda n=index + 1: gauge(serve, "waiting") + gauge(serve, "running") == n)
        wait_for(lambda: gauge(serve, "waiting") == 3)
        with pytest.raises(openai.RateLimitError) as refused:
            client(serve, "sk-a").completions.create(model=MODEL, prompt=[5], max_tokens=1)
        assert "--max-waiting-per-key" in refused.value.message
        assert refused.value.body["code"] == 429  # type: ignore[index]
        out = client(serve, "sk-b").completions.create(model=MODEL, prompt=[9, 8, 7],
                                                       max_tokens=1)
        done = time.monotonic()
        assert out.choices[0].finish_reason == "length"
        queued_before_b = [i for i in range(2, 5) if first_token.get(i, done + 1) < done]
        assert queued_before_b == []  # B's request went first: no queued one of A's started
        for future in floods:
            future.result(timeout=120)


def gauge(port: int, name: str) -> float:
    return sample_value(metrics(port), f"pagedkv:num_requests_{name}")


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
