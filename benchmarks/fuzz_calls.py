"""The fuzzer's calls: random valid and invalid requests built from the shadow's view.

Each `Plan` says what it sends (a request, or raw bytes through a generic method), whose tables
to snapshot around it, and what must happen: a valid call succeeds or finds no room
(RESOURCE_EXHAUSTED); an invalid one (unknown or other sessions' ids, duplicate ids, counts that
do not match, out-of-range blocks, huge counts, slots reserved past max_reserve_tokens, commits
reaching into reserved slots, copies of reserved entries) must fail; anything else (odd but
maybe legal values, malformed bytes) may go either way, but never with INTERNAL or UNKNOWN, and
never by changing state when it fails.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from fuzz_shadow import SessionShadow, Shadow, ceil_div
from google.protobuf.message import DecodeError, Message

from pagedkv.daemon.service.limits import Limits
from pagedkv.proto import kvpool_pb2 as pb

# Request message of every KVPool method (the generic channel sends their bytes).
REQUESTS: dict[str, type[Message]] = {
    "GetPoolInfo": pb.GetPoolInfoRequest, "OpenSession": pb.OpenSessionRequest,
    "KeepAlive": pb.KeepAliveRequest, "CloseSession": pb.CloseSessionRequest,
    "Allocate": pb.AllocateRequest, "Append": pb.AppendRequest, "Fork": pb.ForkRequest,
    "CopyOnWrite": pb.CopyOnWriteRequest, "Free": pb.FreeRequest, "Commit": pb.CommitRequest,
    "Batch": pb.BatchRequest, "Step": pb.StepRequest, "StepMany": pb.StepManyRequest,
    "GetBlockTables": pb.GetBlockTablesRequest, "GetStats": pb.GetStatsRequest,
}
RESPONSES: dict[str, type[Message]] = {
    "GetPoolInfo": pb.PoolInfo, "OpenSession": pb.OpenSessionResponse,
    "KeepAlive": pb.KeepAliveResponse, "CloseSession": pb.CloseSessionResponse,
    "Allocate": pb.SequenceBlocks, "Append": pb.SequenceBlocks, "Fork": pb.SequenceBlocks,
    "CopyOnWrite": pb.SequenceBlocks, "Free": pb.FreeResponse, "Commit": pb.CommitResponse,
    "Batch": pb.BatchResponse, "Step": pb.StepResponse, "StepMany": pb.StepManyResponse,
    "GetBlockTables": pb.GetBlockTablesResponse, "GetStats": pb.PoolStats,
}
READ_ONLY = {"GetPoolInfo", "KeepAlive", "GetBlockTables", "GetStats"}
# The RPC of each Batch op kind.
OP_RPCS = {"allocate": "Allocate", "append": "Append", "fork": "Fork",
           "copy_on_write": "CopyOnWrite", "free": "Free", "commit": "Commit"}
# Ids far above the per-session counters: never a live sequence of the fuzzer's.
UNKNOWN_IDS = (1 << 40, 1 << 62)
INT32_MAX, UINT32_MAX, UINT64_MAX = (1 << 31) - 1, (1 << 32) - 1, (1 << 64) - 1
VOCAB = 32_000
# The daemon's cap on a Step's reserve_tokens (the fuzzed daemon runs with the defaults).
MAX_RESERVE = Limits().max_reserve_tokens
# The daemon's cap on a StepMany's entries.
MAX_STEPS = Limits().max_steps_per_call


class Expect(Enum):
    OK = "ok"      # valid: succeeds, or RESOURCE_EXHAUSTED (pool or quota full)
    FAIL = "fail"  # invalid: any error status, never success
    ANY = "any"    # either; never INTERNAL/UNKNOWN


@dataclass
class Plan:
    """One fuzz call."""

    # What the call tries, counted in the report ("step", "allocate_negative", "raw_garbage").
    label: str
    # KVPool method name.
    rpc: str
    # The request, or raw bytes sent as they are.
    request: Message | bytes
    # The caller, whose tables are snapshotted (None: junk or closed session ids).
    session: SessionShadow | None
    expect: Expect
    # Single ops and Batch: the ops the shadow applies on success.
    ops: list[pb.BatchOp] = field(default_factory=list)
    # StepMany: the Step plan of each entry (each is judged, and applied, on its own).
    entries: list["Plan"] = field(default_factory=list)
    # StepMany: sent as a message on the fuzz client's StepStream instead of a unary call.
    stream: bool = False

    @property
    def mutating(self) -> bool:
        return self.rpc not in READ_ONLY

    @property
    def malformed(self) -> bool:
        """Raw bytes that do not parse as the method's request."""
        if not isinstance(self.request, bytes):
            return False
        kind = REQUESTS.get(self.rpc)
        try:
            if kind is not None:
                kind.FromString(self.request)
        except DecodeError:
            return True
        return False

    def payload(self) -> bytes:
        return self.request if isinstance(self.request, bytes) else \
            self.request.SerializeToString()


