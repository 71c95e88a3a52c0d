"""The fuzzer's shadow of a pagedkvd: every sequence of every session, built only from answers.

A successful call is applied here and its answer checked against what the pool's invariants
allow (docs/ARCHITECTURE.md): a sequence of n tokens holds ceil(n / B) blocks, or more once a
Step reserved slots ahead (StepRequest.reserve_tokens: its table then covers n + reserve slots,
never shrinks, and its reserved entries never change: appends into them take no block), a full
block is never replaced, a slot is `block * B + offset` of its position, a written or reserved
block is referenced by no other table, a fork shares its parent's blocks that hold tokens (never
the reserved ones), copies are reported for exactly the blocks that changed, and blocks are
shared across sessions only under one non-empty cache salt.
`Shadow.verify` then compares the daemon's own tables and figures with the shadow.
"""

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc


class Violation(AssertionError):
    """The daemon answered something the shadow says is impossible."""


@dataclass
class SeqShadow:
    """One sequence as the daemon's answers described it."""

    # Tokens the sequence holds.
    num_tokens: int
    # Its token ids, or None once tokens were added without ids.
    token_ids: list[int] | None
    # Block table: logical block i -> physical block block_ids[i]; entries past the last
    # token's block are reserved (a Step's reserve_tokens).
    block_ids: list[int]


