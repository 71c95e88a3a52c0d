"""pagedkv.client: a typed async client for the pagedkv daemon (imports only grpc and protobuf)."""

from .client import DEFAULT_TIMEOUT_S, PoolClient, Session
from .errors import (
    DaemonUnavailable,
    InvalidArgument,
    NotFound,
    PagedKVError,
    PermissionDenied,
    PoolExhausted,
    SequenceExists,
    SequenceNotFound,
    SessionExpired,
    SessionNotFound,
    Unauthenticated,
    UnknownSequence,
)
from .ops import Allocate, Append, Commit, CopyOnWrite, Fork, Free, Operation
from .runner_client import RunnerClient, SeqOutput, SeqStep
from .sampling_params import SamplingParams
from .tls import TlsOptions
from .types import (
    BlockCopy,
    PoolInfo,
    PoolStats,
    SequenceBlocks,
    SessionStats,
    StepResult,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Allocate",
    "Append",
    "BlockCopy",
    "Commit",
    "CopyOnWrite",
    "DaemonUnavailable",
    "Fork",
    "Free",
    "InvalidArgument",
    "NotFound",
    "Operation",
    "PagedKVError",
    "PermissionDenied",
    "PoolClient",
    "PoolExhausted",
    "PoolInfo",
    "PoolStats",
    "RunnerClient",
    "SamplingParams",
    "SeqOutput",
    "SeqStep",
    "SequenceBlocks",
    "SequenceExists",
    "SequenceNotFound",
    "Session",
    "SessionExpired",
    "SessionNotFound",
    "SessionStats",
    "StepResult",
    "TlsOptions",
    "Unauthenticated",
    "UnknownSequence",
]
