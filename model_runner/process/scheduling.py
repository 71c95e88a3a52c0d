"""The runner process's CPU scheduling: the forward thread first (issue 35).

    yield_to_forwards()                                      # at start, before any thread
    await engine.forwards.between_forwards(compute_first)    # the forward thread itself

While the runner follows a session, its forward thread computes forwards back to back and wakes
the event loop once a step to push the answer (decode_run.py). A woken thread may preempt the
one that woke it (the kernel's wakeup preemption), and on a host whose other cores are busy (a
daemon, clients, other runners) the event loop then ran its push on the forward thread's core
while the forward waited: the gap between two decode forwards of one client's 32 sequences was
0.35-0.48 ms (median, 2-core VM), of which ~0.15 ms was the forward thread's own work. Every
thread of the runner but the forward thread is so SCHED_BATCH (sched(7): a batch thread never
preempts another on waking, and still gets its fair share of the CPU), and the forward thread
stays SCHED_OTHER: the same gap was 0.15-0.18 ms. Clients and the daemon keep their own policy.

Only the default policy is changed: a runner started with another one (a unit's
CPUSchedulingPolicy=, chrt) keeps it on every thread. Linux only (elsewhere both do nothing); a
host that forbids the change (a seccomp profile) leaves the policies as they were: scheduling is
a hint, never a reason to fail.
"""

import contextlib
import os

# The policies (os.SCHED_BATCH and os.SCHED_OTHER exist on Linux only).
_BATCH = getattr(os, "SCHED_BATCH", None)
_OTHER = getattr(os, "SCHED_OTHER", None)


def yield_to_forwards() -> None:
    """The calling thread SCHED_BATCH if it runs SCHED_OTHER; threads it starts from then on
    inherit it. Called at the runner's start, before its event loop, gRPC and the forward thread
    exist."""
    _change_policy(_OTHER, _BATCH)


def compute_first() -> None:
    """The calling thread (the forward thread) back to SCHED_OTHER if yield_to_forwards made it
    SCHED_BATCH."""
    _change_policy(_BATCH, _OTHER)


def _change_policy(old: int | None, new: int | None) -> None:
    """The calling thread's policy `new` if it is `old`."""
    if old is None or new is None:
        return
    with contextlib.suppress(OSError):  # EPERM under a seccomp profile: a hint, not a need
        if os.sched_getscheduler(0) == old:
            os.sched_setscheduler(0, new, os.sched_param(0))
