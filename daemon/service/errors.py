"""Every error the daemon's service answers a caller with, and the cause each travels as.

Three tiers, as in the block pool (`daemon/core/errors.py`): a call that does not fit is refused
with a `PoolError` below before anything changes (or inside its transaction, which undoes it);
a caller's mistake is a `PoolError` too; a broken internal invariant is an `assert`. Each class
says its cause of `pagedkv.vocab.causes` and the gRPC status code that cause travels with;
`CAUSES` is the table the edge maps exceptions by (`daemon/edge/status.py`: the cause in the
trailing metadata `pagedkv-error`, the message as the status's details). Anything else is a bug
and answers INTERNAL, `MemoryFailed` included: the pool stops serving (`memory_order.py`).

Exceptions that never reach a caller stay beside their code: `NotLogged` (the crash log stops,
`crash_log.py`) and `NotKept` (a restart starts cold, `service_image.py`).
"""

from pagedkv.daemon.core.errors import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from pagedkv.vocab import causes
from pagedkv.vocab.causes import Cause

__all__ = [
    "CAUSES", "AnswerTooLarge", "InvalidArgument", "LimitExceeded", "MemoryFailed",
    "ModelAsleep", "ModelAtCap", "ModelExists", "ModelNotFound", "PermissionDenied",
    "PoolError", "PoolExhausted", "PoolFull", "SequenceExists", "SequenceNotFound",
    "SessionBusy", "SessionExpired", "SessionNotFound",
]


class SessionNotFound(PoolError):
    """The session id was never issued by this daemon, or the session was closed.
    SessionNotFound, NOT_FOUND."""


class SessionExpired(PoolError):
    """The session missed its lease, or comes from before a daemon restart.
    SessionExpired, FAILED_PRECONDITION."""


class SessionBusy(PoolError):
    """A runner holds the session: its forward may still write the session's blocks, so a
    caller that is not a runner may not free them yet; nothing changed (holds.py).
    SessionBusy, FAILED_PRECONDITION."""


class PermissionDenied(PoolError):
    """The caller's tenant may not do this (e.g. use that cache salt, commit under a shared
    salt, hold a session as a runner the daemon cannot see). PermissionDenied,
    PERMISSION_DENIED."""


class PoolExhausted(PoolError):
    """The pool, or the session's quota, has no room for the request; nothing changed.
    PoolExhausted, RESOURCE_EXHAUSTED."""


class PoolFull(PoolExhausted):
    """The pool has no room for the call: it needs `needed` blocks, `available` are free
    (the page broker may give the format pages and the call be tried again: formats.py).
    PoolExhausted, RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, needed: int = 0, available: int = 0) -> None:
        super().__init__(message)
        # Blocks the call needs, and blocks its format had free when it was refused.
        self.needed = needed
        self.available = available


class LimitExceeded(PoolError):
    """A well-formed request would take more than the daemon grants (limits.py).
    LimitExceeded, RESOURCE_EXHAUSTED."""


class AnswerTooLarge(LimitExceeded):
    """The answer would exceed `max_answer_bytes`; the call was refused, nothing changed.
    AnswerTooLarge, RESOURCE_EXHAUSTED."""


class ModelNotFound(PoolError):
    """No model of that name is registered. ModelNotFound, NOT_FOUND."""


class ModelExists(PoolError):
    """The name is registered with another geometry. ModelExists, ALREADY_EXISTS."""


class ModelAtCap(PoolError):
    """The call would take the model past its max_memory; nothing changed.
    ModelAtCap, RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, excess_blocks: int = 0) -> None:
        super().__init__(message)
        # Blocks of its format the model is over its cap by, after the call.
        self.excess_blocks = excess_blocks


class ModelAsleep(PoolError):
    """The model sleeps: no new session of it until it is woken.
    ModelAsleep, FAILED_PRECONDITION."""


class MemoryFailed(RuntimeError):
    """Pool memory work failed: the pool stops serving (memory_order.py). Not a caller's
    mistake: Internal, INTERNAL, and pagedkvd exits with a failure status."""


# Each exception's cause; first match wins: subclasses before their bases. The core's own
# (InvalidArgument, SequenceNotFound: NOT_FOUND, SequenceExists: ALREADY_EXISTS) are here too.
CAUSES: tuple[tuple[type[PoolError], Cause], ...] = (
    (SessionNotFound, causes.SESSION_NOT_FOUND),
    (SequenceNotFound, causes.SEQUENCE_NOT_FOUND),
    (SequenceExists, causes.SEQUENCE_EXISTS),
    (PoolExhausted, causes.POOL_EXHAUSTED),
    (AnswerTooLarge, causes.ANSWER_TOO_LARGE),
    (LimitExceeded, causes.LIMIT_EXCEEDED),
    (SessionExpired, causes.SESSION_EXPIRED),
    (SessionBusy, causes.SESSION_BUSY),
    (PermissionDenied, causes.PERMISSION_DENIED),
    (ModelNotFound, causes.MODEL_NOT_FOUND),
    (ModelExists, causes.MODEL_EXISTS),
    (ModelAtCap, causes.MODEL_AT_CAP),
    (ModelAsleep, causes.MODEL_ASLEEP),
    (InvalidArgument, causes.INVALID_ARGUMENT),
    (PoolError, causes.INVALID_ARGUMENT),
)
