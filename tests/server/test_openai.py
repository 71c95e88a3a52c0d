"""`pagedkv serve` through the real `openai` client: a server process (which starts its own
daemon and runner) on a model folder made here (random Llama, a byte-level BPE tokenizer with a
chat template trained here), against transformers' own generate on the same weights.
"""

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from pagedkv.process.launch import Launched

from chat_model import EOS_PROMPT, hf_generate, make_chat_model_dir
from metrics_text import sample_value
from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd, short_tmp_dir, start_serve

try:  # the http client the openai package is built on: httpx2 from openai 3, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx  # type: ignore[no-redef]

KEY = "sk-test-key"
NAME = "chat-model"
PROMPT = "the cat sat on"
LONG_PROMPT = "the quick brown fox jumps over the lazy dog, " * 3  # > two 16-token blocks


def http_get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """GET `path` of the server: status and body."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat-model")
    make_chat_model_dir(folder)
    return folder


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[int]:
    """The server under test (its port): API key KEY, a 4 MiB pool, 8 sequences at once."""
    with short_tmp_dir() as folder:
        process, port = start_serve(folder, "--model", str(model_dir), "--served-model-name",
                                     NAME, "--api-key", KEY, "--kv-cache-memory", "4MiB",
                                     "--max-num-seqs", "8")
        try:
            yield port
        finally:
            assert process.stop() == 0, process.stderr()


@pytest.fixture(scope="module")
def client(server: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0)


def greedy_text(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                prompt_ids: list[int], n: int) -> str:
    tokens = hf_generate(reference, prompt_ids, max_new_tokens=n, do_sample=False)[0]
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def test_greedy_completion_equals_transformers(client: openai.OpenAI,
                                               reference: PreTrainedModel,
                                               tokenizer: PreTrainedTokenizerFast) -> None:
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy_text(reference, tokenizer, tokenizer.encode(PROMPT), 8)
    assert out.usage is not None and out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"


def test_streamed_text_equals_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_streamed_text_offsets_count_from_the_start(client: openai.OpenAI) -> None:
    """Each token's text_offset is where it starts in the whole text (vLLM's), not in its
    chunk: the streamed offsets are the whole answer's."""
    options: dict[str, Any] = dict(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                   logprobs=0, echo=False)
    whole = client.completions.create(**options).choices[0].logprobs
    streamed = [offset for chunk in client.completions.create(**options, stream=True)
                for offset in (chunk.choices[0].logprobs.text_offset or []
                               if chunk.choices and chunk.choices[0].logprobs else [])]
    assert whole is not None and whole.text_offset is not None
    assert len(whole.text_offset) == 6 and streamed == whole.text_offset


def test_chat_equals_transformers_on_the_rendered_template(
        client: openai.OpenAI, reference: PreTrainedModel,
        tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    expected = greedy_text(reference, tokenizer, list(prompt_ids), 6)
    out = client.chat.completions.create(model=NAME, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=6, temperature=0)
    assert out.choices[0].message.content == expected
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages,  # type: ignore
                                            max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_token_id_prompts_and_n_number_the_choices(client: openai.OpenAI) -> None:
    ids = [5, 6, 7, 8]
    out = client.completions.create(model=NAME, prompt=[ids, [9, 10, 11]], max_tokens=4, n=2,
                                    temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage is not None and out.usage.prompt_tokens == 7
    assert out.usage.completion_tokens == 16


def test_seed_reproduces_a_sample(client: openai.OpenAI) -> None:
    def sample() -> str:
        out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10,
                                        temperature=1.0, seed=1234)
        return out.choices[0].text

    assert sample() == sample()


def test_logprobs_are_the_models(client: openai.OpenAI, reference: PreTrainedModel,
                                 tokenizer: PreTrainedTokenizerFast) -> None:
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=2)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 3
    with torch.no_grad():
        logits = reference(torch.tensor([tokenizer.encode(PROMPT)])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1).max().item()
    assert logprobs.token_logprobs[0] == pytest.approx(expected, abs=1e-3)
    assert logprobs.top_logprobs is not None and 1 <= len(logprobs.top_logprobs[0]) <= 3
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 3
    assert all(len(entry.top_logprobs) == 2 for entry in content.content)


def test_a_stop_string_across_tokens_cuts_the_text(client: openai.OpenAI,
                                                   tokenizer: PreTrainedTokenizerFast) -> None:
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    text = full.choices[0].text
    ids = tokenizer.encode(text)
    # The stop string: the last character of the 2nd token's text and the first of the 3rd.
    boundary = len(tokenizer.decode(ids[:2]))
    stop = text[boundary - 1:boundary + 1]
    assert len(stop) == 2
    for stream in (False, True):
        out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                        temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = [c for c in out if c.choices]  # type: ignore[union-attr]
            cut = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            cut, reason = out.choices[0].text, out.choices[0].finish_reason  # type: ignore
        assert cut == text[:text.index(stop)] and reason == "stop"


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True)
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_a_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    def cached() -> int:
        out = client.completions.create(model=NAME, prompt=LONG_PROMPT, max_tokens=2,
                                        temperature=0)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    cached()
    assert cached() >= 16  # at least one full block of the prompt came from the cache


