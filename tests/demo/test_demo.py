"""`make demo` keeps working: its reduced run (`--quick`) starts the daemons and runners, runs the
workload from two client processes, stops everything cleanly, and writes the report and the
chart: blocks used, running sequences and filled token slots, as the daemon's /metrics showed
them during each run."""

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SVG = "{http://www.w3.org/2000/svg}"
PAGED_LINES = ["requests", "tokens per second", "peak concurrent sequences", "KV utilization",
               "blocks saved by sharing", "prefix-cache hit rate", "preemptions"]
CONTIGUOUS_LINES = ["peak concurrent sequences", "KV utilization", "requests", "preemptions"]
BLOCK_SIZE = 16
# The chart's panels, by the start of their titles.
BLOCKS, SEQUENCES, SLOTS = "KV blocks used", "running sequences", "filled token slots"


def figure(line: str) -> float:
    """The first number after the label."""
    match = re.search(r":\s+([\d,.]+)", line)
    assert match, line
    return float(match.group(1).replace(",", ""))


@pytest.mark.slow
def test_the_quick_demo_reports_both_runs_and_stops_every_process(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pagedkv.demo", "--quick",
                             "--output", str(tmp_path)],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert ("Stopped: every runner and daemon exited with status 0 on SIGTERM; no pool file "
            "left.") in out
    assert f"Written: {tmp_path / 'report.txt'}, {tmp_path / 'kv_blocks.svg'}" in out

    report = (tmp_path / "report.txt").read_text()
    assert report in out
    paged, _, contiguous = report.partition("the same workload, contiguous max-length "
                                            "reservation")
    paged_lines = {line.split(":")[0]: line for line in paged.splitlines() if ":" in line}
    contiguous_lines = {line.split(":")[0]: line for line in contiguous.splitlines()[1:]}
    assert set(PAGED_LINES) <= set(paged_lines), paged
    assert set(CONTIGUOUS_LINES) <= set(contiguous_lines), contiguous
    requests = figure(paged_lines["requests"])
    assert requests == figure(contiguous_lines["requests"]) == 12  # the quick workload
    assert figure(paged_lines["tokens per second"]) > 0
    peak_paged = figure(paged_lines["peak concurrent sequences"])
    peak_contiguous = figure(contiguous_lines["peak concurrent sequences"])
    assert 1 <= peak_contiguous < peak_paged  # reservations hold fewer sequences
    assert 0 < figure(paged_lines["blocks saved by sharing"]) < 100  # n=4 and beams fork
    assert 0 <= figure(paged_lines["prefix-cache hit rate"]) < 100  # hits depend on timing

    series = chart_values(tmp_path / "kv_blocks.svg")
    assert set(series) == {(panel, run) for panel in (BLOCKS, SEQUENCES, SLOTS)
                           for run in ("paged", "contiguous")}
    assert all(len(points) >= 2 for points in series.values())
    # The running sequences are the samples the report's peaks come from.
    assert max(series[SEQUENCES, "paged"].values()) == peak_paged
    assert max(series[SEQUENCES, "contiguous"].values()) == peak_contiguous
    # Filled slots: never more than the used blocks' slots; a reservation fills fewer of them.
    fill = {}
    for run in ("paged", "contiguous"):
        blocks, slots = series[BLOCKS, run], series[SLOTS, run]
        assert blocks.keys() == slots.keys()  # one scrape gives both
        assert all(slots[t] <= blocks[t] * BLOCK_SIZE for t in blocks)
        fill[run] = sum(slots.values()) / (sum(blocks.values()) * BLOCK_SIZE)
    assert fill["contiguous"] < fill["paged"]


def chart_values(path: Path) -> dict[tuple[str, str], dict[float, float]]:
    """Each (panel, run) line of the chart: its values by time."""
    chart = ET.parse(path).getroot()
    assert chart.tag == f"{SVG}svg"
    series = {}
    for line in chart.iter(f"{SVG}polyline"):
        panel = next(p for p in (BLOCKS, SEQUENCES, SLOTS)
                     if line.get("data-panel", "").startswith(p))
        pairs = (point.split(",") for point in line.get("data-values", "").split())
        series[panel, line.get("data-name", "")] = {float(t): float(v) for t, v in pairs}
    return series
