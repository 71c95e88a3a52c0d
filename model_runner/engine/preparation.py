"""A client step's memory operations, done with the daemon under the client's session before
the step's forward: what the runner knows of each sequence comes only from those answers.

    preparer = Preparer(pool_client, lambda: model_runner, holds=session_holds)
    preparer.validate(requests, release)                       # InvalidStep: nothing changed
    prepared = await preparer.prepare(session_id, known, requests)

`prepare` reads back sequences the runner does not know (a fork's parent, a sequence from before
a runner restart), claims the tokens decoded ahead, checks the model's positions, then makes one
daemon call: a `Step` for single decode tokens (committing what the previous forward computed;
sent in one StepMany with the Steps other sessions make at the same moment, daemon_steps.py),
else one `Batch` of Fork ops (parallel samples, beams), then Allocate/Append ops. A prefill's
commit due (SeqState.commit_due) rides that call: the Step's commit when it covers every
sequence due, else a Commit op first in the Batch. The chunks to compute follow from the
answers. Every call goes through the session's handle (`SessionSequences.session`), so an
answer lost on the way is read back as kvpool.proto's retry rules say. Those calls hold the
session for `hold_ms` (kvpool.proto's "Runner holds"): until the forward that follows them is
done (the engine renews or ends the hold), no client frees the blocks they answered.
"""

import time
from collections.abc import Callable, Sequence

from pagedkv.client import Allocate, Append, Commit, Fork, PoolClient, SeqStep, SequenceBlocks, Step
from pagedkv.model_runner.engine.daemon_steps import DaemonSteps
from pagedkv.model_runner.engine.forward_loop import Prepared
from pagedkv.model_runner.engine.holds import SessionHolds
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.sequences import Ahead, SeqState, SessionSequences
from pagedkv.model_runner.engine.step_checks import check_daemon_ids, validate_step
from pagedkv.model_runner.engine.steps import InvalidStep, UnknownSequence
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk


