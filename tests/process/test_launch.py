"""`pagedkv.process.launch` on small stand-in processes: readiness by READY=1, a failed start
explained by the log's tail, and stopping (SIGTERM, SIGKILL when that is not enough)."""

import signal
import sys
import time
from pathlib import Path

import pytest

from pagedkv.process.launch import READY_STATE, Launched, NoNotification, start_process

# Sends READY=1 with the given states, then sleeps until signalled.
READY_SCRIPT = ("import signal, sys, time; from pagedkv.process.notify import notify; "
                "{setup}; notify('READY=1'); time.sleep(600)")


def start_python(name: str, code: str, folder: Path) -> Launched:
    return start_process(name, [sys.executable, "-c", code], folder, f"unix://{folder}/x.sock")


def test_a_process_that_exits_while_starting_is_reported_at_once_with_its_log(
        tmp_path: Path) -> None:
    with start_python("broken", "import sys; print('loading'); "
                      "sys.exit('cannot load the model')", tmp_path) as broken:
        began = time.monotonic()
        with pytest.raises(NoNotification, match="the broken process exited with status 1 "
                                                 "before it sent READY=1:\ncannot load the model"):
            broken.wait_for_notification(READY_STATE, timeout=120)
        assert time.monotonic() - began < 60  # not the whole timeout
    assert (tmp_path / "broken.log").read_text() == "cannot load the model\n"  # stderr only


def test_a_silent_process_times_out_with_its_log(tmp_path: Path) -> None:
    silent = start_python("silent", "import sys, time; print('still loading', file=sys.stderr); "
                          "time.sleep(600)", tmp_path)
    with silent, pytest.raises(NoNotification, match=r"the silent process sent no READY=1 "
                                                     r"within 0\.5 s:\nstill loading"):
        silent.wait_for_notification(READY_STATE, timeout=0.5)
    assert silent.process.returncode == -signal.SIGKILL  # killed on leaving the block


def test_a_ready_process_is_stopped_by_sigterm_once(tmp_path: Path) -> None:
    sleeper = start_python("sleeper", READY_SCRIPT.format(setup="pass"), tmp_path)
    assert sleeper.wait_for_notification(READY_STATE, timeout=60) == "READY=1"
    assert sleeper.notifications == ["READY=1"]
    assert sleeper.stop() == -signal.SIGTERM
    assert sleeper.stop() == -signal.SIGTERM  # idempotent
    assert sleeper.notify_socket.fileno() == -1  # closed


def test_a_process_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    stubborn = start_python("stubborn", READY_SCRIPT.format(
        setup="signal.signal(signal.SIGTERM, signal.SIG_IGN)"), tmp_path)
    with stubborn:
        stubborn.wait_for_notification(READY_STATE, timeout=60)
        stubborn.send(signal.SIGTERM)
        assert stubborn.wait_for_exit(timeout=0.5) == -signal.SIGKILL
