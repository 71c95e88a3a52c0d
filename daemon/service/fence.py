"""Fencing a stalled runner: blocks a runner may still write go to no one else until that
runner provably cannot write them (kvpool.proto, "Runner holds").

A runner's hold (holds.py) is timed: it lapses hold_ms after the runner's last renewal. A lapse
proves nothing. A runner that is stopped rather than dead (SIGSTOP, a frozen cgroup, a throttled
container, swap, a debugger, a VM stall) resumes later and runs the forwards it had queued,
writing the blocks those forwards were given. So a lapsed hold is never simply released:

- Every connection on the runner socket comes through the peer-credential gate, which reads
  the caller's pid from the kernel (SO_PEERCRED) and at once takes a pidfd for it
  (SO_PEERPIDFD, else pidfd_open while the connection is open): a handle on that process that
  a recycled pid can never redirect (`RunnerProcesses.connected`).
- A runner's hold names its process (`Session.holds`).
- When someone needs the blocks of a session whose hold lapsed while its runner is alive (a
  client's free or close, the lease's expiry, a model's sleep), the daemon kills the runner
  through its pidfd (SIGKILL: `RunnerProcess.fence`) and keeps the session held until the
  pidfd reports the exit. The caller gets SessionBusy meanwhile (nothing changed; retry).
- A runner's exit (a crash, a stop, a fence) ends its holds at once: no wait for a lapse.

What this guarantees, and under which assumptions:
- The runner runs beside the daemon, in the daemon's pid namespace (or one below it), so the
  kernel gives the daemon its pid. A runner whose pid the daemon cannot see (SO_PEERCRED says
  0: a sibling namespace) may not hold (holds.py: FAILED_PRECONDITION).
- The daemon may signal the runner: the same uid, or CAP_KILL. If the kill is refused, the
  session stays held until the runner ends its hold or exits: its blocks stay out of
  circulation (logged, counted). Safety is not traded for availability.
- A process that has exited writes nothing more: its mappings of the pool are gone, and on
  CUDA the driver tears its contexts down (their kernels stopped) as its device files close at
  exit, before the pidfd reports it.
- The daemon never fences its own process (a runner in the daemon's process: tests). Such a
  hold stays until it is ended.

The trade-off is availability under a stall: a stalled runner's sessions are usable again only
once the kill lands (milliseconds), and its other clients lose their uncommitted work as in a
crash; the supervisor (`pagedkv serve`, systemd) restarts it. Waiting instead of killing would
keep the blocks out of circulation for as long as the stall lasts, which may be forever.
"""

import os
import select
import signal
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S, RateLimitedLog, get_logger

# SO_PEERCRED's struct ucred: pid, uid, gid.
_UCRED = struct.Struct("=iII")
# SO_PEERPIDFD (Linux 6.5): a pidfd of the peer, taken by the kernel at connect. Python names
# no constant for it yet.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """Who connected a unix socket, as the kernel recorded it at connect."""

    pid: int
    uid: int


def socket_credentials(sock: socket.socket) -> PeerCredentials:
    """The pid and uid of the process that connected `sock` (0 for a pid the daemon's pid
    namespace cannot see)."""
    pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCredentials(int(pid), int(uid))


def peer_pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd of the process that connected `sock`: the kernel's (SO_PEERPIDFD), else one
    opened for `pid` now, while its connection is open; None if neither can be had."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot: /proc/PID/stat's 22nd field), None
    when there is none: with the pid, what names one process across a daemon restart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass
class FenceCounts:
    """Fences over the daemon's life (the metrics read them)."""

    # Runners killed because a hold of theirs lapsed while its blocks were needed.
    fenced: int = 0
    # Kills the kernel refused (the runner is another user's): its holds stay.
    refused: int = 0


