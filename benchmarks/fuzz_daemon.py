"""Stateful fuzzer for pagedkvd: random valid and invalid calls checked against a shadow model.

Six sessions (two pairs sharing a cache salt, one with a block quota) get seeded random calls
(`fuzz_calls`): valid ops, single and batched; Steps, some reserving slots ahead; ops that must
fail; edge values; junk session ids; malformed bytes through a generic method. Half the StepMany
calls go as messages on one KVPool.StepStream (`fuzz_stream`), kept open, and are judged as the
unary calls are (a message refused as a whole by the status in its answer). Around every
mutating call the caller's tables and the pool's figures are read: a call that fails must leave
both unchanged; one that succeeds is applied to the shadow (`fuzz_shadow`), which checks its
answer. Every `check_every` calls the daemon's tables and figures must equal the shadow's. At
the end every session is closed and the pool must hold no used block and no sequence. The
fuzzer must be the daemon's only client (it compares pool-wide figures).

Findings: `internal_errors` (INTERNAL, or UNKNOWN to a well-formed request), `violations` (a
failed call that changed state, an impossible answer, the daemon diverging from the shadow, an
invalid call accepted, a call with no answer: the run stops at the first one and names its
seed and call number), `malformed_unknown` (UNKNOWN answers to bytes that do not parse: counted
apart), `refusals` (valid calls refused with anything but RESOURCE_EXHAUSTED: reported, since
new limits may refuse them legitimately), `trailer_overflows` (error details too long for the
client's metadata limit: the client sees RESOURCE_EXHAUSTED instead of the daemon's code).

Usage: python benchmarks/fuzz_daemon.py [--seed 1] [--calls 30000] [--seconds 600]
"""

import argparse
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import grpc
from daemon_process import running_pagedkvd
from fuzz_calls import OP_RPCS, RESPONSES, CallMaker, Expect, Plan
from fuzz_shadow import SessionShadow, Shadow, Violation, rpc_code
from fuzz_stream import Refused, StepStreamClient
from pool_metrics import pool_figures

from pagedkv.client.pool.errors import STATUS_BY_NUMBER
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

# (cache salt, block quota) of each session; a closed one is replaced by one of the same kind.
SESSION_KINDS = ((b"team-a", 0), (b"team-a", 0), (b"", 0), (b"team-b", 0), (b"team-b", 0),
                 (b"", 24))
LEASE_TTL_MS = 120_000
# Lease of the sessions the fuzzer lets expire.
EXPIRING_LEASE_MS = 200
# The pool the fuzzer is meant for: small, so it runs out often.
DAEMON_ARGS = ("--num-blocks", "256", "--block-size", "16")
POOL_FIELDS = ("free_blocks", "used_blocks", "cached_blocks", "pending_blocks", "num_sequences",
               "prefix_cache_queries", "prefix_cache_hits")
SESSION_FIELDS = ("num_sequences", "block_table_entries", "blocks_held", "prefix_cache_queries",
                  "prefix_cache_hits")
# Findings kept in full (the counts go on).
KEEP = 20


@dataclass(frozen=True)
class FuzzConfig:
    seed: int = 1
    # Stop after this many fuzz calls or this many seconds, whichever comes first.
    calls: int = 3_000
    seconds: float = 60.0
    # Compare the daemon with the shadow every this many calls; let a session with sequences
    # expire every this many.
    check_every: int = 50
    expire_every: int = 500
    # Deadline of every call; a call that misses it is a finding.
    timeout_s: float = 10.0