@dataclass
class SessionShadow:
    """One session the fuzzer opened and its sequences."""

    session_id: str
    # Prefix-cache namespace; b"" shares with no other session.
    salt: bytes
    # Quota on block-table entries (0 = none).
    max_blocks: int
    seqs: dict[int, SeqShadow] = field(default_factory=dict)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slots(block_ids: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Slots of positions start..stop-1 of a sequence with this table."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]


class Shadow:
    """Every live session the fuzzer owns and every sequence in them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sessions: list[SessionShadow] = []
        # Coverage: allocations that found cached blocks, and copy-on-write copies answered.
        self.cache_hits = 0
        self.copies = 0
        # Per cache namespace (a non-empty salt, else the session id): the hash of every prefix
        # of whole blocks some sequence held with known ids; a cache hit must be one of them (a
        # block is keyed only by tokens given: never by reserved slots).
        self.prefixes: dict[bytes, set[int]] = {}

    # ------------------------------------------------------------------ queries

    def refcounts(self) -> Counter[int]:
        """Block -> table entries referencing it, over every session."""
        counts: Counter[int] = Counter()
        for session in self.sessions:
            for seq in session.seqs.values():
                counts.update(seq.block_ids)
        return counts

    def num_sequences(self) -> int:
        return sum(len(session.seqs) for session in self.sessions)

    def expect(self, condition: bool, what: str) -> None:
        if not condition:
            raise Violation(what)

    # ---------------------------------------------------- applying answers

    def apply_op(self, session: SessionShadow, op: pb.BatchOp,
                 result: pb.SequenceBlocks | None) -> None:
        """Apply one successful op (alone or inside a Batch) and check its answer; `result` is
        None for Free and Commit, whose answers carry no table."""
        kind = op.WhichOneof("op")
        if kind == "allocate":
            assert result is not None
            self.apply_allocate(session, op.allocate, result)
        elif kind == "append":
            assert result is not None
            self.apply_append(session, op.append, result)
        elif kind == "fork":
            assert result is not None
            self.apply_fork(session, op.fork, result)
        elif kind == "copy_on_write":
            assert result is not None
            self.apply_copy_on_write(session, op.copy_on_write, result)
        elif kind == "free":
            self.apply_free(session, op.free.seq_id, None)
        elif kind == "commit":
            self.expect(all(s in session.seqs for s in op.commit.seq_ids),
                        "a commit of an unknown sequence succeeded")

    def apply_allocate(self, session: SessionShadow, request: pb.AllocateRequest,
                       answer: pb.SequenceBlocks) -> None:
        n, table, b = request.num_tokens, list(answer.block_ids), self.block_size
        where = f"allocate {request.seq_id} ({n} tokens)"
        self.expect(request.seq_id not in session.seqs, f"{where}: the id was taken")
        self.expect(answer.num_tokens == n, f"{where}: answered {answer.num_tokens} tokens")
        self.expect(len(table) == ceil_div(n, b), f"{where}: {len(table)} blocks")
        cached = answer.num_cached_tokens
        self.expect(cached % b == 0 and cached <= n and (cached == 0 or bool(request.token_ids)),
                    f"{where}: {cached} cached tokens")
        self.expect(cached == 0 or hash(tuple(request.token_ids[:cached])) in self.held(session),
                    f"{where}: {cached} cached tokens no sequence held")
        self.expect(list(answer.slot_mapping) == slots(table, 0, n, b), f"{where}: slots")
        ids = list(request.token_ids) if request.token_ids or n == 0 else None
        session.seqs[request.seq_id] = SeqShadow(n, ids, table)
        self.remember(session, ids or [], 0)
        self.cache_hits += cached > 0
        self.check_shared_within_salt(session, table)
        self.check_private(table[cached // b:], where)

    def apply_append(self, session: SessionShadow, request: pb.AppendRequest,
                     answer: pb.SequenceBlocks) -> None:
        seq = session.seqs.get(request.seq_id)
        self.expect(seq is not None, f"append to unknown sequence {request.seq_id} succeeded")
        assert seq is not None
        k = request.num_tokens
        self.grow(seq, k, list(answer.block_ids), answer.copies, f"append {request.seq_id}")
        self.expect(answer.num_tokens == seq.num_tokens, f"append {request.seq_id}: answered "
                    f"{answer.num_tokens} tokens, expected {seq.num_tokens}")
        self.expect(list(answer.slot_mapping) == slots(
            seq.block_ids, seq.num_tokens - k, seq.num_tokens, self.block_size),
            f"append {request.seq_id}: slots")
        self.extend_ids(session, seq, list(request.token_ids), k)

    def apply_step(self, session: SessionShadow, request: pb.StepRequest,
                   answer: pb.StepResponse) -> None:
        k, b = request.num_tokens or 1, self.block_size
        seq_ids = list(request.seq_ids)
        seqs = [session.seqs.get(s) for s in seq_ids]
        self.expect(all(seqs), "a step over an unknown sequence succeeded")
        self.expect(len(answer.slot_mapping) == k * len(seq_ids)
                    and len(answer.num_tokens) == len(seq_ids), "step: answer sizes")
        tables = [list(seq.block_ids) for seq in seqs if seq]
        for index, logical, block in zip(answer.changed_seq_index, answer.changed_logical_block,
                                         answer.changed_block_id, strict=True):
            table = tables[index]
            self.expect(logical <= len(table), f"step: changed entry {logical} past the table")
            self.expect(logical == len(table) or table[logical] != block,
                        f"step: entry {logical} answered as changed, still block {block}")
            if logical == len(table):
                table.append(block)
            else:
                table[logical] = block
        copies = list(zip(answer.copy_src, answer.copy_dst, strict=True))
        for i, (seq, table) in enumerate(zip(seqs, tables, strict=True)):
            assert seq is not None
            where = f"step seq {seq_ids[i]}"
            mine = [pb.BlockCopy(src=s, dst=d) for s, d in copies if d in table]
            self.grow(seq, k, table, mine, where, request.reserve_tokens, check_private=False)
            self.expect(answer.num_tokens[i] == seq.num_tokens, f"{where}: num_tokens")
            self.expect(list(answer.slot_mapping[i * k:(i + 1) * k]) == slots(
                seq.block_ids, seq.num_tokens - k, seq.num_tokens, b), f"{where}: slots")
            self.extend_ids(session, seq, list(request.token_ids[i * k:(i + 1) * k]), k)
        for seq in seqs:  # checked once every table is updated: siblings may share blocks
            assert seq is not None
            self.check_private(seq.block_ids[(seq.num_tokens - k) // b:], "step")

    def apply_fork(self, session: SessionShadow, request: pb.ForkRequest,
                   answer: pb.SequenceBlocks) -> None:
        parent = session.seqs.get(request.parent_seq_id)
        where = f"fork {request.parent_seq_id} -> {request.child_seq_id}"
        self.expect(parent is not None and request.child_seq_id not in session.seqs,
                    f"{where}: succeeded with an unknown parent or a taken child id")
        assert parent is not None
        shared = parent.block_ids[:ceil_div(parent.num_tokens, self.block_size)]
        self.expect(list(answer.block_ids) == shared
                    and answer.num_tokens == parent.num_tokens and not answer.slot_mapping,
                    f"{where}: the child's table is not the parent's blocks holding tokens")
        ids = None if parent.token_ids is None else list(parent.token_ids)
        session.seqs[request.child_seq_id] = SeqShadow(parent.num_tokens, ids, shared)

    def apply_copy_on_write(self, session: SessionShadow, request: pb.CopyOnWriteRequest,
                            answer: pb.SequenceBlocks) -> None:
        seq = session.seqs.get(request.seq_id)
        where = f"copy_on_write {request.seq_id}[{request.logical_block}]"
        self.expect(seq is not None and 0 <= request.logical_block < len(seq.block_ids),
                    f"{where}: succeeded on an unknown sequence or block")
        assert seq is not None
        table, old = list(answer.block_ids), seq.block_ids
        changed = [i for i, (a, c) in enumerate(zip(old, table, strict=False)) if a != c]
        self.expect(len(table) == len(old) and changed in ([], [request.logical_block]),
                    f"{where}: table {old} became {table}")
        private = self.refcounts()[old[request.logical_block]] == 1
        self.expect(not (private and changed), f"{where}: copied a private block")
        self.expect(answer.num_tokens == seq.num_tokens, f"{where}: num_tokens changed")
        expected = [(old[i], table[i]) for i in changed]
        self.expect([(c.src, c.dst) for c in answer.copies] == expected,
                    f"{where}: copies {list(answer.copies)} for changes {expected}")
        seq.block_ids = table
        self.copies += len(expected)
        self.check_private([table[request.logical_block]], where)

    def apply_free(self, session: SessionShadow, seq_id: int, released: int | None) -> None:
        seq = session.seqs.pop(seq_id, None)
        self.expect(seq is not None, f"free of unknown sequence {seq_id} succeeded")
        assert seq is not None
        if released is not None:
            left = self.refcounts()
            private = sum(1 for block in set(seq.block_ids) if left[block] == 0)
            self.expect(released <= private, f"free {seq_id}: released {released} blocks, only "
                        f"{private} were unshared")

    # ------------------------------------------------------------- helpers

    def grow(self, seq: SeqShadow, k: int, table: list[int], copies: Sequence[pb.BlockCopy],
             where: str, reserve: int = 0, *, check_private: bool = True) -> None:
        """Check and apply `k` tokens added to `seq`, whose table is now `table`, reserving
        `reserve` slots past them (a Step's reserve_tokens)."""
        b, old, held = self.block_size, seq.num_tokens, len(seq.block_ids)
        n = old + k
        self.expect(len(table) == max(held, ceil_div(n + reserve, b)),
                    f"{where}: {len(table)} blocks for {n} tokens, {reserve} reserved, "
                    f"{held} held")
        self.expect(table[:old // b] == seq.block_ids[:old // b],
                    f"{where}: a full block was replaced")
        tail = ceil_div(old, b)  # past the last token's block: reserved entries
        self.expect(table[tail:held] == seq.block_ids[tail:],
                    f"{where}: reserved entries {seq.block_ids[tail:]} became {table[tail:held]}")
        expected = [(seq.block_ids[i], table[i]) for i in range(old // b, len(seq.block_ids))
                    if table[i] != seq.block_ids[i]]
        self.expect(sorted((c.src, c.dst) for c in copies) == sorted(expected),
                    f"{where}: copies {[(c.src, c.dst) for c in copies]}, changes {expected}")
        seq.num_tokens, seq.block_ids = n, table
        self.copies += len(expected)
        if check_private:
            self.check_private(table[old // b:], where)

    def extend_ids(self, session: SessionShadow, seq: SeqShadow, token_ids: list[int],
                   k: int) -> None:
        if seq.token_ids is not None and len(token_ids) == k:
            seq.token_ids.extend(token_ids)
            self.remember(session, seq.token_ids, len(seq.token_ids) - k)
        else:
            seq.token_ids = None

    def held(self, session: SessionShadow) -> set[int]:
        """Hashes of the whole-block prefixes held with known ids in the session's cache
        namespace."""
        return self.prefixes.setdefault(session.salt or session.session_id.encode(), set())

    def remember(self, session: SessionShadow, token_ids: list[int], old: int) -> None:
        """Record the whole-block prefixes of `token_ids` that end past its first `old`."""
        b, known = self.block_size, self.held(session)
        known.update(hash(tuple(token_ids[:j * b]))
                     for j in range(old // b + 1, len(token_ids) // b + 1))

    def check_private(self, blocks: Sequence[int], where: str) -> None:
        """Blocks just written (or made private) are referenced by one table entry only."""
        counts = self.refcounts()
        shared = [block for block in blocks if counts[block] != 1]
        self.expect(not shared, f"{where}: wrote into shared blocks {shared}")

    def check_shared_within_salt(self, session: SessionShadow, table: Sequence[int]) -> None:
        """A block in two sessions' tables: both opened with the same non-empty salt."""
        mine = set(table)
        for other in self.sessions:
            if other is session:
                continue
            theirs = {b for seq in other.seqs.values() for b in seq.block_ids} & mine
            self.expect(not theirs or (bool(session.salt) and other.salt == session.salt),
                        f"blocks {sorted(theirs)} shared across cache salts")

    # ----------------------------------------------------- daemon vs shadow

    def verify(self, stub: kvpool_pb2_grpc.KVPoolStub, pool: Callable[[], pb.PoolStats],
               timeout: float) -> None:
        """The daemon's tables, token counts and figures equal the shadow's, and every reserved
        block is one table's alone (the fuzzer must be the daemon's only client)."""
        for session in self.sessions:
            seq_ids = list(session.seqs)
            if seq_ids:
                reply = stub.GetBlockTables(pb.GetBlockTablesRequest(
                    session_id=session.session_id, seq_ids=seq_ids), timeout=timeout)
                for seq_id, table in zip(seq_ids, reply.tables, strict=True):
                    seq = session.seqs[seq_id]
                    self.expect(table.seq_id == seq_id and list(table.block_ids) == seq.block_ids
                                and table.num_tokens == seq.num_tokens,
                                f"daemon has seq {seq_id} as {list(table.block_ids)} "
                                f"({table.num_tokens} tokens), shadow {seq}")
            mine = stub.GetStats(pb.GetStatsRequest(session_id=session.session_id),
                                 timeout=timeout).sessions[0]
            # An empty sequence counts one entry: it costs quota (kvpool.proto, max_blocks).
            entries = sum(max(1, len(seq.block_ids)) for seq in session.seqs.values())
            held = len({b for seq in session.seqs.values() for b in seq.block_ids})
            self.expect((mine.num_sequences, mine.block_table_entries, mine.blocks_held)
                        == (len(seq_ids), entries, held),
                        f"session stats {mine} vs shadow ({len(seq_ids)}, {entries}, {held})")
            self.check_shared_within_salt(session, [b for seq in session.seqs.values()
                                                    for b in seq.block_ids])
        counts = self.refcounts()
        reserved = [block for session in self.sessions for seq in session.seqs.values()
                    for block in seq.block_ids[ceil_div(seq.num_tokens, self.block_size):]]
        self.expect(all(counts[block] == 1 for block in reserved),
                    f"reserved blocks shared: {[b for b in reserved if counts[b] != 1]}")
        stats = pool()
        used = len(counts)
        self.expect(stats.used_blocks == used and stats.num_sequences == self.num_sequences(),
                    f"pool has {stats.used_blocks} used blocks and {stats.num_sequences} "
                    f"sequences, shadow {used} and {self.num_sequences()}")
        self.expect(stats.free_blocks + stats.used_blocks == stats.num_blocks
                    and stats.cached_blocks <= stats.free_blocks,
                    f"free {stats.free_blocks} + used {stats.used_blocks} != "
                    f"{stats.num_blocks} (cached {stats.cached_blocks})")


def rpc_code(error: grpc.RpcError) -> grpc.StatusCode:
    """The status of a failed sync call (grpc raises an object that is also a grpc.Call)."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    return code