@dataclass(eq=False)
class RunnerProcess:
    """A process that connected to the runner socket, by pidfd."""

    pid: int
    # Its pidfd (readable once it has exited); -1 once closed.
    pidfd: int
    counts: FenceCounts
    # Set once its exit was seen.
    exited: bool = False
    # Set once the daemon sent it SIGKILL; `refused`, once the kernel would not.
    fenced: bool = False
    refused: bool = False
    _refusal_log: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog(HOSTILE_LOG_INTERVAL_S))
    # Both the gate's thread and the daemon's loop look at it: the pidfd is closed once, and
    # never used after.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def alive(self) -> bool:
        """Whether it may still run (and write the pool): not seen to exit."""
        with self._lock:
            return self._alive()

    def _alive(self) -> bool:
        if self.exited:
            return False
        poll = select.poll()  # not select(): the daemon's descriptors pass FD_SETSIZE
        poll.register(self.pidfd, select.POLLIN)
        if poll.poll(0):
            self.exited = True
            os.close(self.pidfd)
            self.pidfd = -1
            if self.fenced:
                log.warning("runner fenced: its process has exited", pid=self.pid)
        return not self.exited

    def fence(self, why: str) -> None:
        """Kill it (once): a hold of it lapsed and another caller needs the blocks (`why`)."""
        with self._lock:
            if self.fenced or not self._alive():
                return
            if self.pid == os.getpid():  # a runner in the daemon's own process (tests)
                self._refused(why, "it is the daemon's own process")
                return
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:  # exited meanwhile: the next look sees it
                return
            except PermissionError:
                self._refused(why, "the kernel refused the signal (another user's process; "
                                   "give the daemon the runner's user, or CAP_KILL)")
                return
            self.fenced = True
        self.counts.fenced += 1
        log.warning("runner fenced: a hold of it lapsed while another caller needs its "
                    "blocks; killed (SIGKILL) before they are freed", pid=self.pid, need=why)

    def identity(self) -> tuple[int, int] | None:
        """(pid, start time) while it runs, what a restart snapshot names it by; None once it
        has exited. Read while the pidfd pins the process, so the pid is still its own."""
        with self._lock:
            if not self._alive():
                return None
            start = process_start_time(self.pid)
        return None if start is None else (self.pid, start)

    def close(self) -> None:
        """Close its pidfd (the daemon stopping): it counts as gone from now on."""
        with self._lock:
            if not self.exited:
                os.close(self.pidfd)
                self.pidfd, self.exited = -1, True

    def _refused(self, why: str, reason: str) -> None:
        """A runner the daemon cannot kill keeps its holds (safety over availability)."""
        if not self.refused:
            self.refused = True
            self.counts.refused += 1
        count = self._refusal_log.event()
        if count is not None:
            log.error("runner not fenced: its lapsed holds stay until it ends them or exits",
                      pid=self.pid, need=why, reason=reason, count=count)


class RunnerProcesses:
    """The processes connected to the runner socket, by pid: told by the gate's thread as they
    connect, read by the daemon's loop."""

    def __init__(self) -> None:
        self.counts = FenceCounts()
        self._by_pid: dict[int, RunnerProcess] = {}
        self._lock = threading.Lock()

    def connected(self, sock: socket.socket) -> PeerCredentials:
        """Note the process that connected `sock` (gate thread); returns its credentials."""
        credentials = socket_credentials(sock)
        if credentials.pid <= 0:
            return credentials
        with self._lock:
            known = self._by_pid.get(credentials.pid)
            if known is not None and known.alive():
                return credentials  # another connection of a process already known
            pidfd = peer_pidfd(sock, credentials.pid)
            if pidfd is not None:
                self._forget_exited()
                self._by_pid[credentials.pid] = RunnerProcess(credentials.pid, pidfd,
                                                              self.counts)
        return credentials

    def adopt(self, pid: int, start: int) -> RunnerProcess | None:
        """The runner process `pid` that started at `start` (named by a restart snapshot), with
        a pidfd taken now; None when it has exited. The pidfd is opened before the start time
        is read: if the pid names another process by then, the times differ, and the pid is
        never trusted alone."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        if process_start_time(pid) != start:
            os.close(pidfd)
            return None
        process = RunnerProcess(pid, pidfd, self.counts)
        with self._lock:
            known = self._by_pid.get(pid)
            if known is None or not known.alive():
                self._by_pid[pid] = process  # its next connection is this process
        return process

    def get(self, pid: int) -> RunnerProcess | None:
        """The live process `pid` named at connect; None if unknown or gone."""
        with self._lock:
            process = self._by_pid.get(pid)
            return process if process is not None and process.alive() else None

    def _forget_exited(self) -> None:
        """Drop processes that have exited (their holds keep their own reference): the table
        stays as large as the runners alive."""
        for pid in [pid for pid, process in self._by_pid.items() if not process.alive()]:
            del self._by_pid[pid]

    def close(self) -> None:
        """Close every pidfd (the daemon stopping)."""
        with self._lock:
            for process in self._by_pid.values():
                process.close()
            self._by_pid.clear()