@dataclass
class FuzzReport:
    calls: int = 0
    seconds: float = 0.0
    # Answers by status code name ("OK", "NOT_FOUND", ...), and by plan label and code.
    codes: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    internal_errors: list[str] = field(default_factory=list)
    malformed_unknown: int = 0
    violations: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    # Error answers whose status details overflowed the client's metadata limit, so it got
    # RESOURCE_EXHAUSTED ("Stream removed") instead of the daemon's code.
    trailer_overflows: list[str] = field(default_factory=list)
    # Comparisons of the daemon's tables with the shadow; sessions left to expire (their
    # blocks must come back).
    verifications: int = 0
    expiries: int = 0
    # Coverage: allocations that found cached blocks, copy-on-write copies.
    cache_hits: int = 0
    copies: int = 0
    # Used blocks and sequences left once every session is closed (-1: not measured).
    leaked_blocks: int = -1
    leftover_sequences: int = -1
    # StepStreams opened (1 + reopenings after a break; 0: no message streamed).
    streams_opened: int = 0

    def figures(self) -> list[str]:
        return [f"fuzz_calls: {self.calls} calls",
                f"fuzz_calls_per_s: {self.calls / max(self.seconds, 1e-9):.0f} calls/s",
                f"fuzz_internal_errors: {len(self.internal_errors)} errors",
                f"fuzz_malformed_unknown: {self.malformed_unknown} errors",
                f"fuzz_violations: {len(self.violations)} violations",
                f"fuzz_valid_refused: {len(self.refusals)} calls",
                f"fuzz_trailer_overflows: {len(self.trailer_overflows)} errors",
                f"fuzz_verifications: {self.verifications} checks",
                f"fuzz_expiries: {self.expiries} sessions",
                f"fuzz_cache_hits: {self.cache_hits} allocations",
                f"fuzz_copies: {self.copies} copies",
                f"fuzz_streams_opened: {self.streams_opened} streams",
                f"fuzz_leaked_blocks: {self.leaked_blocks} blocks"]

    def findings(self) -> list[str]:
        return [*self.violations[:KEEP], *self.internal_errors[:KEEP]]


def describe(plan: Plan) -> str:
    text = f"{plan.label} {plan.rpc}({plan.payload()[:80]!r})" if isinstance(
        plan.request, bytes) else f"{plan.label} {plan.rpc}({_short(plan.request)})"
    return text


def _short(message: Any) -> str:
    text = str(message).replace("\n", " ")
    return text if len(text) < 300 else text[:300] + "..."


