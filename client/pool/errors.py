"""Python exceptions for the daemon's and the runner's gRPC statuses, one per cause.

A daemon or runner names the cause of a failed call in the trailing metadata `pagedkv-error`
(e.g. "SequenceNotFound", a name of `pagedkv.vocab.causes`), and `BY_CAUSE` gives its class.
Only a status without a cause (from gRPC itself, or a peer that names none) is mapped by its
code, and a code never stands for a cause it may not mean: a RESOURCE_EXHAUSTED without a cause
comes from gRPC's own checks (a message over MAX_MESSAGE_BYTES), never from the pool, so it is
`MessageTooLarge`, not `PoolExhausted`. Every exception carries the status `.code` and the
message.

Whether the call changed anything: every error the daemon or runner answers means nothing
changed, but a runner's `StepNotComputed`; an `OutcomeUnknown` (UNAVAILABLE, DEADLINE_EXCEEDED,
CANCELLED, gRPC's RESOURCE_EXHAUSTED) means the call may or may not have been applied: read the
state back before retrying (kvpool.proto, "Retry rules"; `Session` does it for allocate, step
and free).
"""

from typing import Any

import grpc

from pagedkv.proto.metadata import ERROR_KEY
from pagedkv.vocab import causes
from pagedkv.vocab.causes import Cause