def test_bad_parameters_name_the_field(client: openai.OpenAI) -> None:
    cases = [({"temperature": -1}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
             ({"top_p": 2}, "top_p"), ({"presence_penalty": 3}, "presence_penalty"),
             ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop"),
             ({"n": 1000}, "n"), ({"prompt": [[1, 2], [10**6]]}, "prompt[1]")]
    for extra, field in cases:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**body)  # type: ignore[call-overload]
        assert caught.value.param == field, (extra, caught.value.message)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])
    assert "messages[0].role" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)


def test_ignore_eos_runs_every_choice_to_max_tokens(client: openai.OpenAI) -> None:
    """EOS_PROMPT ends greedily with the model's <eos> (id 0) after a few tokens; with
    ignore_eos every choice runs to max_tokens past it, and an explicit stop token still stops."""
    def choices(**extra: Any) -> list[Any]:
        out = client.completions.create(model=NAME, prompt=EOS_PROMPT, max_tokens=12, n=4,
                                        temperature=0,
                                        extra_body={"return_token_ids": True, **extra})
        return list(out.choices)

    stopped = choices()
    assert {c.finish_reason for c in stopped} == {"stop"}
    assert all(c.token_ids[-1] == 0 and len(c.token_ids) < 12 for c in stopped)
    ignored = choices(ignore_eos=True)
    assert {c.finish_reason for c in ignored} == {"length"}
    assert all(len(c.token_ids) == 12 and 0 in c.token_ids for c in ignored)
    explicit = choices(ignore_eos=True, stop_token_ids=[0])
    assert [c.token_ids for c in explicit] == [c.token_ids for c in stopped]
    assert {c.finish_reason for c in explicit} == {"stop"}


def test_the_legacy_function_fields_are_a_400_naming_them(client: openai.OpenAI) -> None:
    """functions and function_call are refused (not answered with free text): their answer
    would be `message.function_call`, which pagedkv does not build. Values that change
    nothing pass."""
    cases: list[tuple[str, Any]] = [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("function_call", "auto")]
    messages: Any = [{"role": "user", "content": "hello"}]
    for field, value in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=2,
                                           **{field: value})
        assert caught.value.param == field, caught.value.message
        assert "legacy function fields" in caught.value.message
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2,
                                           response_format={"type": "text"}, tool_choice="none")
    assert plain.choices[0].finish_reason == "length"


def test_the_api_key_is_required(server: int) -> None:
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="sk-wrong",
                          max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=NAME, prompt=PROMPT, max_tokens=1)
    assert http_get(server, "/health")[0] == 200  # probes need no key
    status, body = http_get(server, "/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == NAME


def test_clients_gone_mid_stream_free_their_requests_and_blocks(client: openai.OpenAI,
                                                                server: int) -> None:
    streams = [client.completions.create(model=NAME, prompt=PROMPT * (n + 1), max_tokens=400,
                                         temperature=0, stream=True) for n in range(3)]
    for stream in streams:
        for index, _ in enumerate(stream):
            if index == 2:
                break
    # The pool's usage, not the figure of an engine's last answer: the key's engine holds the
    # streams' blocks (and the runner steps them into reserved slots without a daemon call).
    assert metric(server, "pagedkv:kv_cache_usage_perc") > 0
    for stream in streams:
        stream.close()  # the connection goes: the server aborts the request
    deadline = time.monotonic() + 30
    while metric(server, "pagedkv:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the abandoned request still runs"
        time.sleep(0.05)
    assert metric(server, "pagedkv:request_success_total", finished_reason="abort") >= 1
    # Their blocks are freed, and the usage says so with no request after them.
    while metric(server, "pagedkv:kv_cache_usage_perc") != 0:
        assert time.monotonic() < deadline, "kv_cache_usage_perc stays above 0 after an abort"
        time.sleep(0.05)


def metric(port: int, name: str, **labels: str) -> float:
    """The value of the series `name` with `labels` (among others) in the server's /metrics."""
    return sample_value(http_get(port, "/metrics")[1], name, **labels)


def test_metrics_use_vllms_names(server: int) -> None:
    text = http_get(server, "/metrics")[1]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "generation_tokens_total"):
        assert f"pagedkv:{name}" in text, name
    # With API keys, the prefix cache's figures are each key's own (its usage), not /metrics'.
    assert "pagedkv:prefix_cache_hits" not in text


def preset_client(port: int, source: str = "127.0.0.1") -> openai.OpenAI:
    """A client of a preset server, connecting from the loopback address `source`."""
    transport = httpx.HTTPTransport(local_address=source)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(transport=transport, timeout=60))


@pytest.fixture(scope="module")
def preset_stack() -> Iterator[tuple[Pagedkvd, Pagedkvd]]:
    """A daemon of 12 blocks of 16 slots laid out for the tiny-llama preset, and a runner of it:
    the preset servers below are started on it (`--daemon`, `--runner`), each with its own
    engine session, and stopped by their test; the module's `server` is the one that starts
    its own daemon and runner."""
    with pagedkvd("--model-config", "tiny-llama", "--num-blocks", "12", "--block-size",
                  "16") as daemon, \
            pagedkv_runner(daemon, "--random-init", "tiny-llama", "--seed", "0") as runner:
        yield daemon, runner


