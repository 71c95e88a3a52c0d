"""Python exceptions for the daemon's gRPC statuses, named after the cause.

The daemon names the cause of a failed call in the trailing metadata `pagedkv-error` (e.g.
"SequenceNotFound"), and the exception is the class of that name. Only a status without a
cause (from gRPC itself, or a peer that names none) is mapped by its code, and a code never
stands for a cause it may not mean: a RESOURCE_EXHAUSTED without a cause comes from gRPC's own
checks (a message over MAX_MESSAGE_BYTES), never from the pool, so it is `MessageTooLarge`,
not `PoolExhausted`. Every exception carries the status `.code` and the message.

Whether the call changed anything: every error the daemon answers means nothing changed;
an `OutcomeUnknown` (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, gRPC's RESOURCE_EXHAUSTED)
means the call may or may not have been applied: read the state back before retrying
(kvpool.proto, "Retry rules"; `Session` does it for allocate, step and free).
"""

from typing import Any

import grpc

from pagedkv.proto.metadata import ERROR_KEY


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


class Unauthenticated(PagedKVError):
    """UNAUTHENTICATED: a TCP call without the right bearer token."""


class PermissionDenied(PagedKVError):
    """PERMISSION_DENIED: the caller's tenant may not do this (e.g. use that cache salt)."""


class OutcomeUnknown(PagedKVError):
    """The call may or may not have been applied (its answer may be what was lost): read the
    state back before retrying it."""


class DaemonUnavailable(OutcomeUnknown):
    """UNAVAILABLE: no daemon answers at the target, or the connection broke mid-call."""


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


class StepNotComputed(PagedKVError):
    """ABORTED from a runner: the step's daemon calls were applied (its sequences hold its
    tokens, in the daemon and the runner) but its forward failed. Never resend it as it was
    (it would append twice): resend it without token_ids, every sequence as an existing one,
    or release its sequences."""


# A cause names the exception class ("PoolExhausted"); a runner relays the client's own names.
_BY_CAUSE: dict[str, type[PagedKVError]] = {kind.__name__: kind for kind in (
    NotFound, SessionNotFound, SequenceNotFound, SequenceExists, InvalidArgument, PoolExhausted,
    LimitExceeded, AnswerTooLarge, SessionExpired, SessionBusy, Unauthenticated,
    PermissionDenied,
    UnknownSequence, StepNotComputed,
    DaemonUnavailable, DeadlineExceeded, Cancelled, MessageTooLarge)}

# Statuses without a cause: what the code alone may mean.
_BY_CODE: dict[grpc.StatusCode, type[PagedKVError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: SequenceExists,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLarge,
    grpc.StatusCode.FAILED_PRECONDITION: SessionExpired,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_from_rpc(error: grpc.aio.AioRpcError) -> PagedKVError:
    """The exception for a failed call, from its status and `pagedkv-error` metadata."""
    return error_from_status(error.code(), _cause(error), error.details() or "")


def error_from_status(code: grpc.StatusCode, cause: str, message: str) -> PagedKVError:
    """The exception for a status with its cause ("" when none): a failed call's, or a failed
    entry's of a call that fails per entry (StepMany)."""
    kind = _BY_CAUSE.get(cause) or _BY_CODE.get(code, PagedKVError)
    return kind(code, message)


# grpc.StatusCode by its number (the code of a StepMany entry).
STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def _cause(error: grpc.aio.AioRpcError) -> str:
    """The `pagedkv-error` value, or "" (grpc-stubs mistype aio metadata, hence the Any)."""
    metadata: Any = error.trailing_metadata() or ()
    for key, value in metadata:
        if key == ERROR_KEY:
            return str(value)
    return ""