class Preparer:
    """Validates client steps and performs their memory operations with the daemon."""

    def __init__(self, pool: PoolClient, runner: Callable[[], ModelRunner],
                 metrics: RunnerMetrics | None = None, *, holds: SessionHolds) -> None:
        self.pool = pool
        # The runner's holds: how long each daemon call preceding a forward holds the session.
        self.holds = holds
        # Decode Steps, those of several sessions made together sent as one StepMany.
        self.steps = DaemonSteps(pool, metrics)
        # The model runner in use (its block size, vocabulary and positions).
        self._runner = runner

    def validate(self, requests: Sequence[SeqStep], release: Sequence[int]) -> None:
        """InvalidStep for a malformed step, before anything is read or changed."""
        validate_step(requests, release, self._runner().vocab_size)

    async def prepare(self, session_id: str, known: SessionSequences,
                      requests: Sequence[SeqStep]) -> Prepared:
        """Learn unknown sequences, then one daemon call that appends every new token (but the
        tokens the runner appended ahead)."""
        known.attach(self.pool, session_id, self._runner().block_size)
        await self._learn(known, requests)
        claimed = self._claim_ahead(known, requests)
        self._check_lengths(known, requests, claimed)
        todo = [r for i, r in enumerate(requests) if i not in claimed]
        appended = iter(await self._append(known, todo) if todo else [])
        states = [self.known_state(known, r.seq_id) if i in claimed else next(appended)
                  for i, r in enumerate(requests)]
        # An ahead result holds if the client kept the sampling (the state's, which the step
        # ahead used); else sample that position again.
        ready = {i: ahead.result for i, ahead in claimed.items()
                 if ahead.result is not None and requests[i].params == states[i].params}
        chunks = []
        for index, (request, state) in enumerate(zip(requests, states, strict=True)):
            chunk = None if index in ready else self.chunk(request, state, index in claimed)
            if chunk is not None:
                chunks.append((index, chunk))
        return Prepared(session_id, requests, states, chunks, claimed, ready)

    def _check_lengths(self, known: SessionSequences, requests: Sequence[SeqStep],
                       claimed: dict[int, Ahead]) -> None:
        """No sequence may hold more tokens than the model has positions (checked before the
        pool changes, so such a step fails alone)."""
        limit = self._runner().max_model_len
        for index, request in enumerate(requests):
            held = 0
            if request.new_sequence and request.parent_seq_id is not None:
                held = len(self.known_state(known, request.parent_seq_id).tokens)
            elif not request.new_sequence:
                held = len(self.known_state(known, request.seq_id).tokens)
            added = 0 if index in claimed else len(request.token_ids)
            if held + added > limit:
                raise InvalidStep(f"sequence {request.seq_id} would hold {held + added} tokens; "
                                  f"the model takes at most {limit} positions (max_model_len)")

    async def _append(self, known: SessionSequences,
                      requests: Sequence[SeqStep]) -> list[SeqState]:
        """One daemon call for the step's memory operations: `Step` for single decode tokens
        whose commit carries every commit due, else a `Batch`."""
        if all(not r.new_sequence and len(r.token_ids) == 1 for r in requests):
            due = self.holds.due_commit(known)
            seq_ids = {r.seq_id for r in requests}
            if due is None or (self._committable(known, requests)
                               and seq_ids.issuperset(due.seq_ids)):
                return await self.decode_step(known, requests)
        return await self._batch(known, requests)

    def _committable(self, known: SessionSequences, requests: Sequence[SeqStep]) -> bool:
        """Whether a Step of these sequences may commit: the previous forward computed all they
        hold, and the runner knows their ids are the daemon's (never certify others)."""
        return all(s.num_computed == len(s.tokens) and s.verified
                   for s in (self.known_state(known, r.seq_id) for r in requests))

    def _claim_ahead(self, known: SessionSequences,
                     requests: Sequence[SeqStep]) -> dict[int, Ahead]:
        """The step's sequences whose token the runner appended ahead: it must be the one
        token each names. Nothing changes here: a failed step leaves them claimable."""
        claimed = {}
        for index, request in enumerate(requests):
            state = None if request.new_sequence else known.get(request.seq_id)
            if state is None or state.ahead is None:
                continue
            if tuple(request.token_ids) != (state.ahead.token_id,):
                raise InvalidStep(
                    f"sequence {request.seq_id}: the runner decoded it ahead (decode_ahead), "
                    f"appending its sampled token {state.ahead.token_id}; its next step must "
                    "name exactly that token, or release the sequence")
            claimed[index] = state.ahead
        return claimed

    async def _learn(self, known: SessionSequences,
                     requests: Sequence[SeqStep]) -> None:
        """Read back existing sequences the runner has not seen: a fork (its parent's history)
        or a sequence from before a runner restart (the history the client sends). Nothing a
        client states is believed: its tokens must be the ids the daemon holds, and only the
        daemon's committed tokens (or the parent's own blocks) count as computed; the rest is
        computed again. All are checked before any is known. In the same call (holding the
        session) the sequences the step computes without appending to them are read back too:
        the client may have freed or changed them directly since the runner's last call (no
        hold then), and their blocks may be another session's now (UnknownSequence)."""
        unknown = [r for r in requests if not r.new_sequence and known.get(r.seq_id) is None]
        idle = [r.seq_id for r in requests if self._unappended(known, r)]
        if not unknown and not idle:
            return
        # The daemon first: another session's sequence is NOT_FOUND there, as it must be here.
        sent = time.monotonic()
        tables = await known.session.block_tables([r.seq_id for r in unknown] + idle,
                                                  token_ids=True, hold_ms=self.holds.hold_ms)
        known.held_at = sent
        for seq_id, table in zip(idle, tables[len(unknown):], strict=True):
            self._check_unchanged(known, seq_id, table)
        for request in unknown:
            if request.params is None or (self._parent(known, request) is None
                                          and request.history is None):
                raise UnknownSequence(
                    f"sequence {request.seq_id} is unknown to the runner (forked, or the runner "
                    "restarted): resend it with its history and sampling (a fork: its "
                    "parent_seq_id and sampling)")
        learnt = [self._adopt(known, request, table)
                  for request, table in zip(unknown, tables[:len(unknown)], strict=True)]
        for request, state in zip(unknown, learnt, strict=True):
            known.put(request.seq_id, state)

    @staticmethod
    def _unappended(known: SessionSequences, request: SeqStep) -> bool:
        """A known sequence the step computes (it holds tokens not computed) with no daemon call
        of its own: nothing appended (a chunked prefill going on, a resend without tokens), or
        only its token decoded ahead, whose forward failed."""
        state = None if request.new_sequence else known.get(request.seq_id)
        if state is None or state.num_computed == len(state.tokens):
            return False
        ahead = state.ahead is not None and tuple(request.token_ids) == (state.ahead.token_id,)
        return not request.token_ids or ahead

    def _check_unchanged(self, known: SessionSequences, seq_id: int,
                         table: SequenceBlocks) -> None:
        """UnknownSequence (the sequence forgotten) unless the daemon holds what the runner
        knows of it: its tokens and its blocks."""
        state = self.known_state(known, seq_id)
        if (table.num_tokens != len(state.tokens) or table.block_ids != state.block_table
                or (table.token_ids and table.token_ids != state.tokens)):
            self._stale(known, seq_id)

    def _adopt(self, known: SessionSequences, request: SeqStep,
               table: SequenceBlocks) -> SeqState:
        """The state of a sequence the client forked itself (its parent's tokens) or resends
        after a runner restart (its history), checked against the daemon's `table`."""
        parent = self._parent(known, request)
        if parent is not None:
            return self._adopt_fork(request, parent, table)
        assert request.history is not None
        history = request.history
        tokens = list(history.token_ids)
        # One token more in the daemon: the runner that restarted appended it ahead (the
        # client's last answer sampled it, and this step names it).
        ahead = len(request.token_ids) == 1 and table.num_tokens == len(tokens) + 1
        if ahead:
            tokens.append(request.token_ids[0])
        if len(tokens) != table.num_tokens:
            raise InvalidStep(f"sequence {request.seq_id}: the daemon holds {table.num_tokens} "
                              f"tokens, its history says {len(history.token_ids)}")
        check_daemon_ids(request.seq_id, tokens, table)
        # Computed: the daemon's committed tokens only, whatever history.num_computed says.
        state = SeqState(tokens, history.prompt_len, table.num_cached_tokens,
                         list(table.block_ids), committed=table.num_cached_tokens,
                         verified=bool(table.token_ids) or not tokens)
        if ahead:
            state.ahead = Ahead(request.token_ids[0])
        return state

    @staticmethod
    def _adopt_fork(request: SeqStep, parent: SeqState,
                    table: SequenceBlocks) -> SeqState:
        """A sequence the client forked from `parent` holds its first num_tokens tokens. What
        the parent computed counts only if the child's table holds the parent's very blocks
        (the same K/V); else the daemon's committed tokens."""
        n = table.num_tokens
        tokens = parent.tokens[:n]
        if len(tokens) != n:
            raise InvalidStep(f"sequence {request.seq_id}: the daemon holds {n} tokens, more "
                              f"than its parent {request.parent_seq_id}'s {len(parent.tokens)}")
        check_daemon_ids(request.seq_id, tokens, table)
        computed = min(parent.num_computed, n)
        if table.block_ids != parent.block_table[:len(table.block_ids)]:
            computed = table.num_cached_tokens
        return SeqState(tokens, min(parent.prompt_len, n), computed, list(table.block_ids),
                        committed=table.num_cached_tokens,
                        verified=bool(table.token_ids) or not tokens)

    @staticmethod
    def _parent(known: SessionSequences, request: SeqStep) -> SeqState | None:
        return None if request.parent_seq_id is None else known.get(request.parent_seq_id)

    async def decode_step(self, known: SessionSequences,
                          requests: Sequence[SeqStep], ahead: bool = False) -> list[SeqState]:
        """One daemon Step appending one token to each sequence (the decode hot path); `ahead`:
        the runner's own step, ahead of the client, which each state then records."""
        states = [self.known_state(known, r.seq_id) for r in requests]
        # If the previous forward computed everything they hold, the Step commits it, and so
        # their commits due.
        commit = self._committable(known, requests)
        seq_ids = [r.seq_id for r in requests]
        tokens = [r.token_ids[0] for r in requests]
        sent = time.monotonic()
        reply = await self.steps.step(known.session, Step(seq_ids, tokens, 1, commit,
                                                          self.holds.hold_ms))
        known.held_at = sent
        if commit:
            known.clear_due(seq_ids)
        for index, logical, block in zip(reply.changed_seq_index, reply.changed_logical_block,
                                         reply.changed_block_id, strict=True):
            states[index].patch(logical, block)
        bs = self._runner().block_size
        for request, state, token, held, slot in zip(requests, states, tokens, reply.num_tokens,
                                                     reply.slot_mapping, strict=True):
            state.tokens.append(token)
            if ahead:
                state.ahead = Ahead(token)
            if held != len(state.tokens) or state.slots(held - 1, held, bs) != [slot]:
                self._stale(known, request.seq_id)
        return states

    @staticmethod
    def _stale(known: SessionSequences, seq_id: int) -> None:
        """The daemon's answer disagrees with the runner's view of a sequence: the client
        changed it directly in the daemon. Forget it rather than compute on a stale table."""
        known.drop([seq_id])
        raise UnknownSequence(f"sequence {seq_id} changed in the daemon behind the runner (freed "
                              "or re-created directly): resend it with its history")

    async def _batch(self, known: SessionSequences,
                     requests: Sequence[SeqStep]) -> list[SeqState]:
        """One daemon Batch: Fork the forks first (a child holds what its parent held before the
        step), Allocate each other new sequence, Append to the rest."""
        forks = [r for r in requests if r.new_sequence and r.parent_seq_id is not None]
        # The parents as they are before this step appends to them: what the children inherit.
        inherited = {r.seq_id: self._fork_parent(known, r) for r in forks}
        ops: list[Commit | Fork | Allocate | Append] = [
            Fork(r.parent_seq_id, r.seq_id) for r in forks if r.parent_seq_id is not None]
        for r in requests:
            if r.new_sequence and r.parent_seq_id is None:
                ops.append(Allocate(r.seq_id, token_ids=r.token_ids))
            elif r.token_ids:  # an existing sequence: _learn made it known
                ops.append(Append(r.seq_id, token_ids=r.token_ids))
        answers: list[SequenceBlocks] = []
        if ops:
            due = self.holds.due_commit(known)  # first: a fork's child shares what it certifies
            sent = time.monotonic()
            answers = await known.session.batch([due, *ops] if due else ops,
                                                hold_ms=self.holds.hold_ms)
            known.held_at = sent
            if due is not None:
                known.clear_due(due.seq_ids)
                answers = answers[1:]
        # A fork's Append answer comes after its Fork answer: the later one wins.
        by_seq = {answer.seq_id: answer for answer in answers}
        states = []
        for r in requests:
            answer = by_seq.get(r.seq_id)
            if r.seq_id in inherited:
                assert answer is not None
                state = inherited[r.seq_id]
                state.tokens.extend(r.token_ids)
                state.block_table = list(answer.block_ids)
                known.put(r.seq_id, state)
                if answer.num_tokens != len(state.tokens):
                    self._stale(known, r.seq_id)
            elif r.new_sequence:
                assert answer is not None
                state = SeqState(list(r.token_ids), r.num_prompt_tokens or len(r.token_ids),
                                 answer.num_cached_tokens, list(answer.block_ids),
                                 answer.num_cached_tokens, answer.num_cached_tokens)
                known.put(r.seq_id, state)
            else:
                state = self.known_state(known, r.seq_id)
                if answer is not None:
                    state.tokens.extend(r.token_ids)
                    state.block_table = list(answer.block_ids)
                    if answer.num_tokens != len(state.tokens):
                        self._stale(known, r.seq_id)
            states.append(state)
        return states

    def _fork_parent(self, known: SessionSequences, request: SeqStep) -> SeqState:
        """A copy of the parent's state for a fork's child; the parent must be fully computed
        (else the child would compute K/V into blocks it shares with the parent)."""
        assert request.parent_seq_id is not None
        parent = self.known_state(known, request.parent_seq_id)
        if parent.num_computed != len(parent.tokens):
            raise InvalidStep(f"sequence {request.seq_id}: its parent {request.parent_seq_id} is "
                              "not fully computed yet; fork it after its prefill")
        if parent.ahead is not None:
            raise InvalidStep(f"sequence {request.seq_id}: its parent {request.parent_seq_id} "
                              "holds a token decoded ahead (decode_ahead); fork it in a step "
                              "after the one that names that token")
        return SeqState(list(parent.tokens), parent.prompt_len, parent.num_computed,
                        list(parent.block_table), committed=parent.committed,
                        verified=parent.verified)

    def known_state(self, known: SessionSequences, seq_id: int) -> SeqState:
        state = known.get(seq_id)
        if state is None:
            raise InvalidStep(f"sequence {seq_id} is not known to the runner: send it as a new "
                              "sequence, or name its parent on a fork's first step")
        return state

    def chunk(self, request: SeqStep, state: SeqState,
              resample: bool = False) -> SequenceChunk | None:
        """The tokens of `state` to compute in this step, or None if all are computed (unless
        the step is to sample again a position already computed: `resample`)."""
        bs = self._runner().block_size
        total = len(state.tokens)
        start = state.num_computed
        if start == total:
            # Everything is cached (a prompt of whole cached blocks), or computed ahead: recompute
            # the last token for its logits, writing nothing (its K/V is in a block others may
            # share).
            if not (request.new_sequence or resample):
                return None
            return SequenceChunk(state.tokens[-1:], total - 1, [-1], state.block_table)
        end = total if not request.max_compute_tokens else min(
            total, start + request.max_compute_tokens)
        return SequenceChunk(state.tokens[start:end], start, state.slots(start, end, bs),
                             state.block_table)