class PagedKVError(Exception):
    """A failed pagedkv call: `.code` is the gRPC status, `.message` what the daemon said."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class NotFound(PagedKVError):
    """NOT_FOUND: an unknown session or sequence."""


class SessionNotFound(NotFound):
    """The session id is unknown to the daemon (never issued, or closed)."""


class SequenceNotFound(NotFound):
    """The session has no sequence with this id (other sessions' sequences are invisible)."""


class SequenceExists(PagedKVError):
    """ALREADY_EXISTS: the seq id is in use in this session."""


class InvalidArgument(PagedKVError):
    """INVALID_ARGUMENT: counts, ids or sizes that make no sense; nothing changed."""


class PoolExhausted(PagedKVError):
    """RESOURCE_EXHAUSTED: the pool or the session quota has no room; nothing changed."""


class LimitExceeded(PagedKVError):
    """RESOURCE_EXHAUSTED: a daemon limit (max_sessions, max_seqs_per_session, ...) would be
    passed; the message names it; nothing changed."""


class AnswerTooLarge(LimitExceeded):
    """RESOURCE_EXHAUSTED: the answer would pass the daemon's max_answer_bytes; nothing
    changed. Ask for less per call (fewer tokens, ops or seq ids)."""


class SessionExpired(PagedKVError):
    """FAILED_PRECONDITION: the session missed its lease or predates a daemon restart."""


class SessionBusy(PagedKVError):
    """FAILED_PRECONDITION: a Free, CloseSession or Batch free while a runner holds the session
    (its forward may still write the session's blocks); nothing changed. Release the sequences
    through the runner (it frees them after its forwards and ends the hold), or retry once the
    hold is over (the message says how long it lasts; kvpool.proto, "Runner holds")."""


class ModelNotFound(NotFound):
    """NOT_FOUND: no model of that name is registered with the daemon (the message lists those
    that are); nothing changed."""


class ModelExists(PagedKVError):
    """ALREADY_EXISTS: the model name is registered with another KV geometry; nothing changed.
    Register the model under another name."""


class ModelAtCap(PoolExhausted):
    """RESOURCE_EXHAUSTED: the call would take the model past its max_memory (the message names
    the model and its cap); nothing changed."""


class ModelAsleep(PagedKVError):
    """FAILED_PRECONDITION: the model sleeps (`pagedkv model wake NAME`, SetModelState);
    nothing changed."""


class Unauthenticated(PagedKVError):
    """UNAUTHENTICATED: a TCP call without the right bearer token."""


class PermissionDenied(PagedKVError):
    """PERMISSION_DENIED: the caller's tenant may not do this (e.g. use that cache salt)."""


class OutcomeUnknown(PagedKVError):
    """The call may or may not have been applied (its answer may be what was lost): read the
    state back before retrying it."""


class DaemonUnavailable(OutcomeUnknown):
    """UNAVAILABLE: no daemon answers at the target, or the connection broke mid-call."""


class RunnerUnreachable(OutcomeUnknown):
    """UNAVAILABLE with no cause from a runner's channel: no runner answers at the target, or
    the connection broke mid-step (a runner killed while it computed). Unlike
    RunnerUnavailable (a runner that answered, nothing changed), the step may have reached the
    daemon: read the sequences back before resending it."""


class DeadlineExceeded(OutcomeUnknown):
    """DEADLINE_EXCEEDED: no answer within the call's timeout."""


class Cancelled(OutcomeUnknown):
    """CANCELLED: the call was cancelled before its answer arrived (e.g. a daemon stopping)."""


class MessageTooLarge(OutcomeUnknown):
    """RESOURCE_EXHAUSTED from gRPC itself (no daemon cause): the request, or the answer, was
    over MAX_MESSAGE_BYTES (or over a gRPC concurrency limit). Not retried as it is."""


class UnknownSequence(PagedKVError):
    """FAILED_PRECONDITION from a runner that does not know a sequence (it restarted): resend
    the sequence with its history (`SeqStep.history`); nothing was changed."""


class RunnerUnavailable(PagedKVError):
    """UNAVAILABLE from a runner that answers but cannot compute now: its daemon is away, or
    restarted and the runner is mapping the new pool; nothing changed. Retry later (after a
    daemon restart, in a new session)."""


class StepNotComputed(PagedKVError):
    """ABORTED from a runner: the step's daemon calls were applied (its sequences hold its
    tokens, in the daemon and the runner) but its forward failed. Never resend it as it was
    (it would append twice): resend it without token_ids, every sequence as an existing one,
    or release its sequences."""


class StalePlan(PagedKVError):
    """ABORTED from a runner following the session (runner.proto's `follow`): the step was
    planned before answers the runner has pushed since (`pushes_read` too low); nothing
    changed and the runner no longer follows. Read those answers, plan again, send again."""


class Unsupported(PagedKVError):
    """FAILED_PRECONDITION from a runner that cannot do what the step asks (structured outputs
    on a model without a tokenizer); nothing changed. Retrying does not help."""


# The class of each cause (INTERNAL, a bug in the daemon or runner, is the base class's, by its
# code); a runner relays its own client's errors by the same names.
BY_CAUSE: dict[str, type[PagedKVError]] = {
    causes.SESSION_NOT_FOUND.name: SessionNotFound,
    causes.SEQUENCE_NOT_FOUND.name: SequenceNotFound,
    causes.SEQUENCE_EXISTS.name: SequenceExists,
    causes.INVALID_ARGUMENT.name: InvalidArgument,
    causes.POOL_EXHAUSTED.name: PoolExhausted,
    causes.LIMIT_EXCEEDED.name: LimitExceeded,
    causes.ANSWER_TOO_LARGE.name: AnswerTooLarge,
    causes.SESSION_EXPIRED.name: SessionExpired,
    causes.SESSION_BUSY.name: SessionBusy,
    causes.PERMISSION_DENIED.name: PermissionDenied,
    causes.MODEL_NOT_FOUND.name: ModelNotFound,
    causes.MODEL_EXISTS.name: ModelExists,
    causes.MODEL_AT_CAP.name: ModelAtCap,
    causes.MODEL_ASLEEP.name: ModelAsleep,
    causes.UNKNOWN_SEQUENCE.name: UnknownSequence,
    causes.STEP_NOT_COMPUTED.name: StepNotComputed,
    causes.RUNNER_UNAVAILABLE.name: RunnerUnavailable,
    causes.STALE_PLAN.name: StalePlan,
    causes.UNSUPPORTED.name: Unsupported,
    causes.NOT_FOUND.name: NotFound,
    causes.UNAUTHENTICATED.name: Unauthenticated,
    causes.DAEMON_UNAVAILABLE.name: DaemonUnavailable,
    causes.DEADLINE_EXCEEDED.name: DeadlineExceeded,
    causes.CANCELLED.name: Cancelled,
    causes.MESSAGE_TOO_LARGE.name: MessageTooLarge,
}
# The cause of each class, for a runner that relays an error it met.
_CAUSE_OF: dict[type[PagedKVError], Cause] = {
    kind: causes.CAUSES[name] for name, kind in BY_CAUSE.items()}

# Statuses without a cause: what the code alone may mean.
_BY_CODE: dict[grpc.StatusCode, type[PagedKVError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: SequenceExists,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLarge,
    grpc.StatusCode.FAILED_PRECONDITION: SessionExpired,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_from_rpc(error: grpc.aio.AioRpcError,
                   unreachable: type[OutcomeUnknown] = DaemonUnavailable) -> PagedKVError:
    """The exception for a failed call, from its status and `pagedkv-error` metadata
    (`unreachable`: see `error_from_status`)."""
    return error_from_status(error.code(), _cause(error), error.details() or "", unreachable)


def error_from_status(code: grpc.StatusCode, cause: str, message: str,
                      unreachable: type[OutcomeUnknown] = DaemonUnavailable) -> PagedKVError:
    """The exception for a status with its cause ("" when none): a failed call's, or a failed
    entry's of a call that fails per entry (StepMany). An UNAVAILABLE that names no cause is
    `unreachable`: the peer did not answer (DaemonUnavailable on a daemon's channel,
    RunnerUnreachable on a runner's)."""
    kind = BY_CAUSE.get(cause) or (unreachable if code == grpc.StatusCode.UNAVAILABLE
                                   else _BY_CODE.get(code, PagedKVError))
    return kind(code, message)


def cause_of_error(error: PagedKVError) -> Cause | None:
    """The cause `error` is named after, to relay it; None for the base class (a status with
    no cause of pagedkv's: relay its code alone)."""
    return _CAUSE_OF.get(type(error))


# grpc.StatusCode by its number (the code of a StepMany entry).
STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def _cause(error: grpc.aio.AioRpcError) -> str:
    """The `pagedkv-error` value, or "" (grpc-stubs mistype aio metadata, hence the Any)."""
    metadata: Any = error.trailing_metadata() or ()
    for key, value in metadata:
        if key == ERROR_KEY:
            return str(value)
    return ""
