"""Runner holds: a runner's word that its forward may still write a session's blocks, and the
refusal of other callers' frees until it is over (kvpool.proto, "Runner holds").

A runner's forward writes K/V into the slots its daemon calls returned, after those calls are
answered. A client that frees the same blocks directly in the daemon (Free, CloseSession, a
Batch free op) while that forward is queued or running would hand them to another session, and
the forward would then write into that session's K/V. So a runner's call may carry `hold_ms`:
the session is held until now + hold_ms (the later of that and any hold it had), and until then
a free by a caller that is not a runner is refused with `SessionBusy`, nothing changed. The
runner renews the hold while a long forward runs (KeepAlive) and ends it (`end_hold`) once no
forward of the session is queued or running; a hold it does not end lapses by itself, so a
runner that dies holds nothing for longer than its last hold_ms (at most `max_hold_ms`). A held
session never expires (sessions.py): expiry waits for the hold to end.

A lapsed hold is not released while its runner lives: the runner may be stopped, not dead, and
resume writing. A caller that needs the blocks then has the runner fenced (fence.py: SIGKILL
through its pidfd) and gets SessionBusy until the runner's exit is seen; a runner's exit ends
its holds at once. Each hold names the runner process that set it (the caller's, from the
runner socket's peer credentials), and `end_hold` ends that runner's hold only.

Runner calls are never refused by a hold: the runner frees its clients' sequences only after
their forwards (its release path), and so does the daemon's own code (no caller). The check
runs under the pool lock before the call's transaction opens; the hold is set or ended only
once the call has been applied, so a call that fails sets nothing.
"""

from dataclasses import dataclass

from pagedkv.daemon.core import InvalidArgument
from pagedkv.daemon.service.errors import PermissionDenied, SessionBusy
from pagedkv.daemon.service.fence import RunnerProcess
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.sessions import Session
from pagedkv.daemon.service.tenants import current_caller, trusted_caller


@dataclass(frozen=True, slots=True)
class Hold:
    """What a runner's call asks of its session's hold."""

    # Hold the session until now + hold_ms once the call is applied; 0: no new hold.
    hold_ms: int = 0
    # End the hold once the call is applied (no forward of the session is queued or running).
    end: bool = False


# A call that asks nothing of the hold (every call but a runner's).
NO_HOLD = Hold()


def check_hold(hold: Hold, limits: Limits) -> None:
    """INVALID_ARGUMENT for a hold asked by a caller that is not a runner, hold_ms and end_hold
    both set, or hold_ms past max_hold_ms; PERMISSION_DENIED for a hold of a runner whose
    process the daemon cannot see (it could never be fenced)."""
    if hold == NO_HOLD:
        return
    field = "hold_ms" if hold.hold_ms else "end_hold"
    if not trusted_caller():
        raise InvalidArgument(f"{field} is for runners only (callers on the daemon's runner "
                              "socket); leave it unset")
    if hold.hold_ms and hold.end:
        raise InvalidArgument("hold_ms and end_hold are both set; send one")
    if hold.hold_ms > limits.max_hold_ms:
        raise InvalidArgument(f"hold_ms={hold.hold_ms}; the limit is "
                              f"max_hold_ms={limits.max_hold_ms}")
    caller = current_caller()
    if hold.hold_ms and caller is not None and caller.process is None:
        raise PermissionDenied("hold_ms refused: the daemon cannot see this runner's process "
                               "(its pid namespace is not the daemon's), so it could not stop "
                               "it if it stalled past its hold; run the runner in the "
                               "daemon's pid namespace")


def holder() -> RunnerProcess | None:
    """The runner process of the call being served (None: the daemon's own code)."""
    caller = current_caller()
    return None if caller is None else caller.process


def check_release(session: Session, now: float, rpc: str) -> None:
    """Refuse (`SessionBusy`) a free of the session's memory by a caller that is not a runner
    while a runner holds the session (a lapsed hold's runner is fenced meanwhile). The message
    names the session by its label (its client_name, never its id) and says how long the hold
    still lasts."""
    if trusted_caller() or not session.held(now, rpc):
        return
    raise SessionBusy(f"{rpc} refused: {busy_reason(session, now)}; release the sequences "
                      "through the runner (its release ends the hold), or retry once the hold "
                      "is over")


def busy_reason(session: Session, now: float) -> str:
    """Why a held session's blocks cannot be freed yet, for SessionBusy's message."""
    left_ms = session.hold_left_ms(now)
    if left_ms:
        return (f"a runner holds session {session.label} for {left_ms} ms more (a forward of "
                "it may still write its blocks)")
    return (f"the runner holding session {session.label} stalled past its hold; it is being "
            "stopped (fenced) before its blocks are freed, a moment")


def apply_hold(session: Session, hold: Hold, now: float) -> None:
    """Set or end the calling runner's hold on the session as an applied call asked."""
    process = holder()
    if hold.end:
        session.holds.pop(process, None)
    elif hold.hold_ms:
        session.holds[process] = max(session.holds.get(process, 0.0), now + hold.hold_ms / 1000)
