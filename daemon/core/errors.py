"""Caller mistakes, raised by the block pool and mapped to their causes (`pagedkv.vocab.causes`)
and gRPC status codes at the edge (`daemon/edge/status.py`).

The pool has three error tiers:
- "does not fit" is an ordinary result (`NoFit`), never an exception: callers plan around it;
- a caller mistake raises a `PoolError` subclass below, before any state changes;
- a broken internal invariant is an `assert` with a message (a bug in pagedkv, never input).
"""


class PoolError(Exception):
    """Base class of every caller mistake the block pool reports."""


class InvalidArgument(PoolError):
    """Negative or inconsistent counts, token_ids of the wrong length, bad logical block."""


class SequenceNotFound(PoolError):
    """The sequence id is not known to the pool."""


class SequenceExists(PoolError):
    """The sequence id is already in use."""
