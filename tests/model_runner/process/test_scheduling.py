"""The runner's threads yield to its forward thread (model_runner/process/scheduling.py): every
thread but the forward thread is SCHED_BATCH, so the event loop a forward wakes never preempts
it; the forward thread stays SCHED_OTHER."""

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from pagedkv.model_runner.process.scheduling import compute_first, yield_to_forwards

from pagedkvd_process import Pagedkvd

T = TypeVar("T")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="scheduling policies are Linux's")

# /proc/PID/task/TID/stat's policy: field 41, the 39th after the command's closing parenthesis.
POLICY_FIELD = 38


def in_thread(work: Callable[[], T]) -> T:
    """`work`'s result, run in a new thread (a policy is per thread: the test's stays)."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    thread.join()
    return result[0]


def test_threads_started_after_yielding_inherit_batch_and_the_forward_thread_computes_first(
        ) -> None:
    def forward_thread() -> int:
        compute_first()
        return os.sched_getscheduler(0)

    def runner_main() -> tuple[int, int, int]:
        yield_to_forwards()
        started = in_thread(lambda: os.sched_getscheduler(0))  # gRPC's, the event loop's...
        return os.sched_getscheduler(0), started, in_thread(forward_thread)

    assert in_thread(runner_main) == (os.SCHED_BATCH, os.SCHED_BATCH, os.SCHED_OTHER)


def test_a_policy_set_by_the_operator_is_kept() -> None:
    def runner_main() -> tuple[int, int]:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # as a unit's would be
        yield_to_forwards()

        def forward_thread() -> int:
            compute_first()
            return os.sched_getscheduler(0)
        return os.sched_getscheduler(0), in_thread(forward_thread)

    assert in_thread(runner_main) == (os.SCHED_IDLE, os.SCHED_IDLE)


def policies(pid: int) -> dict[int, int]:
    """Each thread of process `pid` (by id) and its scheduling policy."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        found[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[POLICY_FIELD])
    return found


def test_a_runner_process_runs_its_forward_thread_first(runner: Pagedkvd) -> None:
    pid = runner.process.pid
    threads = policies(pid)
    assert threads[pid] == os.SCHED_BATCH  # the event loop's (and every thread it started)
    assert os.SCHED_OTHER in threads.values()  # the forward thread
