"""systemd's sd_notify protocol, without libsystemd: one datagram to $NOTIFY_SOCKET per call.

With `Type=notify` systemd waits for `READY=1` before it calls the unit started, and shows the
latest `STATUS=` line in `systemctl status`. With `WatchdogSec=` it kills the unit when the
`WATCHDOG=1` pings stop. Outside systemd $NOTIFY_SOCKET is unset and every call does nothing,
so the daemon can call these unconditionally.
"""

import array
import os
import socket
from collections.abc import Mapping, Sequence

# A path, or a name in the abstract namespace when it starts with "@" (Linux).
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
# Set by systemd when the unit has WatchdogSec=: the period in microseconds, and the pid it is for.
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"


def _socket_address(value: str) -> str | None:
    """The AF_UNIX address for a $NOTIFY_SOCKET value, or None for a form we do not speak."""
    if value.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of the "@" (Python takes it in a str).
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    # "vsock:..." and anything else: not for a daemon on the host.
    return None


def notify(*states: str, env: Mapping[str, str] | None = None, fds: Sequence[int] = ()) -> bool:
    """Send `states` (e.g. "READY=1", "STATUS=serving") as one message; True if it was sent.
    `fds` ride along as SCM_RIGHTS, as sd_pid_notify_with_fds sends them (with "FDSTORE=1":
    process/fd_store.py).

    Does nothing (False) when $NOTIFY_SOCKET is unset or of an unknown form. A send error is
    also False rather than an exception: losing a status line must never stop the daemon.
    """
    environ = os.environ if env is None else env
    address = _socket_address(environ.get(NOTIFY_SOCKET_ENV, ""))
    if address is None or not states:
        return False
    message = "\n".join(states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                          array.array("i", fds).tobytes())] if fds else []
            sock.sendmsg([message], ancillary, 0, address)
    except OSError:
        return False
    return True


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """How often to send WATCHDOG=1 (half the watchdog period), or None when no watchdog is set.

    systemd sets WATCHDOG_PID to the main pid; if it names another process (we were started by
    a wrapper that kept the variables), the watchdog is not ours to feed.
    """
    environ = os.environ if env is None else env
    usec = environ.get(WATCHDOG_USEC_ENV, "")
    pid = environ.get(WATCHDOG_PID_ENV, "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1_000_000 / 2