def single(label: str, session: SessionShadow, op: pb.BatchOp, expect: Expect,
           session_id: str | None = None) -> Plan:
    """One op as its own RPC, under `session_id` (default: the session's own)."""
    kind = op.WhichOneof("op")
    assert kind is not None
    inner: Message = getattr(op, kind)
    request = type(inner)()
    request.CopyFrom(inner)
    request.session_id = session.session_id if session_id is None else session_id  # type: ignore[attr-defined]
    return Plan(label, OP_RPCS[kind], request, session if session_id is None else None, expect,
                [op])


class CallMaker:
    """Random plans over the shadow's sessions."""

    def __init__(self, rng: random.Random, shadow: Shadow, num_blocks: int,
                 closed_ids: list[str]) -> None:
        self.rng = rng
        self.shadow = shadow
        self.num_blocks = num_blocks
        self.closed_ids = closed_ids
        # Per session id: the last seq id handed out, and the ids handed out so far.
        self._next_id: dict[str, int] = {}
        self._used: dict[str, list[int]] = {}
        # Weighted plan makers; the weights are relative.
        self.makers: list[tuple[float, Callable[[SessionShadow], Plan]]] = [
            (34, self.valid_single), (14, self.step), (6, self.valid_batch),
            (14, self.invalid_single), (4, self.invalid_step), (4, self.invalid_batch),
            (4, self.step_many), (4, self.block_tables), (3, self.odd_values),
            (5, self.junk_session),
            (2, self.session_calls), (6, self.raw_bytes), (0.2, self.oversized),
        ]

    def make(self) -> Plan:
        session = self.rng.choice(self.shadow.sessions)
        weights = [weight for weight, _ in self.makers]
        maker = self.rng.choices([m for _, m in self.makers], weights)[0]
        return maker(session)

    # ----------------------------------------------------------- valid ops

    def new_id(self, session: SessionShadow, view: dict[int, int]) -> int:
        """An id not in `view`: often one the session used before (a freed id reused, maybe
        within one batch), sometimes an extreme one, else the next of the session's counter."""
        r = self.rng.random()
        if r < 0.15:
            reusable = [s for s in self._used.get(session.session_id, ()) if s not in view]
            if reusable:
                return self.rng.choice(reusable)
        elif r < 0.17:
            candidate = self.rng.choice([0, UINT64_MAX, 1 << 63])
            if candidate not in view:
                return candidate
        self._next_id[session.session_id] = self._next_id.get(session.session_id, 0) + 1
        seq_id = self._next_id[session.session_id]
        self._used.setdefault(session.session_id, []).append(seq_id)
        return seq_id

    def prompt(self, session: SessionShadow) -> tuple[int, list[int]]:
        """A prompt's length and ids (none 25% of the time); often a known prefix of a sequence
        under the same salt, so committed blocks are found in the cache."""
        r = self.rng.random()
        n = (0 if r < 0.03 else self.rng.randint(1, 16) if r < 0.3 else
             self.rng.randint(17, 64) if r < 0.7 else self.rng.randint(65, 200) if r < 0.98
             else self.rng.randint(201, 400))
        if self.rng.random() < 0.25:
            return n, []
        donors = [seq.token_ids for other in self.shadow.sessions for seq in other.seqs.values()
                  if seq.token_ids and (other is session or (session.salt and
                                                             other.salt == session.salt))]
        if donors and self.rng.random() < 0.4:
            donor = self.rng.choice(donors)
            head = donor[:self.rng.randint(1, len(donor))]
            tail = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, 40))]
            return len(head) + len(tail), head + tail
        return n, [self.rng.randrange(VOCAB) for _ in range(n)]

    def tokens(self, k: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(k)] if self.rng.random() < 0.7 else []

    def valid_op(self, session: SessionShadow, view: dict[int, int]) -> pb.BatchOp:
        """A valid op for a session whose sequences' token counts are `view` (updated)."""
        # Free more as the pool fills: it runs out often, but not all the time.
        used = len(self.shadow.refcounts()) / self.num_blocks
        weights = {"allocate": 30, "append": 25, "fork": 10, "copy_on_write": 8,
                   "free": 12 + 300 * max(0.0, used - 0.85), "commit": 10}
        if not view:
            weights = {"allocate": 1}
        kind = self.rng.choices(list(weights), list(weights.values()))[0]
        seq_id = self.rng.choice(list(view)) if view else 0
        if kind == "allocate":
            new, (n, ids) = self.new_id(session, view), self.prompt(session)
            view[new] = n
            return pb.BatchOp(allocate=pb.AllocateRequest(seq_id=new, num_tokens=n,
                                                          token_ids=ids))
        if kind == "append":
            k = self.rng.choice([1, 1, 1, 2, 3, 15, 16, 17, 40])
            view[seq_id] += k
            return pb.BatchOp(append=pb.AppendRequest(seq_id=seq_id, num_tokens=k,
                                                      token_ids=self.tokens(k)))
        if kind == "fork":
            child = self.new_id(session, view)
            view[child] = view[seq_id]
            return pb.BatchOp(fork=pb.ForkRequest(parent_seq_id=seq_id, child_seq_id=child))
        if kind == "copy_on_write" and view[seq_id] > 0:
            logical = self.rng.randrange(ceil_div(view[seq_id], self.shadow.block_size))
            return pb.BatchOp(copy_on_write=pb.CopyOnWriteRequest(seq_id=seq_id,
                                                                  logical_block=logical))
        if kind == "free":
            del view[seq_id]
            return pb.BatchOp(free=pb.FreeRequest(seq_id=seq_id))
        chosen = self.rng.sample(list(view), self.rng.randint(1, min(4, len(view))))
        counts = ([self.rng.randint(0, view[s]) for s in chosen] if self.rng.random() < 0.5
                  else [])
        return pb.BatchOp(commit=pb.CommitRequest(seq_ids=chosen, num_tokens=counts))

    def view(self, session: SessionShadow) -> dict[int, int]:
        return {seq_id: seq.num_tokens for seq_id, seq in session.seqs.items()}

    def valid_single(self, session: SessionShadow) -> Plan:
        op = self.valid_op(session, self.view(session))
        return single(str(op.WhichOneof("op")), session, op, Expect.OK)

    def valid_batch(self, session: SessionShadow) -> Plan:
        view = self.view(session)
        ops = [self.valid_op(session, view) for _ in range(self.rng.randint(1, 6))]
        return Plan("batch", "Batch", pb.BatchRequest(session_id=session.session_id, ops=ops),
                    session, Expect.OK, ops)

    def step(self, session: SessionShadow) -> Plan:
        if not session.seqs:
            return self.valid_single(session)
        seq_ids = self.rng.sample(list(session.seqs), self.rng.randint(1, len(session.seqs)))
        k = self.rng.choice([0, 1, 1, 1, 1, 2, 4, 16, 17])
        ids = self.tokens(len(seq_ids) * (k or 1))
        # Slots reserved ahead (a few blocks' worth, rarely the cap) a third of the time.
        b = self.shadow.block_size
        reserve = (0 if self.rng.random() < 0.67 else MAX_RESERVE if self.rng.random() < 0.03
                   else self.rng.choice([1, b - 1, b, b + 1, 2 * b, 3 * b]))
        request = pb.StepRequest(session_id=session.session_id, seq_ids=seq_ids, num_tokens=k,
                                 token_ids=ids, commit=self.rng.random() < 0.5,
                                 reserve_tokens=reserve)
        return Plan("step_reserve" if reserve else "step", "Step", request, session, Expect.OK)

    def step_many(self, session: SessionShadow) -> Plan:
        """Mixed entries, or rarely too many (refused as a whole); half of them as messages on
        the StepStream, which must fare as the unary call."""
        r = self.rng.random()
        plan = self.step_many_past_cap(session) if r < 0.15 else self.step_many_mixed()
        if self.rng.random() < 0.5:
            plan.label, plan.stream = f"{plan.label}_streamed", True
        return plan

    def step_many_mixed(self) -> Plan:
        """1-4 Steps of random sessions (the same one maybe twice), valid and invalid ones and
        junk-session ones mixed: each entry must fare as that Step alone would."""
        entries = []
        for _ in range(self.rng.randint(1, 4)):
            owner = self.rng.choice(self.shadow.sessions)
            r = self.rng.random()
            if r < 0.6 and owner.seqs:
                entries.append(self.step(owner))
            elif r < 0.9:
                entries.append(self.invalid_step(owner))
            else:
                request = pb.StepRequest(session_id=self.junk_id(owner)[:200], seq_ids=[1])
                entries.append(Plan("step_junk_session", "Step", request, None, Expect.FAIL))
        steps = [entry.request for entry in entries if isinstance(entry.request, pb.StepRequest)]
        assert len(steps) == len(entries)
        return Plan("step_many", "StepMany", pb.StepManyRequest(steps=steps), None, Expect.OK,
                    entries=entries)

    def step_many_past_cap(self, session: SessionShadow) -> Plan:
        """One Step of the caller's past max_steps_per_call: refused as a whole, no entry
        applied (the caller's tables are snapshotted around it)."""
        step = pb.StepRequest(session_id=session.session_id, seq_ids=list(session.seqs)[:1] or [1],
                              token_ids=[1])
        return Plan("step_many_past_cap", "StepMany",
                    pb.StepManyRequest(steps=[step] * (MAX_STEPS + 1)), session, Expect.FAIL)

    # --------------------------------------------------------- invalid ops

    def unknown_id(self, session: SessionShadow) -> int:
        """A seq id the session does not have: another session's (hidden from this one), or
        one never used."""
        theirs = [s for other in self.shadow.sessions if other is not session
                  for s in other.seqs if s not in session.seqs]
        if theirs and self.rng.random() < 0.5:
            return self.rng.choice(theirs)
        return self.rng.randrange(*UNKNOWN_IDS)

    def invalid_op(self, session: SessionShadow) -> tuple[str, pb.BatchOp]:
        """An op that must fail whatever the pool holds."""
        seqs, unknown = session.seqs, self.unknown_id(session)
        live = [s for s, seq in seqs.items() if seq.num_tokens > 0]
        choices: list[tuple[str, pb.BatchOp]] = [
            ("append_unknown_seq", pb.BatchOp(append=pb.AppendRequest(seq_id=unknown,
                                                                      num_tokens=1))),
            ("free_unknown_seq", pb.BatchOp(free=pb.FreeRequest(seq_id=unknown))),
            ("fork_unknown_parent", pb.BatchOp(fork=pb.ForkRequest(
                parent_seq_id=unknown, child_seq_id=self.rng.randrange(*UNKNOWN_IDS)))),
            ("cow_unknown_seq", pb.BatchOp(copy_on_write=pb.CopyOnWriteRequest(seq_id=unknown))),
            ("commit_unknown_seq", pb.BatchOp(commit=pb.CommitRequest(seq_ids=[unknown]))),
            ("allocate_negative", pb.BatchOp(allocate=pb.AllocateRequest(
                seq_id=self.rng.randrange(*UNKNOWN_IDS),
                num_tokens=self.rng.choice([-1, -16, -INT32_MAX - 1])))),
            ("allocate_huge", pb.BatchOp(allocate=pb.AllocateRequest(
                seq_id=self.rng.randrange(*UNKNOWN_IDS),
                num_tokens=self.rng.choice([INT32_MAX,
                                            self.num_blocks * self.shadow.block_size + 1])))),
            ("allocate_wrong_token_count", pb.BatchOp(allocate=pb.AllocateRequest(
                seq_id=self.rng.randrange(*UNKNOWN_IDS), num_tokens=self.rng.randint(1, 40),
                token_ids=[1] * self.rng.choice([41, 50])))),
        ]
        if seqs:
            mine = self.rng.choice(list(seqs))
            blocks = len(seqs[mine].block_ids)
            choices += [
                ("allocate_duplicate", pb.BatchOp(allocate=pb.AllocateRequest(
                    seq_id=mine, num_tokens=1, token_ids=[1]))),
                ("fork_to_existing", pb.BatchOp(fork=pb.ForkRequest(
                    parent_seq_id=mine, child_seq_id=self.rng.choice(list(seqs))))),
                ("append_wrong_token_count", pb.BatchOp(append=pb.AppendRequest(
                    seq_id=mine, num_tokens=self.rng.randint(1, 8),
                    token_ids=[2] * self.rng.randint(9, 12)))),
                ("append_negative", pb.BatchOp(append=pb.AppendRequest(
                    seq_id=mine, num_tokens=self.rng.choice([-1, -INT32_MAX - 1])))),
                ("append_huge", pb.BatchOp(append=pb.AppendRequest(
                    seq_id=mine, num_tokens=INT32_MAX))),
                ("cow_out_of_range", pb.BatchOp(copy_on_write=pb.CopyOnWriteRequest(
                    seq_id=mine, logical_block=self.rng.choice([blocks, -1, INT32_MAX,
                                                                -INT32_MAX - 1])))),
                ("commit_count_mismatch", pb.BatchOp(commit=pb.CommitRequest(
                    seq_ids=[mine], num_tokens=[0, 0]))),
            ]
        if live:
            mine = self.rng.choice(live)
            choices.append(("commit_past_end", pb.BatchOp(commit=pb.CommitRequest(
                seq_ids=[mine], num_tokens=[seqs[mine].num_tokens + self.rng.randint(1, 99)]))))
        b = self.shadow.block_size
        ahead = [s for s, seq in seqs.items() if len(seq.block_ids) * b > seq.num_tokens]
        if ahead:  # no commit covers a reserved slot, however far the table reaches
            mine = self.rng.choice(ahead)
            n, reach = seqs[mine].num_tokens, len(seqs[mine].block_ids) * b
            choices.append(("commit_reserved", pb.BatchOp(commit=pb.CommitRequest(
                seq_ids=[mine], num_tokens=[self.rng.randint(n + 1, reach)]))))
        reserving = [s for s, seq in seqs.items()
                     if len(seq.block_ids) > ceil_div(seq.num_tokens, b)]
        if reserving:  # nor is a reserved entry copied: it holds no token
            mine = self.rng.choice(reserving)
            logical = self.rng.randrange(ceil_div(seqs[mine].num_tokens, b),
                                         len(seqs[mine].block_ids))
            choices.append(("cow_reserved", pb.BatchOp(copy_on_write=pb.CopyOnWriteRequest(
                seq_id=mine, logical_block=logical))))
        return self.rng.choice(choices)

    def invalid_single(self, session: SessionShadow) -> Plan:
        label, op = self.invalid_op(session)
        return single(label, session, op, Expect.FAIL)

    def invalid_batch(self, session: SessionShadow) -> Plan:
        """Valid ops with one invalid op among them (or an op that names nothing, or another
        session): the whole batch fails and nothing changes."""
        view = self.view(session)
        ops = [self.valid_op(session, view) for _ in range(self.rng.randint(0, 3))]
        r = self.rng.random()
        if r < 0.1:
            label, bad = "batch_empty_op", pb.BatchOp()
        elif r < 0.2:
            other = self.rng.choice(self.shadow.sessions)
            label = "batch_other_session"
            bad = pb.BatchOp(allocate=pb.AllocateRequest(
                session_id=other.session_id + ("" if other is not session else "x"),
                seq_id=self.rng.randrange(*UNKNOWN_IDS), num_tokens=1))
        else:
            label, bad = self.invalid_op(session)
            label = f"batch_{label}"
            if not self.stays_invalid(bad, view):  # the ops before it made it valid
                label, bad = "batch_allocate_negative", pb.BatchOp(allocate=pb.AllocateRequest(
                    seq_id=self.rng.randrange(*UNKNOWN_IDS), num_tokens=-1))
        ops.append(bad)
        ops += [self.valid_op(session, view) for _ in range(self.rng.randint(0, 2))]
        return Plan(label, "Batch", pb.BatchRequest(session_id=session.session_id, ops=ops),
                    session, Expect.FAIL)

    def stays_invalid(self, op: pb.BatchOp, view: dict[int, int]) -> bool:
        """Whether an op from `invalid_op` is invalid for a session whose sequences hold `view`
        tokens (the ops before it in its batch may have created or grown sequences)."""
        b, huge = self.shadow.block_size, INT32_MAX // 2
        if op.HasField("allocate"):
            a = op.allocate
            return (a.seq_id in view or not 0 <= a.num_tokens <= self.num_blocks * b
                    or len(a.token_ids) not in (0, a.num_tokens))
        if op.HasField("append"):
            p = op.append
            return (p.seq_id not in view or p.num_tokens < 1 or p.num_tokens > huge
                    or len(p.token_ids) not in (0, p.num_tokens))
        if op.HasField("fork"):
            return op.fork.parent_seq_id not in view or op.fork.child_seq_id in view
        if op.HasField("copy_on_write"):
            c = op.copy_on_write
            return c.seq_id not in view or not 0 <= c.logical_block < ceil_div(view[c.seq_id], b)
        if op.HasField("free"):
            return op.free.seq_id not in view
        m = op.commit
        return (not all(s in view for s in m.seq_ids)
                or len(m.num_tokens) not in (0, len(m.seq_ids))
                or any(n > view[s] for s, n in zip(m.seq_ids, m.num_tokens, strict=False)))

    def invalid_step(self, session: SessionShadow) -> Plan:
        seqs = list(session.seqs)
        choices: list[tuple[str, list[int], int, list[int]]] = [
            ("step_unknown_seq", [*seqs[:3], self.unknown_id(session)], 1, [])]
        if seqs:
            choices += [
                ("step_duplicate_seq", [seqs[0], *seqs[:2]], 1, []),
                ("step_wrong_token_count", seqs[:4], 2, [5] * (2 * len(seqs[:4]) + 1)),
                ("step_huge", seqs[:2], UINT32_MAX, []),
                ("step_reserve_past_cap", seqs[:3], 1, []),
            ]
        if self.rng.random() < 0.05:
            choices.append(("step_too_many_seqs", [self.unknown_id(session)] * 65_537, 1, []))
        label, seq_ids, k, ids = self.rng.choice(choices)
        # Any of them may also reserve; past max_reserve_tokens is refused on its own.
        reserve = (self.rng.choice([MAX_RESERVE + 1, 4 * MAX_RESERVE, UINT32_MAX])
                   if label == "step_reserve_past_cap" else
                   self.rng.choice([0, 0, self.shadow.block_size]))
        return Plan(label, "Step", pb.StepRequest(session_id=session.session_id, seq_ids=seq_ids,
                                                  num_tokens=k, token_ids=ids,
                                                  reserve_tokens=reserve), session, Expect.FAIL)

    def block_tables(self, session: SessionShadow) -> Plan:
        seqs = list(session.seqs)
        if seqs and self.rng.random() < 0.6:
            chosen = self.rng.sample(seqs, self.rng.randint(1, len(seqs)))
            return Plan("block_tables", "GetBlockTables", pb.GetBlockTablesRequest(
                session_id=session.session_id, seq_ids=chosen), session, Expect.OK)
        ids = [*seqs[:2], self.unknown_id(session)]
        if self.rng.random() < 0.1:
            ids = ids * 30_000  # past the limit on seq ids in one request
        return Plan("block_tables_unknown", "GetBlockTables", pb.GetBlockTablesRequest(
            session_id=session.session_id, seq_ids=ids), session, Expect.FAIL)

    def odd_values(self, session: SessionShadow) -> Plan:
        """Legal-looking values at the edges: extreme token ids, zero counts, empty lists."""
        seqs = list(session.seqs)
        r = self.rng.random()
        if r < 0.4 or not seqs:
            n = self.rng.randint(1, 20)
            ids = [self.rng.choice([-1, -(1 << 63), (1 << 63) - 1, VOCAB * 1000]) for _ in range(n)]
            seq_id = self.new_id(session, self.view(session))
            op = pb.BatchOp(allocate=pb.AllocateRequest(seq_id=seq_id, num_tokens=n,
                                                        token_ids=ids))
            return single("allocate_odd_token_ids", session, op, Expect.ANY)
        if r < 0.6:
            op = pb.BatchOp(append=pb.AppendRequest(seq_id=self.rng.choice(seqs), num_tokens=0))
            return single("append_zero", session, op, Expect.ANY)
        if r < 0.8:
            return Plan("step_empty", "Step", pb.StepRequest(session_id=session.session_id),
                        session, Expect.ANY)
        return Plan("batch_empty", "Batch", pb.BatchRequest(session_id=session.session_id),
                    session, Expect.ANY)

    # ------------------------------------------------------ session calls

    def junk_id(self, session: SessionShadow) -> str:
        return self.rng.choice([
            "", "x", "0" * 32, session.session_id[:-1] + ("0" if session.session_id[-1] != "0"
                                                           else "1"),
            session.session_id + "\0", "é" * 2000, "a" * 70_000,
            *(self.closed_ids[-3:] or ["closed"])])

    def junk_session(self, session: SessionShadow) -> Plan:
        """A valid op, or a session call, under an id that names no live session."""
        junk = self.junk_id(session)
        r = self.rng.random()
        if r < 0.7:
            op = self.valid_op(session, self.view(session))
            return single(f"{op.WhichOneof('op')}_junk_session", session, op, Expect.FAIL, junk)
        rpc = self.rng.choice(["KeepAlive", "CloseSession", "Step", "GetBlockTables", "Batch",
                               "GetStats"])
        # A named factory: the stubs type Message() as taking no fields (types-protobuf 2026-11).
        factory: Callable[..., Message] = REQUESTS[rpc]
        request = factory(session_id=junk)
        if rpc == "GetStats" and not junk:
            return Plan("stats", rpc, request, None, Expect.OK)
        if rpc == "Step":
            request = pb.StepRequest(session_id=junk, seq_ids=list(session.seqs)[:2] or [1])
        return Plan(f"{rpc}_junk_session", rpc, request, None, Expect.FAIL)

    def session_calls(self, session: SessionShadow) -> Plan:
        r = self.rng.random()
        if r < 0.3:
            return Plan("keep_alive", "KeepAlive", pb.KeepAliveRequest(
                session_id=session.session_id), session, Expect.OK)
        if r < 0.45:
            return Plan("stats_of_session", "GetStats", pb.GetStatsRequest(
                session_id=session.session_id), session, Expect.OK)
        if r < 0.5:
            return Plan("pool_info", "GetPoolInfo", pb.GetPoolInfoRequest(), None, Expect.OK)
        if r < 0.65:
            return Plan("close_session", "CloseSession", pb.CloseSessionRequest(
                session_id=session.session_id), session, Expect.OK)
        # A stray session with edge-case settings; the fuzzer closes it at once.
        request = pb.OpenSessionRequest(
            client_name=self.rng.choice(["", "fuzz", "n" * 100_000, "\u2603" * 10]),
            lease_ttl_ms=self.rng.choice([0, 1, UINT32_MAX]),
            max_blocks=self.rng.choice([0, 1, UINT32_MAX]),
            cache_salt=self.rng.choice([b"", b"\0", session.salt, bytes(100_000)]))
        return Plan("open_session_edge", "OpenSession", request, None, Expect.ANY)

    # ------------------------------------------------------------ raw bytes

    def raw_bytes(self, session: SessionShadow) -> Plan:
        """Bytes that are not a request, or a junk-session request cut or bit-flipped,
        through the generic channel method (no serializer)."""
        rpc = self.rng.choice(list(REQUESTS))
        junk = self.junk_id(session)[:64]
        valid = pb.AppendRequest(session_id=junk, seq_id=7, num_tokens=3,
                                 token_ids=[1, 2, 3]).SerializeToString()
        r = self.rng.random()
        if r < 0.3:
            data = self.rng.randbytes(self.rng.randint(1, 200))
        elif r < 0.5:
            data = valid[:self.rng.randint(1, len(valid) - 1)]
        elif r < 0.7:
            flipped = bytearray(valid)
            flipped[self.rng.randrange(len(flipped))] ^= 1 << self.rng.randrange(8)
            data = bytes(flipped)
        elif r < 0.8:
            data = b"\x0a\x02\xff\xfe"  # session_id: 2 bytes of invalid UTF-8
        elif r < 0.9:
            data = b"\x0a\xff\xff\xff\xff\x0f" + b"x" * 8  # a length far past the end
        else:
            data = b"\x12\x05\x01\x02"  # a packed field cut short
        return Plan(f"raw_{rpc}", rpc, data, None, Expect.ANY)

    def oversized(self, session: SessionShadow) -> Plan:
        """A request over the daemon's 8 MiB message limit: zeros to any method, or an Allocate
        of the caller's with 9 Mi one-byte token ids (rare: each costs most of a second)."""
        if self.rng.random() < 0.5:
            return Plan("raw_oversized", self.rng.choice(list(REQUESTS)),
                        bytes(9 * 2**20), None, Expect.ANY)
        head = pb.AllocateRequest(session_id=session.session_id, num_tokens=9 * 2**20,
                                  seq_id=self.rng.randrange(*UNKNOWN_IDS)).SerializeToString()
        packed = b"\x01" * (9 * 2**20)
        data = head + b"\x22" + varint(len(packed)) + packed  # field 4 (token_ids), packed
        return Plan("allocate_oversized", "Allocate", data, session, Expect.FAIL)


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)