def start_preset_server(folder: Path, stack: tuple[Pagedkvd, Pagedkvd],
                        *args: str) -> tuple[Launched, int]:
    """`pagedkv serve --model tiny-llama` with `args` on the daemon and runner of `stack`."""
    daemon, runner = stack
    return start_serve(folder, "--model", "tiny-llama", "--daemon", daemon.unix_target,
                        "--runner", runner.unix_target, *args)


def test_a_preset_refuses_text_bounds_peers_and_the_queue_then_sigterm_drains(
        preset_stack: tuple[Pagedkvd, Pagedkvd]) -> None:
    with short_tmp_dir() as folder:
        process, port = start_preset_server(folder, preset_stack, "--max-num-seqs", "1",
                                            "--max-waiting-requests", "1",
                                            "--max-requests-per-peer", "2")
        try:
            client = preset_client(port)
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model="tiny-llama", prompt="text", max_tokens=1)
            assert caught.value.param == "prompt" and "token ids" in caught.value.message
            running = client.completions.create(model="tiny-llama", prompt=[1, 2, 3],
                                                max_tokens=150, temperature=0, stream=True)
            next(iter(running))  # admitted and generating: the one sequence slot is taken
            waiting = threading.Thread(target=client.completions.create, kwargs=dict(
                model="tiny-llama", prompt=[4, 5, 6], max_tokens=2))
            waiting.start()
            deadline = time.monotonic() + 30
            while metric(port, "pagedkv:num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            # This address has two requests in progress: its third is refused.
            with pytest.raises(openai.RateLimitError) as per_peer:
                client.completions.create(model="tiny-llama", prompt=[7], max_tokens=1)
            assert "from this address" in per_peer.value.message
            # Another address is within its bound, but the queue is full.
            with pytest.raises(openai.RateLimitError) as queue_full:
                preset_client(port, "127.0.0.2").completions.create(
                    model="tiny-llama", prompt=[7], max_tokens=1)
            assert "waiting for room" in queue_full.value.message
            assert queue_full.value.response.headers["Retry-After"] == "1"
            process.send(signal.SIGTERM)  # drains: the running streams finish
            rest = list(running)
            assert rest[-1].choices[0].finish_reason == "length"
            waiting.join(60)
            assert process.wait_for_exit() == 0
        finally:
            process.stop(signal.SIGKILL)


def test_a_full_pool_queues_and_preempts_and_every_request_finishes(
        preset_stack: tuple[Pagedkvd, Pagedkvd]) -> None:
    """12 blocks of 16 slots for 6 requests of 20 + 40 tokens (4 blocks each): requests wait,
    sequences are preempted and recomputed, and each ends with the tokens it has alone."""
    with short_tmp_dir() as folder:
        process, port = start_preset_server(folder, preset_stack)
        try:
            client = preset_client(port)

            def tokens(prompt: list[int]) -> list[int]:
                out = client.completions.create(model="tiny-llama", prompt=prompt,
                                                max_tokens=40, temperature=0,
                                                extra_body={"return_token_ids": True})
                assert out.choices[0].finish_reason == "length"
                return list(out.choices[0].token_ids)  # type: ignore[attr-defined]

            prompts = [[(7 * i + j) % 100 + 1 for j in range(20)] for i in range(6)]
            with ThreadPoolExecutor(6) as pool:
                together = list(pool.map(tokens, prompts))
            assert metric(port, "pagedkv:num_preemptions_total") > 0
            assert together == [tokens(prompt) for prompt in prompts]
        finally:
            assert process.stop() == 0


def test_a_body_over_the_bound_is_refused(server: int) -> None:
    body = json.dumps({"model": NAME, "prompt": "x" * (5 * 2**20)}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server}/v1/completions", data=body,
                                     headers={"Authorization": f"Bearer {KEY}",
                                              "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["code"] == 413


def test_sigterm_cuts_the_streams_still_running_at_the_drain_timeout() -> None:
    """--drain-timeout-s 0: the stream running at SIGTERM is cut (aborted) then, not left to
    run to its end under aiohttp's own 60 s shutdown grace."""
    with short_tmp_dir() as folder:
        process, port = start_serve(folder, "--model", "tiny-llama", "--num-blocks", "512",
                                     "--drain-timeout-s", "0")
        try:
            limit = json.loads(http_get(port, "/v1/models")[1])["data"][0]["max_model_len"]
            running = preset_client(port).completions.create(
                model="tiny-llama", prompt=[1, 2, 3], max_tokens=limit - 3, temperature=0,
                stream=True)
            chunks = iter(running)
            next(chunks)  # generating
            process.send(signal.SIGTERM)
            reasons = []
            with pytest.raises((httpx.HTTPError, openai.APIError)):
                for chunk in chunks:
                    reasons.append(chunk.choices[0].finish_reason)
            assert "length" not in reasons
            assert process.wait_for_exit() == 0
        finally:
            process.stop(signal.SIGKILL)
