"""A `pagedkvd` subprocess for the soak tools: started on a private unix socket, ready when it
answers, stopped with SIGTERM.

    with running_pagedkvd("--num-blocks", "256") as daemon:
        ... talk to daemon.target ...
    # daemon.exit_code: the daemon's exit status after SIGTERM
"""

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@dataclass
class DaemonProcess:
    process: subprocess.Popen[bytes]
    # "unix:///tmp/.../pagedkv.sock"
    target: str
    # Holds the socket, the pool file and stderr.log.
    folder: Path
    # host:port of its /metrics (pool-wide figures are for operators, not GetStats).
    metrics: str
    # Exit status once stopped (None while it runs), and its log, kept when the folder goes.
    exit_code: int | None = None
    final_stderr: str | None = None

    def stderr(self) -> str:
        if self.final_stderr is not None:
            return self.final_stderr
        return (self.folder / "stderr.log").read_text(errors="replace")


@contextmanager
def running_pagedkvd(*args: str) -> Iterator[DaemonProcess]:
    """`pagedkv serve` with `args` (its socket, pool file and log in a private folder)."""
    with tempfile.TemporaryDirectory(prefix="pkv-soak-") as name:
        folder = Path(name)
        target = f"unix://{folder / 'pagedkv.sock'}"
        metrics = f"127.0.0.1:{free_tcp_port()}"
        command = [sys.executable, "-m", "pagedkv.daemon.cli", "serve", "--listen", target,
                   "--metrics-listen", metrics, "--shm-dir", name, "--log-format", "json",
                   "--log-level", "warning", *args]
        with (folder / "stderr.log").open("wb") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        daemon = DaemonProcess(process, target, folder, metrics)
        try:
            wait_until_serving(daemon)
            yield daemon
        finally:
            process.terminate()
            try:
                daemon.exit_code = process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                daemon.exit_code = process.wait(STOP_TIMEOUT_S)
            daemon.final_stderr = daemon.stderr()


def free_tcp_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until_serving(daemon: DaemonProcess) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(daemon.target) as channel:
        ready = grpc.channel_ready_future(channel)
        try:
            while time.monotonic() < deadline:
                if daemon.process.poll() is not None:
                    raise RuntimeError(f"pagedkvd exited ({daemon.process.returncode}):\n"
                                       f"{daemon.stderr()}")
                try:
                    ready.result(timeout=0.5)
                    return
                except grpc.FutureTimeoutError:
                    continue
        finally:
            ready.cancel()
    raise RuntimeError(f"pagedkvd did not answer within {START_TIMEOUT_S} s")
