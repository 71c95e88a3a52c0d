"""The daemon's caps on what clients may ask of it, and how input is echoed back.

Every cap has a default, a maximum, a TOML key and a flag of the same name (`max_sessions`,
`--max-sessions`); `LIMITS` lists them and ops/OPERATIONS.md ("Limits") documents them. A request
over a cap is refused before anything changes, with a message naming the cap:

- INVALID_ARGUMENT (`InvalidArgument`) for a request malformed by its own size: too many ops,
  Step entries or seq ids in one call, too many tokens in one op or slots reserved ahead by
  one Step (`max_reserve_tokens`), more work in one call than
  `max_call_work` (call_work.py), a name, salt or session id too long;
- RESOURCE_EXHAUSTED (`LimitExceeded`, cause "LimitExceeded"; `AnswerTooLarge` for the answer)
  for a request that is well formed but would take more than the daemon grants: one session
  too many, one sequence too many in a session, or an answer over `max_answer_bytes`.

Three caps come before any call, on unix-socket connections when the peer-credential gate
serves the unix sockets (peer_gate.py): a connection beyond `max_unix_connections` (all uids)
or `max_unix_connections_per_uid` (its uid's share) is closed as soon as it is accepted, and a
warning naming the cap is logged (rate-limited); the caller sees UNAVAILABLE. A connection idle
(no byte either way) for `max_unix_connection_idle_ms` is closed.

Others bound calls and connections rather than refuse a request: each gRPC server serves at
most `max_concurrent_rpcs` calls at once (one more is refused by gRPC itself, RESOURCE_EXHAUSTED
with no cause) and closes silent or idle connections (`keepalive_time_ms`,
`keepalive_timeout_ms`, `max_connection_idle_ms`; pagedkv.process.server_bounds, which the
runner's server shares); a request over 64 KiB waits, unparsed, while the requests parsed and not
yet answered take `max_queued_request_bytes` (request_budget.py).

Together the caps bound the daemon's memory: sessions x sequences bound the bookkeeping, the
pool bounds the blocks, calls in flight and their parsed requests are bounded as just said, and
`max_answer_bytes` (by default under gRPC's default 4 MiB receive
limit, at most `MAX_MESSAGE_BYTES`, the message size the daemon and the bundled client both
accept) bounds what any one call builds.

Input is never echoed unbounded: `clip` cuts text for error messages and logs, with a marker.
"""

from dataclasses import dataclass, fields

from pagedkv.daemon.core import InvalidArgument
from pagedkv.process.server_bounds import SERVER_BOUNDS, BoundSpec, ServerBounds, check_ranges
from pagedkv.proto.limits import DEFAULT_ANSWER_BYTES, MAX_MESSAGE_BYTES

# Characters of client input an error message or log line may quote.
ECHO_CHARS = 64


# The range of one cap and its --help line: the same record as the servers' bounds.
LimitSpec = BoundSpec


