"""A runner paused and resumed at random points while honest clients step on it and on another
runner, an impatient client closing its session directly while the runner is stopped: every
token the honest clients get equals a private recomputation, and the daemon fenced the runner
(SIGKILL) at least once, a supervisor restarting it (benchmarks/paused_runners.py; `make soak`
runs it longer)."""

from paused_runners import PausedConfig, pause_runners


def test_paused_runners_never_give_a_wrong_token() -> None:
    report = pause_runners(PausedConfig(seed=1, seconds=15))
    assert report.honest.checked_tokens > 0
    assert report.findings() == []
    assert report.fences >= 1
