"""Domain exceptions -> causes and gRPC status codes, at the edge of the daemon.

The block pool and the service raise `PoolError` subclasses for everything a caller got wrong
(every one, and its cause, in `daemon/service/errors.py`); `grpc_errors` turns each into its
cause of `pagedkv.vocab.causes` (the status code it travels with, named in the trailing metadata
`pagedkv-error` so clients can tell apart causes that share a code) and the exception's
message. Anything else is a bug in pagedkv: the caller gets INTERNAL
(cause "Internal"), the log gets the traceback, and the server keeps serving, but after
`MemoryFailed` (pool memory work failed: the pool stops, daemon/service/memory_order.py).
Any other failed call leaves the pool as it was, but not every raise comes before the change: the
service runs each call in a transaction of the pool's undo journal (`Journal`), and a check that
runs once the call has changed the pool (the tenant's max_blocks, checked after the call's
blocks are taken; a later op of a Batch) raises inside it, so the journal undoes the change.
"""

from __future__ import annotations

import grpc

from pagedkv.daemon.service.errors import CAUSES
from pagedkv.process.grpc_errors import errors_to_status
from pagedkv.process.log_setup import get_logger
from pagedkv.vocab import causes
from pagedkv.vocab.causes import Cause

log = get_logger(__name__)


def cause_of(exc: Exception) -> Cause:
    """The cause a client gets for `exc` (INTERNAL: not a caller's mistake, a bug)."""
    for kind, cause in CAUSES:
        if isinstance(exc, kind):
            return cause
    return causes.INTERNAL


def failure_of(exc: Exception, rpc: str) -> tuple[grpc.StatusCode, str, str]:
    """(code, cause, message) of a failed call, or of one failed entry of a call that fails per
    entry (StepMany); an internal error is logged with its traceback, and its message names
    only the exception's class."""
    cause = cause_of(exc)
    if cause is causes.INTERNAL:
        log.exception("unexpected error in an RPC", rpc=rpc)
        message = f"internal error ({type(exc).__name__}); see the daemon log"
    else:
        message = str(exc)
    return grpc.StatusCode[cause.code], cause.name, message


# Wraps the daemon's servicer methods: every exception becomes its status (`failure_of`).
grpc_errors = errors_to_status(lambda _servicer, exc, rpc: failure_of(exc, rpc))
