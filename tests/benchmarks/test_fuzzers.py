"""The stateful fuzzers and the load run, brief, against real pagedkvd (and runner) processes.

Seeded: 800 fuzz calls (at most 18 s) on a 512-block pool, then 3 client processes for 7 s while a
victim with 500 ms leases is SIGKILLed every few seconds; then the runner fuzzer for 12 s on a
daemon and a runner serving the tests' tiny Llama (served_model.TINY). `make soak` runs them at
full size (benchmarks/soak.py); the tools live in benchmarks/ (fuzz_daemon, fuzz_calls,
fuzz_shadow, load_daemon, fuzz_runner*).
"""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fuzz_daemon import FuzzConfig, run_fuzz
from fuzz_runner import RunnerFuzzConfig, run_runner_fuzz
from fuzz_runner_hostile import KINDS
from fuzz_runner_report import MUST_REFUSE
from fuzz_runner_tenants import write_tenancy
from load_daemon import LoadConfig, run_load

from pagedkvd_process import Pagedkvd, free_tcp_port, pagedkv_runner, pagedkvd
from served_model import TINY, write_config

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
    # 800 calls of seed 7 reach every answer asserted below (twice or more each, the expiry
    # once at call 500); `make soak` runs 30,000.
    report = run_fuzz(daemon.unix_target, metrics, FuzzConfig(seed=7, calls=800, seconds=18))
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
    # StepMany calls as messages on one StepStream, kept open: some answered, some refused as a
    # whole (past max_steps_per_call) with the unary call's code, the stream going on.
    assert report.streams_opened == 1, report.streams_opened
    assert report.outcomes["step_many_streamed", "OK"] > 0, report.outcomes
    assert report.outcomes["step_many_past_cap_streamed", "INVALID_ARGUMENT"] > 0
    assert report.outcomes["step_many_past_cap", "INVALID_ARGUMENT"] > 0
    # Steps reserved slots ahead; reservations past the cap and commits into them were refused.
    outcomes = report.outcomes
    assert outcomes["step_reserve", "OK"] > 0, outcomes
    assert outcomes["step_reserve_past_cap", "INVALID_ARGUMENT"] > 0, outcomes
    assert outcomes["commit_reserved", "INVALID_ARGUMENT"] > 0, outcomes
    assert outcomes["cow_reserved", "INVALID_ARGUMENT"] > 0, outcomes


def test_load_with_killed_clients_expires_no_healthy_session_and_leaks_nothing(
        daemon: Pagedkvd, metrics: str) -> None:
    report = run_load(daemon.unix_target, metrics, LoadConfig(clients=3, seconds=7, max_live=6,
                                                     warmup_s=3))
    assert report.healthy_sessions_expired == 0
    assert report.blocks_leaked == 0 and report.sequences_leaked == 0
    assert report.victim_kills >= 2 and report.victim_allocations > 0
    assert set(report.errors) <= {"PoolExhausted"}, report.errors
    assert report.ops_per_s > 0 and report.step_p99_ms > 0


def test_runner_fuzzer_gives_honest_clients_only_right_tokens_refuses_attacks_and_leaks_nothing(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Honest clients (prefix hits across sessions, chunked prefills, forks, decode ahead, the
    runner following some, stale plans refused) beside forged histories, out-of-vocabulary ids,
    cancelled steps, uncomputed commits and killed client processes: every honest token, pushed
    or answered, equals the private recomputation's."""
    config_path = str(write_config(TINY, tmp_path_factory))
    # Honest clients and the hostile one are two tenants sharing the cache salt.
    tenancy = write_tenancy(tmp_path_factory.mktemp("tenants"))
    metrics = f"127.0.0.1:{free_tcp_port()}"
    with pagedkvd("--model-config", config_path, "--num-blocks", "256", "--block-size", "16",
                  "--log-level", "warning", "--metrics-listen", metrics,
                  *tenancy.daemon_args) as daemon, \
            pagedkv_runner(daemon, "--random-init", config_path, "--torch-threads", "1",
                           "--log-level", "warning") as runner:
        report = run_runner_fuzz(daemon.unix_target, runner.unix_target, metrics, tenancy,
                                 RunnerFuzzConfig(seed=3, seconds=12, model=config_path))
        assert runner.stop() == 0, runner.stderr()
        assert daemon.stop() == 0, daemon.stderr()
    summary = "\n".join([*report.figures(), *report.findings()])
    assert report.wrong_tokens == [], summary
    assert report.internal_errors == [] and report.honest_findings == [], summary
    assert report.follow_findings == [], summary
    assert report.leaked_blocks == 0 and report.leftover_sequences == 0
    # The honest clients did the interesting things: prefix hits across sessions, forks.
    assert report.checked_tokens >= 50 and report.cached_sequences > 0 and report.forks > 0
    # The runner followed stream clients: pushes taken and checked, steps planned before
    # pushes they had not read refused StalePlan (and sent again once those were read).
    assert report.pushes_taken > 0 and report.stale_refusals > 0, summary
    # Every hostile kind happened; each attack was refused.
    kinds = report.kinds()
    assert set(kinds) == {*KINDS, "killed_client"}, summary
    assert report.not_refused() == {}, summary
    for kind in MUST_REFUSE:
        assert any(outcome.startswith("refused") for outcome in kinds[kind]), summary
