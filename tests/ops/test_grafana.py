"""ops/grafana/pagedkv.json queries only series pagedkv serves: every PromQL expression of the
dashboard, and its template variable's query, is read by a small PromQL tokenizer, and each
metric name it selects must be a sample that a real `pagedkv serve` or its daemon serves after
one request (a sequence held in the pool meanwhile, so the daemon's figures of blocks in use are
there). No list of names is kept here: a series renamed in the code fails the dashboard.
"""

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedkv.client import PoolClient

from metrics_text import samples
from pagedkvd_process import free_tcp_port, pagedkv_runner, pagedkvd, short_tmp_dir, start_serve

DASHBOARD = Path(__file__).parents[2] / "ops" / "grafana" / "pagedkv.json"
SERVED = "served-name"
# PromQL's keywords: never metric names.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "offset", "bool"}
# What a metric name never hides in: strings, label matchers, range and subquery brackets, and
# the label lists of grouping modifiers.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# An identifier (a metric name may hold colons), not inside a number (1e-9), a variable or a
# longer name.
_IDENTIFIER = re.compile(r"(?<![\w.:$])[A-Za-z_:][\w:]*")
# Grafana's template query: label_values(SELECTOR, LABEL).
_LABEL_VALUES = re.compile(r"label_values\((.*),\s*\w+\s*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects: identifiers that are neither functions nor aggregations
    (followed by `(`) nor keywords, once strings, matchers, ranges and grouping labels are
    gone."""
    bare = expr
    for pattern in (_STRING, _MATCHERS, _RANGE, _GROUPING):
        bare = pattern.sub(" ", bare)
    names = set()
    for match in _IDENTIFIER.finditer(bare):
        called = bare[match.end():].lstrip().startswith("(")
        if not called and match.group() not in KEYWORDS:
            names.add(match.group())
    return names


def panel_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every panel target's expression (rows' panels included)."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard["panels"])
    return found


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    """The selector of every query variable's label_values."""
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector = _LABEL_VALUES.fullmatch(variable["query"]["query"])
            assert selector is not None, variable["query"]
            found.append(selector.group(1))
    return found


def test_the_tokenizer_finds_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.99, sum by (le) (rate(pagedkv:x_bucket{model_name="$m", '
            'a=~"b|c"}[$__rate_interval]))) / clamp_min(sum without (method) (y_total), 1e-9) '
            'and on (instance) z offset 5m')
    assert metric_names(expr) == {"pagedkv:x_bucket", "y_total", "z"}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    """The /metrics bodies of a server (served as SERVED) after one completion, and of its
    daemon while a sequence holds blocks."""
    metrics_port = free_tcp_port()
    with pagedkvd("--model-config", "tiny-llama", "--num-blocks", "12", "--block-size", "16",
                  "--metrics-listen", f"127.0.0.1:{metrics_port}") as daemon, \
            pagedkv_runner(daemon, "--random-init", "tiny-llama", "--seed", "0") as runner, \
            short_tmp_dir() as folder:
        process, port = start_serve(folder, "--model", "tiny-llama", "--daemon",
                                    daemon.unix_target, "--runner", runner.unix_target,
                                    "--served-model-name", SERVED)
        try:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", method="POST",
                headers={"Content-Type": "application/json"},
                data=json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode())
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 200
            server_text = scrape(f"http://127.0.0.1:{port}/metrics")
            daemon_text = daemon_while_a_sequence_is_held(daemon.unix_target,
                                                          f"127.0.0.1:{metrics_port}")
        finally:
            assert process.stop() == 0, process.stderr()
        yield server_text, daemon_text


def daemon_while_a_sequence_is_held(target: str, metrics: str) -> str:
    """The daemon's /metrics while a session of its own holds a 20-token sequence."""
    async def held() -> str:
        async with await PoolClient.connect(target) as client:
            session = await client.open_session("grafana-test")
            await session.allocate(1, token_ids=list(range(20)))
            text = await asyncio.to_thread(scrape, f"http://{metrics}/metrics")
            await session.close()
            return text

    return asyncio.run(held())


def test_every_query_names_a_series_served(served: tuple[str, str]) -> None:
    server_text, daemon_text = served
    exported = {sample.name for sample in samples(server_text) + samples(daemon_text)}
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = panel_queries(dashboard) + variable_queries(dashboard)
    assert len(expressions) > 20
    for expr in expressions:
        names = metric_names(expr)
        assert names, expr
        assert names <= exported, f"{sorted(names - exported)} in {expr!r} is served by neither"


def test_every_server_series_is_labelled_with_the_served_name(served: tuple[str, str]) -> None:
    server_samples = samples(served[0])
    assert server_samples
    for sample in server_samples:
        assert sample.labels.get("model_name") == SERVED, sample


def test_the_server_series_are_filtered_by_the_model_name_variable(
        served: tuple[str, str]) -> None:
    server_text, daemon_text = served
    server_only = ({sample.name for sample in samples(server_text)}
                   - {sample.name for sample in samples(daemon_text)})
    dashboard = json.loads(DASHBOARD.read_text())
    assert "model_name" in [variable["name"] for variable in dashboard["templating"]["list"]]
    for expr in panel_queries(dashboard):
        if metric_names(expr) & server_only:
            assert 'model_name="$model_name"' in expr, expr
