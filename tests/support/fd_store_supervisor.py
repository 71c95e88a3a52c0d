"""A test supervisor that starts `pagedkvd` as systemd would start a unit with a file
descriptor store (these machines have no systemd): the store is the production one that
`pagedkv serve` keeps for its child daemon (pagedkv.process.fd_store_host, speaking systemd's
protocol: FDSTORE=1 / FDSTOREREMOVE=1 with SCM_RIGHTS in, LISTEN_FDS / LISTEN_FDNAMES /
LISTEN_PID out).

    supervisor = FdStoreSupervisor(folder)
    with supervisor.start("--num-blocks", "8") as daemon:   # READY=1 received
        ...
        assert supervisor.stop(daemon) == 0                 # SIGTERM; store messages read
    with supervisor.start("--num-blocks", "8") as daemon:   # gets the stored descriptors
        ...
"""

import signal
from pathlib import Path

from pagedkv.process.fd_store_host import FdStoreHost
from pagedkv.process.launch import (
    READY_STATE,
    START_TIMEOUT_S,
    Launched,
    NoNotification,
    start_daemon,
)

# Size of the emulated store (FileDescriptorStoreMax=).
FD_STORE_MAX = 8


def restoring_daemon_args(config: str, folder: Path) -> tuple[str, ...]:
    """A small daemon of `config` that writes its snapshot at SIGTERM and restores it at start
    (its state folder in `folder`)."""
    return ("--model-config", config, "--num-blocks", "64", "--restore", "auto",
            "--state-dir", str(folder / "state"))


class FdStoreSupervisor:
    """Starts `pagedkvd` in `folder` as a unit with FileDescriptorStoreMax=FD_STORE_MAX would be
    started, and keeps what it stores across its restarts (the production store:
    pagedkv.process.fd_store_host)."""

    def __init__(self, folder: Path) -> None:
        # The folder of the daemon's sockets, log and pool file (its --shm-dir).
        self.folder = folder
        # The store the daemon's notify socket feeds.
        self.store = FdStoreHost(FD_STORE_MAX)

    @property
    def stored(self) -> list[tuple[str, int]]:
        """(name, descriptor) in the order stored."""
        return self.store.stored

    def start(self, *args: str) -> Launched:
        """Start the daemon with `args` and the store's descriptors; return once READY=1."""
        daemon = start_daemon(self.folder, "--shm-dir", str(self.folder), *args,
                              fd_store=self.store)
        try:
            self.wait_for(daemon, READY_STATE)
        except BaseException:
            daemon.stop(signal.SIGKILL)
            raise
        return daemon

    def wait_for(self, daemon: Launched, state: str, timeout: float = START_TIMEOUT_S) -> str:
        """Handle the daemon's messages until one holds `state`; AssertionError with its log if
        it exits or the time runs out first."""
        try:
            return daemon.wait_for_notification(state, timeout)
        except NoNotification as exc:
            raise AssertionError(str(exc)) from None

    def stop(self, daemon: Launched, sig: signal.Signals = signal.SIGTERM) -> int:
        """Signal the daemon, wait for its exit, then handle what it sent; its exit status."""
        return daemon.stop(sig)

    def names(self) -> list[str]:
        return self.store.names()

    def close(self) -> None:
        """Close the store's descriptors (a unit stopped without FileDescriptorStorePreserve)."""
        self.store.close()
