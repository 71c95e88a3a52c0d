"""Runs the real `pagedkvd` (and `pagedkv runner`) as subprocesses for tests, as systemd would.

    with pagedkvd("--num-blocks", "64") as daemon:      # returns once READY=1 arrived
        ... talk to daemon.unix_target ...
        with pagedkv_runner(daemon, "--random-init", "tiny") as runner:
            ... talk to runner.unix_target ...
        assert daemon.stop() == 0                        # SIGTERM, wait, exit status

Everything the daemon creates (socket, pool file, notify socket, log) lives in one
short private folder: unix socket paths are limited to ~107 bytes, and /dev/shm stays
untouched. Starting and readiness (systemd's notify socket) are `pagedkv.process.launch`'s, the
same code `make demo` starts its processes with.
"""

import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pagedkv.client import RunnerClient
from pagedkv.process.launch import (
    DAEMON_COMMAND,
    READY_STATE,
    Launched,
    free_tcp_port,
    start_daemon,
    start_process,
    start_runner,
)

__all__ = ["COMMAND", "Pagedkvd", "free_tcp_port", "pagedkv_runner", "pagedkvd", "restarted",
           "short_tmp_dir", "start_serve", "tenant_samples"]

# The daemon's command line, for tests that run it to completion (`pagedkv daemon`).
COMMAND = list(DAEMON_COMMAND)
# One started daemon or runner process.
Pagedkvd = Launched


def tenant_samples(metrics: str) -> dict[tuple[str, str | None], float]:
    """The daemon's /metrics at host:port `metrics`: (name, tenant label) -> value."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    return {(s.name, s.labels.get("tenant")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@contextmanager
def short_tmp_dir() -> Iterator[Path]:
    """A fresh folder with a short path (pytest's tmp_path is too long for unix sockets)."""
    folder = Path(tempfile.mkdtemp(prefix="pkvd-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def pagedkvd(*args: str, env: dict[str, str] | None = None, wait_ready: bool = True,
             workdir: Path | None = None, listen_path: Path | None = None) -> Iterator[Launched]:
    """Start `pagedkvd` with `args`, its files (pool file included) in `workdir` (default: a
    private folder) and its socket at `listen_path` (default: in workdir). Killed on exit if the
    test did not stop it. With wait_ready=False, return at once (for daemons expected to refuse
    to start)."""
    with contextlib.ExitStack() as stack:
        folder = workdir or stack.enter_context(short_tmp_dir())
        daemon = stack.enter_context(start_daemon(folder, "--shm-dir", str(folder), *args,
                                                  listen_path=listen_path, env=env))
        if wait_ready:
            daemon.wait_for_notification(READY_STATE)
        yield daemon


@contextmanager
def pagedkv_runner(daemon: Launched, *args: str, wait_ready: bool = True,
                   listen: str | None = None) -> Iterator[Launched]:
    """Start `pagedkv runner` next to `daemon` with `args` (its model source at least); its
    log (and socket, unless `listen` names one) in a private folder."""
    with short_tmp_dir() as folder, start_runner(daemon.runners_target, folder, *args,
                                                 listen=listen) as runner:
        if wait_ready:
            runner.wait_for_notification(READY_STATE)
        yield runner


@asynccontextmanager
async def restarted(first: Launched, runner: RunnerClient, old_pool: str,
                    *args: str) -> AsyncIterator[Launched]:
    """`pagedkvd` with `args` started again in the folder and on the socket of `first` (which
    the test stopped), yielded once `runner` maps its new pool (its pool id is no longer
    `old_pool`): the runner's watcher finds the new daemon within a second or two."""
    socket_path = Path(first.unix_target.removeprefix("unix://"))
    with pagedkvd(*args, workdir=first.workdir, listen_path=socket_path) as daemon:
        for _ in range(100):
            if (await runner.info()).pool_id != old_pool:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the runner still maps pool {old_pool} after the restart")
        yield daemon


def start_serve(folder: Path, *args: str,
                env: dict[str, str] | None = None) -> tuple[Launched, int]:
    """`pagedkv serve` with `args` (and `env` added to the environment), ready (its port
    listening), and its port."""
    port = free_tcp_port()
    server = start_process("server", [sys.executable, "-m", "pagedkv.cli", "serve",
                                      "--port", str(port), "--log-format", "json", *args],
                           folder, f"http://127.0.0.1:{port}", env)
    try:
        server.wait_for_notification(READY_STATE, 120)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server, port
