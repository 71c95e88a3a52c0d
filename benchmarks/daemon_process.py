"""A `pagedkvd` subprocess for the soak tools: its socket, pool file and log in a private folder,
started and stopped (SIGTERM) by `pagedkv.process.launch`.

    with running_pagedkvd("--num-blocks", "256") as daemon:   # returns once READY=1 arrived
        ... talk to daemon.target, read daemon.metrics ...
    # daemon.exit_code, daemon.log: its exit status after SIGTERM, and its log
"""

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedkv.process.launch import READY_STATE, Launched, free_tcp_port, start_daemon


def pin(daemon: subprocess.Popen[bytes]) -> str:
    """Give the daemon a CPU of its own and this process (and the clients it starts later) the
    others, as a deployment would: on a 2-core machine, sharing cores adds scheduler jitter to
    every round trip. Returns how, for the output's first line."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "unpinned (one CPU)"
    os.sched_setaffinity(daemon.pid, {cpus[-1]})
    os.sched_setaffinity(0, set(cpus[:-1]))  # processes started later inherit this
    return f"daemon on CPU {cpus[-1]}, clients on CPUs {cpus[:-1]}"


@dataclass
class DaemonProcess:
    """A started pagedkvd and, once its `with` block is left, how it ended."""

    launched: Launched
    # host:port of its /metrics (pool-wide figures are for operators, not GetStats).
    metrics: str
    # Exit status once stopped (None while it runs), and its log, kept when the folder goes.
    exit_code: int | None = None
    log: str = ""

    @property
    def target(self) -> str:
        """gRPC target of its unix socket: "unix:///tmp/.../pagedkvd.sock"."""
        return self.launched.unix_target


@contextmanager
def running_pagedkvd(*args: str) -> Iterator[DaemonProcess]:
    """`pagedkv daemon` with `args`, logging warnings and up."""
    with tempfile.TemporaryDirectory(prefix="pkv-soak-") as name:
        metrics = f"127.0.0.1:{free_tcp_port()}"
        with start_daemon(Path(name), "--metrics-listen", metrics, "--shm-dir", name,
                          "--log-level", "warning", *args) as launched:
            daemon = DaemonProcess(launched, metrics)
            try:
                launched.wait_for_notification(READY_STATE)
                yield daemon
            finally:
                daemon.exit_code = launched.stop()
                daemon.log = launched.stderr()