class Fuzzer:
    """Runs plans against one daemon and keeps the shadow and the report."""

    def __init__(self, channel: grpc.Channel, metrics: str, config: FuzzConfig) -> None:
        # host:port of the daemon's /metrics: the pool-wide figures.
        self.metrics = metrics
        self.channel = channel
        self.config = config
        self.stub = kvpool_pb2_grpc.KVPoolStub(channel)
        self.steps = StepStreamClient(channel, config.timeout_s)
        info = self.stub.GetPoolInfo(pb.GetPoolInfoRequest(), timeout=config.timeout_s)
        self.shadow = Shadow(info.block_size)
        self.closed_ids: list[str] = []
        self.maker = CallMaker(random.Random(config.seed), self.shadow, info.num_blocks,
                               self.closed_ids)
        self.report = FuzzReport()
        # The last calls, named in a violation.
        self.recent: deque[str] = deque(maxlen=6)

    def run(self) -> FuzzReport:
        report, config = self.report, self.config
        start = time.monotonic()
        try:
            self.shadow.sessions = [self.open(salt, quota) for salt, quota in SESSION_KINDS]
            while report.calls < config.calls and time.monotonic() - start < config.seconds:
                self.one(self.maker.make())
                if report.calls % config.check_every == 0:
                    self.verify()
                if report.calls % config.expire_every == 0:
                    self.expire_one()
            self.verify()
        except Violation as exc:
            report.violations.append(f"call {report.calls} of seed {config.seed}: {exc}; "
                                     f"last calls: {list(self.recent)}")
        except grpc.RpcError as exc:
            report.violations.append(f"call {report.calls} of seed {config.seed}: the daemon "
                                     f"stopped answering ({rpc_code(exc).name}: {exc})")
            return report
        finally:
            report.seconds = time.monotonic() - start
            report.cache_hits, report.copies = self.shadow.cache_hits, self.shadow.copies
            report.streams_opened = self.steps.opened
            self.steps.close()
        self.close_all()
        return report

    # ----------------------------------------------------------- one call

    def one(self, plan: Plan) -> None:
        report = self.report
        report.calls += 1
        self.recent.append(describe(plan))
        before = self.snapshot(plan.session) if plan.mutating else None
        try:
            answer = self.invoke(plan)
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, Refused) else rpc_code(error)
            report.codes[code.name] += 1
            report.outcomes[plan.label, code.name] += 1
            self.judge_failure(plan, code, error)
            if before is not None:
                after = self.snapshot(plan.session)
                if after != before:
                    raise Violation(f"{describe(plan)} failed with {code.name} but changed "
                                    f"state: {diff(before, after)}") from None
            return
        report.codes["OK"] += 1
        report.outcomes[plan.label, "OK"] += 1
        if plan.expect is Expect.FAIL:
            raise Violation(f"invalid call accepted: {describe(plan)}")
        self.apply(plan, answer, before)

    def invoke(self, plan: Plan) -> bytes:
        """Send the plan's bytes through the generic method (no serializer on either side), or
        its StepMany as a StepStream message."""
        if plan.stream:
            assert isinstance(plan.request, pb.StepManyRequest)
            return self.steps.send(plan.request)
        method = self.channel.unary_unary(f"/pagedkv.v1.KVPool/{plan.rpc}",
                                          request_serializer=None, response_deserializer=None)
        answer: bytes = method(plan.payload(), timeout=self.config.timeout_s)
        return answer

    def judge_failure(self, plan: Plan, code: grpc.StatusCode, error: grpc.RpcError) -> None:
        report = self.report
        details = error.details() if isinstance(error, grpc.Call | Refused) else str(error)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise Violation(f"no answer within {self.config.timeout_s} s: {describe(plan)}")
        if code is grpc.StatusCode.UNKNOWN and plan.malformed:
            report.malformed_unknown += 1
        elif code is grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size exceeds" in details:
            report.trailer_overflows.append(f"{details[:160]} for {describe(plan)[:160]}")
        elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            report.internal_errors.append(f"{code.name} ({details}) for {describe(plan)}")
        elif plan.expect is Expect.OK and code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            report.refusals.append(f"{code.name} ({details}) for {describe(plan)}")

    def snapshot(self, session: SessionShadow | None) -> dict[str, Any]:
        """The pool's figures, and the caller's figures and tables."""
        timeout = self.config.timeout_s
        pool = pool_figures(self.metrics, timeout)
        state: dict[str, Any] = {f"pool.{name}": getattr(pool, name) for name in POOL_FIELDS}
        if session is None:
            return state
        stats = self.stub.GetStats(pb.GetStatsRequest(session_id=session.session_id),
                                   timeout=timeout)
        state |= {f"session.{name}": getattr(stats.sessions[0], name)
                  for name in SESSION_FIELDS}
        if session.seqs:
            reply = self.stub.GetBlockTables(pb.GetBlockTablesRequest(
                session_id=session.session_id, seq_ids=list(session.seqs)), timeout=timeout)
            state |= {f"seq {t.seq_id}": (list(t.block_ids), t.num_tokens)
                      for t in reply.tables}
        return state

    # ------------------------------------------------------ applying answers

    def apply(self, plan: Plan, answer: bytes, before: dict[str, Any] | None) -> None:
        session, shadow = plan.session, self.shadow
        if plan.entries:
            self.apply_entries(plan, pb.StepManyResponse.FromString(answer))
            return
        if isinstance(plan.request, bytes) or session is None:
            response = RESPONSES[plan.rpc].FromString(answer) if plan.rpc in RESPONSES else None
            if isinstance(response, pb.OpenSessionResponse):
                self.close_stray(response.session_id)
            elif before is not None and self.snapshot(session) != before:
                raise Violation(f"{describe(plan)} answered OK to bytes or to a junk session "
                                "but changed the pool")
            return
        if plan.rpc == "Batch":
            results = pb.BatchResponse.FromString(answer).results
            shadow.expect(len(results) == len(plan.ops), "batch: one result per op")
            for op, result in zip(plan.ops, results, strict=True):
                empty = op.WhichOneof("op") in ("free", "commit")
                shadow.apply_op(session, op, None if empty else result)
        elif plan.rpc == "Free":
            released = pb.FreeResponse.FromString(answer).released_blocks
            shadow.apply_free(session, plan.ops[0].free.seq_id, released)
        elif plan.rpc == "Commit":
            shadow.apply_op(session, plan.ops[0], None)
        elif plan.rpc in OP_RPCS.values():
            shadow.apply_op(session, plan.ops[0], pb.SequenceBlocks.FromString(answer))
        elif plan.rpc == "Step":
            assert isinstance(plan.request, pb.StepRequest)
            shadow.apply_step(session, plan.request, pb.StepResponse.FromString(answer))
        elif plan.rpc == "GetBlockTables":
            assert isinstance(plan.request, pb.GetBlockTablesRequest)
            tables = pb.GetBlockTablesResponse.FromString(answer).tables
            for seq_id, table in zip(plan.request.seq_ids, tables, strict=True):
                seq = session.seqs[seq_id]
                shadow.expect((list(table.block_ids), table.num_tokens)
                              == (seq.block_ids, seq.num_tokens), f"GetBlockTables {seq_id}")
        elif plan.rpc == "CloseSession":
            freed = pb.CloseSessionResponse.FromString(answer).freed_sequences
            shadow.expect(freed == len(session.seqs), f"close freed {freed} sequences of "
                          f"{len(session.seqs)}")
            index = shadow.sessions.index(session)
            self.closed_ids.append(session.session_id)
            shadow.sessions[index] = self.open(session.salt, session.max_blocks)

    def apply_entries(self, plan: Plan, answer: pb.StepManyResponse) -> None:
        """A StepMany's entries, each judged as its Step alone: applied to the shadow when OK
        (a failed entry changed nothing, which the next verification proves)."""
        report = self.report
        self.shadow.expect(len(answer.results) == len(plan.entries), "StepMany: one result per "
                           "entry")
        for entry, result in zip(plan.entries, answer.results, strict=True):
            code = STATUS_BY_NUMBER.get(result.code, grpc.StatusCode.UNKNOWN)
            report.outcomes[f"{entry.label}_entry", code.name] += 1
            if code is grpc.StatusCode.OK:
                if entry.expect is Expect.FAIL:
                    raise Violation(f"invalid StepMany entry accepted: {describe(entry)}")
                assert entry.session is not None and isinstance(entry.request, pb.StepRequest)
                self.shadow.apply_step(entry.session, entry.request, result.step)
            elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                report.internal_errors.append(f"{code.name} ({result.message}) for StepMany "
                                              f"entry {describe(entry)}")
            elif entry.expect is Expect.OK and code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                report.refusals.append(f"{code.name} ({result.message}) for StepMany entry "
                                       f"{describe(entry)}")

    def open(self, salt: bytes, max_blocks: int) -> SessionShadow:
        reply = self.stub.OpenSession(pb.OpenSessionRequest(
            client_name="fuzz", lease_ttl_ms=LEASE_TTL_MS, max_blocks=max_blocks,
            cache_salt=salt), timeout=self.config.timeout_s)
        return SessionShadow(reply.session_id, salt, max_blocks)

    def close_stray(self, session_id: str) -> None:
        """Close a session an edge-case OpenSession made (it may have expired already)."""
        try:
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id),
                                   timeout=self.config.timeout_s)
        except grpc.RpcError as exc:
            if rpc_code(exc) not in (grpc.StatusCode.NOT_FOUND,
                                     grpc.StatusCode.FAILED_PRECONDITION):
                raise

    def verify(self) -> None:
        self.shadow.verify(self.stub, lambda: pool_figures(self.metrics, self.config.timeout_s),
                           self.config.timeout_s)
        self.report.verifications += 1

    def expire_one(self) -> None:
        """A session that stops calling while it holds sequences: once its lease lapses the
        pool is as it was before it opened, and its id is refused."""
        timeout, stub = self.config.timeout_s, self.stub
        before = self.snapshot(None)
        session = stub.OpenSession(pb.OpenSessionRequest(
            client_name="fuzz-expiring", lease_ttl_ms=EXPIRING_LEASE_MS, cache_salt=b"team-a"),
            timeout=timeout).session_id
        self.recent.append(f"expire_one {session}")
        for seq_id in range(1, 4):
            try:
                stub.Allocate(pb.AllocateRequest(session_id=session, seq_id=seq_id,
                                                 num_tokens=seq_id * 20), timeout=timeout)
                stub.Fork(pb.ForkRequest(session_id=session, parent_seq_id=seq_id,
                                         child_seq_id=seq_id + 10), timeout=timeout)
            except grpc.RpcError as exc:
                if rpc_code(exc) is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
        deadline, after = time.monotonic() + EXPIRING_LEASE_MS / 1000 + 5, before
        while time.monotonic() < deadline:
            time.sleep(EXPIRING_LEASE_MS / 1000)
            after = self.snapshot(None)
            if after["pool.num_sequences"] == before["pool.num_sequences"]:
                break
        unchanged = ("pool.used_blocks", "pool.free_blocks", "pool.num_sequences")
        self.shadow.expect(all(after[k] == before[k] for k in unchanged),
                           f"an expired session's blocks did not come back: "
                           f"{diff(before, after)}")
        try:
            stub.KeepAlive(pb.KeepAliveRequest(session_id=session), timeout=timeout)
        except grpc.RpcError as exc:
            self.shadow.expect(rpc_code(exc) in (grpc.StatusCode.FAILED_PRECONDITION,
                                                 grpc.StatusCode.NOT_FOUND),
                               f"an expired session's KeepAlive answered {rpc_code(exc)}")
        else:
            raise Violation("an expired session was renewed")
        self.report.expiries += 1

    def close_all(self) -> None:
        """Close every session; the pool must then hold no used block and no sequence."""
        try:
            for session in self.shadow.sessions:
                self.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id),
                                       timeout=self.config.timeout_s)
            self.shadow.sessions = []
            stats = pool_figures(self.metrics, self.config.timeout_s)
        except grpc.RpcError as exc:
            self.report.violations.append(f"closing the sessions failed: {exc}")
            return
        self.report.leaked_blocks = stats.used_blocks
        self.report.leftover_sequences = stats.num_sequences
        if stats.used_blocks or stats.num_sequences:
            self.report.violations.append(f"{stats.used_blocks} used blocks and "
                                          f"{stats.num_sequences} sequences left after every "
                                          "session closed")


def diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    keys = sorted(set(before) | set(after))
    return "; ".join(f"{key}: {before.get(key)} -> {after.get(key)}" for key in keys
                     if before.get(key) != after.get(key))


def run_fuzz(target: str, metrics: str, config: FuzzConfig) -> FuzzReport:
    """Fuzz the daemon at `target` (it must have no other client; its /metrics on `metrics`,
    host:port) and report."""
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        return Fuzzer(channel, metrics, config).run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30_000)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--target", help="fuzz this daemon instead of starting one "
                        f"({' '.join(DAEMON_ARGS)})")
    parser.add_argument("--metrics", help="host:port of --target's /metrics")
    args = parser.parse_args()
    config = FuzzConfig(seed=args.seed, calls=args.calls, seconds=args.seconds)
    if args.target:
        report = run_fuzz(args.target, args.metrics, config)
    else:
        with running_pagedkvd(*DAEMON_ARGS) as daemon:
            report = run_fuzz(daemon.target, daemon.metrics, config)
    for line in report.figures():
        print(line)
    print(f"# answers: {dict(report.codes.most_common())}")
    for finding in report.findings():
        print(f"# {finding}", file=sys.stderr)
    return 1 if report.findings() or report.leaked_blocks != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
