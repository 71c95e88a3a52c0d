"""Python exceptions for the daemon's gRPC statuses, named after the cause.

The daemon names the cause of a failed call in the trailing metadata `pagedkv-error` (e.g.
"SequenceNotFound"); codes that mean one thing map directly. Every exception carries the
status `.code` and the daemon's message.
"""

from typing import Any

import grpc

# Trailing-metadata key the daemon puts the cause of a failure in (pagedkv.daemon.status).
ERROR_KEY = "pagedkv-error"


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


class SessionExpired(PagedKVError):
    """FAILED_PRECONDITION: the session missed its lease or predates a daemon restart."""


class Unauthenticated(PagedKVError):
    """UNAUTHENTICATED: a TCP call without the right bearer token."""


class PermissionDenied(PagedKVError):
    """PERMISSION_DENIED: the caller's tenant may not do this (e.g. use that cache salt)."""


class DaemonUnavailable(PagedKVError):
    """UNAVAILABLE: no daemon answers at the target."""


class UnknownSequence(PagedKVError):
    """FAILED_PRECONDITION from a runner that does not know a sequence (it restarted): resend
    the sequence with its history (`SeqStep.history`); nothing was changed."""


_BY_CAUSE: dict[str, type[PagedKVError]] = {
    "UnknownSequence": UnknownSequence,
    "SessionNotFound": SessionNotFound,
    "SequenceNotFound": SequenceNotFound,
}

_BY_CODE: dict[grpc.StatusCode, type[PagedKVError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: SequenceExists,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PoolExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: SessionExpired,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
}


def error_from_rpc(error: grpc.aio.AioRpcError) -> PagedKVError:
    """The exception for a failed call, from its status and `pagedkv-error` metadata."""
    code = error.code()
    kind = _BY_CAUSE.get(_cause(error)) or _BY_CODE.get(code, PagedKVError)
    return kind(code, error.details() or "")


def _cause(error: grpc.aio.AioRpcError) -> str:
    """The `pagedkv-error` value, or "" (grpc-stubs mistype aio metadata, hence the Any)."""
    metadata: Any = error.trailing_metadata() or ()
    for key, value in metadata:
        if key == ERROR_KEY:
            return str(value)
    return ""