# The caps: name -> range and help. Defaults are the `Limits` fields' defaults.
LIMITS: dict[str, LimitSpec] = {
    "max_sessions": LimitSpec(1, 1 << 16, "live sessions at once"),
    "max_seqs_per_session": LimitSpec(1, 1 << 20, "live sequences in one session"),
    "max_blocks_per_session": LimitSpec(1, 2**32 - 1, "block-table entries one session may "
                                        "hold; a session asking for more (or for 0) gets this"),
    "max_batch_ops": LimitSpec(1, 1 << 16, "ops in one Batch"),
    # pagedkv runner sends up to 64 (model_runner/engine/daemon_steps.py).
    "max_steps_per_call": LimitSpec(64, 4096, "Step entries in one StepMany"),
    "max_seq_ids": LimitSpec(1, 1 << 20, "seq ids in one Step, Commit or GetBlockTables"),
    "max_tokens": LimitSpec(1, 1 << 24, "tokens one op adds (a Step: sequences x tokens)"),
    # 0 turns reservations off; the default fits a runner reserving two blocks of 128 ahead.
    "max_reserve_tokens": LimitSpec(0, 1 << 16, "slots a Step may reserve ahead of each "
                                    "sequence's tokens (reserve_tokens)"),
    "max_client_name_bytes": LimitSpec(1, 4096, "bytes of an OpenSession client_name"),
    "max_cache_salt_bytes": LimitSpec(1, 4096, "bytes of an OpenSession cache_salt"),
    # The daemon's own ids take about 55 bytes.
    "max_session_id_bytes": LimitSpec(64, 4096, "bytes of a request's session_id"),
    # A runner renews its hold well before it lapses; past a minute a crashed runner would
    # keep clients from freeing for too long.
    "max_hold_ms": LimitSpec(100, 60_000, "milliseconds a runner may hold a session in one "
                             "call (hold_ms): no Free or CloseSession of other callers until "
                             "the hold ends"),
    "max_answer_bytes": LimitSpec(4096, MAX_MESSAGE_BYTES, "encoded bytes of one answer"),
    "max_call_work": LimitSpec(1024, 1 << 24, "items one call names or adds: ops, seq ids and "
                               "blocks of new tokens, over all its ops (a StepMany: each entry)"),
    # At least the largest request gRPC accepts, which must always fit.
    "max_queued_request_bytes": LimitSpec(MAX_MESSAGE_BYTES, 1 << 36, "wire bytes of the "
                                          "requests over 64 KiB parsed and not yet answered; "
                                          "one more waits, unparsed"),
    # Both gRPC servers' bounds on calls and connections (pagedkv.process.server_bounds).
    **SERVER_BOUNDS,
    # Each takes 3 file descriptors (the caller's, the gate's to gRPC, gRPC's): the maximum
    # stays under the unit's LimitNOFILE=65536.
    "max_unix_connections": LimitSpec(1, 16384, "unix-socket connections open at once through "
                                      "the peer-credential gate (when tenants list uids)"),
    "max_unix_connections_per_uid": LimitSpec(1, 16384, "of those, connections one uid may "
                                              "hold open at once"),
    # At least 100 ms: a client between two calls of one step must not be cut off.
    "max_unix_connection_idle_ms": LimitSpec(100, 86_400_000, "milliseconds a gate connection "
                                             "may pass no byte either way before it is "
                                             "closed"),
}


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on what clients may ask (see the module docstring); checked on construction."""

    # Live sessions at once (OpenSession beyond it: RESOURCE_EXHAUSTED).
    max_sessions: int = 1024
    # Live sequences in one session (Allocate or Fork beyond it: RESOURCE_EXHAUSTED).
    max_seqs_per_session: int = 4096
    # Block-table entries one session may hold: the quota a session gets when it asks for none,
    # and the most it may ask for (a larger OpenSession.max_blocks is clamped to it).
    max_blocks_per_session: int = 1 << 20
    # Operations in one Batch.
    max_batch_ops: int = 1024
    # Step entries in one StepMany (each entry's own Step limits apply to it).
    max_steps_per_call: int = 256
    # Sequence ids in one Step, Commit or GetBlockTables (distinct ones only).
    max_seq_ids: int = 65_536
    # Tokens one operation adds (Allocate/Append num_tokens; a Step's seqs x num_tokens).
    max_tokens: int = 1 << 20
    # Slots one Step may reserve past each sequence's tokens (StepRequest.reserve_tokens): a
    # runner decoding ahead holds a block or two, so a larger request is a mistake; reserved
    # blocks count against the session's quota as every table entry.
    max_reserve_tokens: int = 256
    # UTF-8 bytes of OpenSessionRequest.client_name (shown in stats and logs).
    max_client_name_bytes: int = 128
    # Bytes of OpenSessionRequest.cache_salt.
    max_cache_salt_bytes: int = 256
    # Bytes of any request's session_id (longer ones are refused before any look-up).
    max_session_id_bytes: int = 128
    # The most a runner's call may hold a session for (hold_ms; kvpool.proto's "Runner
    # holds"): what a runner that died mid-forward keeps its clients' frees refused for.
    max_hold_ms: int = 10_000
    # Encoded bytes of one answer, bounded before it is built; at most MAX_MESSAGE_BYTES. The
    # default fits gRPC's default receive limit (4 MiB), which stock clients keep.
    max_answer_bytes: int = DEFAULT_ANSWER_BYTES
    # Items one call names or adds (Batch ops, seq ids, blocks of the tokens it adds; each
    # StepMany entry alone), counted from the request before the lock: a call's work, not only
    # its answer, is bounded, so no call holds the pool lock for long (1,024 Commits of 4,096
    # seq ids took 0.85 s).
    max_call_work: int = 1 << 18
    # Wire bytes of the requests over 64 KiB parsed and not yet answered (request_budget.py).
    max_queued_request_bytes: int = 32 * 2**20
    # Calls each gRPC server serves at once, and its connections' keepalive and idle bounds.
    max_concurrent_rpcs: int = ServerBounds().max_concurrent_rpcs
    keepalive_time_ms: int = ServerBounds().keepalive_time_ms
    keepalive_timeout_ms: int = ServerBounds().keepalive_timeout_ms
    max_connection_idle_ms: int = ServerBounds().max_connection_idle_ms
    # Unix-socket connections open at once through the peer-credential gate (peer_gate.py);
    # one more is closed at once, with a warning naming this limit.
    max_unix_connections: int = 1024
    # Of those, connections one uid may hold at once: its share, so that one uid (one tenant,
    # or a runaway client) cannot take every connection and lock the other uids out.
    max_unix_connections_per_uid: int = 64
    # A gate connection passing no byte either way this long is closed (a gRPC client
    # reconnects on its next call), so idle connections do not hold their uid's share forever.
    max_unix_connection_idle_ms: int = 120_000

    def __post_init__(self) -> None:
        check_ranges(self, LIMITS)

    def server_bounds(self) -> ServerBounds:
        """The gRPC servers' bounds among these limits."""
        return ServerBounds(**{name: getattr(self, name) for name in SERVER_BOUNDS})

    def check_count(self, what: str, count: int, limit: str) -> None:
        """Refuse `count` items of `what` above the cap named `limit` (INVALID_ARGUMENT)."""
        cap = getattr(self, limit)
        if count > cap:
            raise InvalidArgument(f"{count} {what} in one request; the limit is {limit}={cap}")

    def check_length(self, what: str, value: str | bytes, limit: str) -> None:
        """Refuse a name, salt or id longer than the cap named `limit` (INVALID_ARGUMENT)."""
        cap = getattr(self, limit)
        size = len(value.encode() if isinstance(value, str) else value)
        if size > cap:
            raise InvalidArgument(f"{what} of {size} bytes; the limit is {limit}={cap}")


assert set(LIMITS) == {f.name for f in fields(Limits)}, "a limit has no spec"


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` for an error message or a log line: at most `limit` characters, then a marker
    saying how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more chars]"
