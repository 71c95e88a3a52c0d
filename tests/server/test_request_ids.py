"""Request ids end to end, as real processes: `pagedkv serve --log-level debug` (which starts its
daemon and runner, logging into its own stderr) answers a request sent with `X-Request-Id:
abc-123`, and the runner's and the daemon's lines about that request's sequences name abc-123;
the prompts of one request share its id while the engine's names stay unique."""

import json
import urllib.request
from collections.abc import Iterator

import pytest

from pagedkv.process.launch import Launched

from pagedkvd_process import short_tmp_dir, start_serve


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Launched, int]]:
    """The preset tiny model (prompts as token ids), a small pool, everything at debug."""
    with short_tmp_dir() as folder:
        process, port = start_serve(folder, "--model", "tiny-llama", "--kv-cache-memory",
                                    "4MiB", "--max-num-seqs", "4", "--log-level", "debug")
        try:
            yield process, port
        finally:
            assert process.stop() == 0, process.stderr()


def complete(port: int, body: dict[str, object], request_id: str | None) -> tuple[str, dict]:
    """POST /v1/completions: the answer's X-Request-Id and body."""
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.headers["X-Request-Id"], json.loads(response.read())


def lines(process: Launched, event: str, request_id: str) -> list[dict[str, object]]:
    """The JSON lines of `event` naming `request_id`, from the server's stream (its children's
    lines included)."""
    found = []
    for text in process.stderr().splitlines():
        if text.startswith("{"):
            line = json.loads(text)
            if line["event"] == event and line.get("request_id") == request_id:
                found.append(line)
    return found


def test_the_http_id_reaches_the_runner_and_the_daemon_logs(
        server: tuple[Launched, int]) -> None:
    process, port = server
    echoed, answer = complete(port, {"model": "tiny-llama", "prompt": [5, 9, 17, 33],
                                     "max_tokens": 3}, "abc-123")
    assert echoed == "abc-123" and answer["id"] == "cmpl-abc-123"
    assert lines(process, "http_request", "abc-123")[0]["status"] == 200
    [admitted] = lines(process, "sequence admitted", "abc-123")
    assert admitted["logger"] == "pagedkv.runner" and admitted["num_tokens"] == 4
    [allocated] = lines(process, "sequence allocated", "abc-123")
    assert allocated["logger"] == "pagedkv.daemon.service.sequence_log"
    assert allocated["seq_id"] == admitted["seq_id"]
    assert lines(process, "sequence released", "abc-123")
    assert lines(process, "sequence freed", "abc-123")


def test_prompts_of_one_request_share_its_id_and_a_made_id_travels_too(
        server: tuple[Launched, int]) -> None:
    process, port = server
    _, answer = complete(port, {"model": "tiny-llama", "prompt": [[1, 2, 3], [4, 5, 6]],
                                "max_tokens": 2}, "batch-7")
    assert len(answer["choices"]) == 2  # the engine named them apart
    assert len(lines(process, "sequence allocated", "batch-7")) == 2
    made, _ = complete(port, {"model": "tiny-llama", "prompt": [7, 8], "max_tokens": 1}, None)
    assert lines(process, "sequence admitted", made)
    assert lines(process, "sequence allocated", made)
