"""The stateful fuzzer and the load run, brief, against one real pagedkvd process.

Seeded: 2,000 fuzz calls (at most 18 s) on a 512-block pool, then 3 client processes for 7 s while a
victim with 500 ms leases is SIGKILLed every few seconds. `make soak` runs both at full size
(benchmarks/soak.py); the tools live in benchmarks/ (fuzz_daemon, fuzz_calls, fuzz_shadow,
load_daemon).
"""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from fuzz_daemon import FuzzConfig, run_fuzz
from load_daemon import LoadConfig, run_load
from pagedkvd_process import Pagedkvd, free_tcp_port, pagedkvd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def metrics() -> str:
    """host:port of the daemon's /metrics: pool-wide figures are the operator's."""
    return f"127.0.0.1:{free_tcp_port()}"


@pytest.fixture(scope="module")
def daemon(metrics: str) -> Iterator[Pagedkvd]:
    with pagedkvd("--num-blocks", "512", "--block-size", "16", "--log-level", "warning",
                  "--metrics-listen", metrics) as d:
        yield d
        assert d.process.poll() is None, f"pagedkvd died:\n{d.stderr()}"
        assert d.stop() == 0, d.stderr()


def test_fuzzer_finds_no_internal_error_no_state_change_on_failure_and_no_leak(
        daemon: Pagedkvd, metrics: str) -> None:
    report = run_fuzz(daemon.unix_target, metrics, FuzzConfig(seed=7, calls=2_000, seconds=18))
    assert report.violations == []
    # INTERNAL or UNKNOWN is a bug; malformed bytes get INVALID_ARGUMENT, and no error detail
    # is too long for the trailers (session ids are never echoed).
    assert report.internal_errors == []
    assert report.malformed_unknown == 0 and report.trailer_overflows == []
    assert report.leaked_blocks == 0 and report.leftover_sequences == 0
    assert report.calls >= 500 and report.verifications >= 10 and report.expiries >= 1
    # It shared blocks: prefixes found in the cache, copy-on-write copies.
    assert report.cache_hits > 0 and report.copies > 0
    # The mix reached the interesting answers: successes, refusals and a full pool.
    for code in ("OK", "NOT_FOUND", "INVALID_ARGUMENT", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED"):
        assert report.codes[code] > 0, report.codes
    # StepMany entries, each judged alone: some applied, some refused.
    entries = {code for (label, code) in report.outcomes if label.endswith("_entry")}
    assert "OK" in entries and entries - {"OK"}, entries


def test_load_with_killed_clients_expires_no_healthy_session_and_leaks_nothing(
        daemon: Pagedkvd, metrics: str) -> None:
    report = run_load(daemon.unix_target, metrics, LoadConfig(clients=3, seconds=7, max_live=6,
                                                     warmup_s=3))
    assert report.healthy_sessions_expired == 0
    assert report.blocks_leaked == 0 and report.sequences_leaked == 0
    assert report.victim_kills >= 2 and report.victim_allocations > 0
    assert set(report.errors) <= {"PoolExhausted"}, report.errors
    assert report.ops_per_s > 0 and report.step_p99_ms > 0
