"""A client step's memory operations, done with the daemon under the client's session before
the step's forward: what the runner knows of each sequence comes only from those answers.

    preparer = Preparer(pool_client, lambda: model_runner, holds=session_holds)
    preparer.validate(requests, release)                       # InvalidStep: nothing changed
    prepared = await preparer.prepare(session_id, known, requests)

`prepare` reads back sequences the runner does not know (a fork's parent, a sequence from before
a runner restart), claims the tokens decoded ahead, checks the model's positions, then makes at
most one daemon call: for single decode tokens none while they fit in their reservations, else a
`Step` (reservations.py; sent in one StepMany with the Steps other sessions make at the same
moment, daemon_steps.py), else one `Batch` of Fork ops (parallel samples, beams), then
Allocate/Append ops. A prefill's commit due (SeqState.commit_due) rides that call: the Step's
commit when it covers every sequence due, else a Commit op first in the Batch. The chunks to
compute follow from the answers. Every call goes through the session's handle
(`SessionSequences.session`), so an answer lost on the way is read back as kvpool.proto's retry
rules say. Those calls hold the session for `hold_ms` (kvpool.proto's "Runner holds"): until the
forward that follows them is done (the engine renews or ends the hold), no client frees the
blocks they answered.
"""

from collections.abc import Callable, Sequence

from pagedkv.client import Allocate, Append, Commit, Fork, PoolClient, SeqStep, SequenceBlocks
from pagedkv.model_runner.engine.daemon_steps import DaemonSteps
from pagedkv.model_runner.engine.forward_loop import Prepared
from pagedkv.model_runner.engine.holds import SessionHolds
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.read_back import ReadBack
from pagedkv.model_runner.engine.reservations import BlockSteps, kept
from pagedkv.model_runner.engine.sequences import Ahead, SeqState, SessionSequences
from pagedkv.model_runner.engine.step_checks import validate_step
from pagedkv.model_runner.engine.steps import InvalidStep
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
        # Decode steps with a daemon Step only once a block (reservations.py).
        self.blocks = BlockSteps(self.steps, holds, runner)
        # Reads back the sequences a step names that the runner does not know, or must check.
        self.read_back = ReadBack(holds, metrics)
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
        held_at = known.held_at  # every daemon call that precedes a forward sets it
        await self.read_back.learn(known, requests)
        claimed = self._claim_ahead(known, requests)
        self._check_lengths(known, requests, claimed)
        todo = [r for i, r in enumerate(requests) if i not in claimed]
        appended = iter(await self._append(known, todo) if todo else [])
        states = [known.known(r.seq_id) if i in claimed else next(appended)
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
        return Prepared(session_id, requests, states, chunks, claimed, ready,
                        daemon_call=known.held_at != held_at)

    def _check_lengths(self, known: SessionSequences, requests: Sequence[SeqStep],
                       claimed: dict[int, Ahead]) -> None:
        """No sequence may hold more tokens than the model has positions (checked before the
        pool changes, so such a step fails alone)."""
        limit = self._runner().max_model_len
        for index, request in enumerate(requests):
            held = 0
            if request.new_sequence and request.parent_seq_id is not None:
                held = len(known.known(request.parent_seq_id).tokens)
            elif not request.new_sequence:
                held = len(known.known(request.seq_id).tokens)
            added = 0 if index in claimed else len(request.token_ids)
            if held + added > limit:
                raise InvalidStep(f"sequence {request.seq_id} would hold {held + added} tokens; "
                                  f"the model takes at most {limit} positions (max_model_len)")

    async def _append(self, known: SessionSequences,
                      requests: Sequence[SeqStep]) -> list[SeqState]:
        """One daemon call for the step's memory operations: `Step` for single decode tokens
        whose commit carries every commit due, else a `Batch`."""
        if all(not r.new_sequence and len(r.token_ids) == 1 for r in requests):
            due = known.due()
            seq_ids = {r.seq_id for r in requests}
            if due is None or (self._committable(known, requests)
                               and seq_ids.issuperset(due.seq_ids)):
                return await self.decode_step(known, requests)
        return await self._batch(known, requests)

    def _committable(self, known: SessionSequences, requests: Sequence[SeqStep]) -> bool:
        """Whether a Step of these sequences may commit: the previous forwards computed all the
        daemon holds of them, and the runner knows their ids are the daemon's (never certify
        others)."""
        return all(s.num_computed >= s.held and s.verified
                   for s in (known.known(r.seq_id) for r in requests))

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

    async def decode_step(self, known: SessionSequences,
                          requests: Sequence[SeqStep], ahead: bool = False) -> list[SeqState]:
        """Append one token to each sequence (the decode hot path): a daemon Step only when a
        sequence crosses past its reserved slots (reservations.py); `ahead`: the runner's own
        step, ahead of the client, which each state then records."""
        states = [known.known(r.seq_id) for r in requests]
        # A call commits what the daemon holds of them if the forwards computed it, and so
        # their commits due.
        await self.blocks.decode(known, requests, states, self._committable(known, requests))
        if ahead:
            for request, state in zip(requests, states, strict=True):
                state.ahead = Ahead(request.token_ids[0])
        return states

    async def _batch(self, known: SessionSequences,
                     requests: Sequence[SeqStep]) -> list[SeqState]:
        """One daemon Batch: certify the tokens a fork's parent decoded into its reservation,
        Fork the forks (a child holds what its parent held before the step), Allocate each
        other new sequence, Append to the rest (their uncertified tokens first)."""
        forks = [r for r in requests if r.new_sequence and r.parent_seq_id is not None]
        parents = {r.parent_seq_id: known.known(r.parent_seq_id) for r in forks
                   if r.parent_seq_id is not None}
        # The parents as they are before this step appends to them: what the children inherit.
        inherited = {r.seq_id: self._fork_parent(known, r) for r in forks}
        uncertified = [(seq_id, state) for seq_id, state in parents.items() if state.uncertified]
        ops: list[Commit | Fork | Allocate | Append] = [
            Append(seq_id, token_ids=state.uncertified) for seq_id, state in uncertified]
        ops.extend(Fork(r.parent_seq_id, r.seq_id) for r in forks if r.parent_seq_id is not None)
        for r in requests:
            if r.new_sequence and r.parent_seq_id is None:
                # The client chose (its swap rule): restore its prefix from the daemon's host
                # tier, or recompute it.
                ops.append(Allocate(r.seq_id, token_ids=r.token_ids,
                                    skip_host_tier=r.skip_host_tier, request_id=r.request_id))
            elif r.new_sequence:  # a fork's child
                if r.token_ids:
                    ops.append(Append(r.seq_id, token_ids=r.token_ids))
            else:  # an existing sequence: the read-back made it known
                state = known.known(r.seq_id)
                held = len(state.tokens) if r.seq_id in parents else state.held
                tokens = [*state.tokens[held:], *r.token_ids]
                if tokens:
                    ops.append(Append(r.seq_id, token_ids=tokens))
        answers: list[SequenceBlocks] = []
        if ops:
            due = known.due()  # first: a fork's child shares what it certifies
            sent = known.asking_hold()
            answers = await known.session.batch([due, *ops] if due else ops,
                                                hold_ms=self.holds.hold_ms)
            known.held_at = sent
            if due is not None:
                known.clear_due(due.seq_ids)
                answers = answers[1:]
        for (seq_id, state), certifying in zip(uncertified, answers, strict=False):
            self._appended(known, seq_id, state, (), certifying)
        for state in parents.values():
            state.private_end = 0  # its last block is shared with the children now
        # A fork's Append answer comes after its Fork answer, a parent's after its certifying
        # Append: the later one wins.
        by_seq = {answer.seq_id: answer for answer in answers[len(uncertified):]}
        states = []
        for r in requests:
            answer = by_seq.get(r.seq_id)
            if r.seq_id in inherited:
                assert answer is not None
                state = inherited[r.seq_id]
                state.tokens.extend(r.token_ids)
                state.held = len(state.tokens)
                state.block_table = list(answer.block_ids)
                known.put(r.seq_id, state)
                if answer.num_tokens != len(state.tokens):
                    known.stale(r.seq_id)
            elif r.new_sequence:
                assert answer is not None
                state = SeqState(list(r.token_ids), r.num_prompt_tokens or len(r.token_ids),
                                 answer.num_cached_tokens, list(answer.block_ids),
                                 answer.num_cached_tokens, answer.num_cached_tokens)
                known.put(r.seq_id, state)
            else:
                state = known.known(r.seq_id)
                self._appended(known, r.seq_id, state, r.token_ids, answer)
            states.append(state)
        return states

    def _appended(self, known: SessionSequences, seq_id: int, state: SeqState,
                  tokens: Sequence[int], answer: SequenceBlocks | None) -> None:
        """Apply a Batch's Append of an existing sequence (its uncertified tokens, then
        `tokens`; None: nothing appended): the daemon must hold every token and answer the
        slots the runner wrote the uncertified ones to."""
        if answer is None:
            return
        bs = self._runner().block_size
        written = state.slots(state.held, len(state.tokens), bs)
        state.tokens.extend(tokens)
        state.held = len(state.tokens)
        state.block_table = list(answer.block_ids)
        state.private_end = 0  # an Append reserves nothing: the next decode step calls
        copies = ((copy.src, copy.dst) for copy in answer.copies)
        if (answer.num_tokens != len(state.tokens)
                or len(answer.slot_mapping) < len(written)
                or not kept(written, answer.slot_mapping, copies, bs)):
            known.stale(seq_id)

    def _fork_parent(self, known: SessionSequences, request: SeqStep) -> SeqState:
        """A copy of the parent's state for a fork's child; the parent must be fully computed
        (else the child would compute K/V into blocks it shares with the parent)."""
        assert request.parent_seq_id is not None
        parent = known.known(request.parent_seq_id)
        if parent.num_computed != len(parent.tokens):
            raise InvalidStep(f"sequence {request.seq_id}: its parent {request.parent_seq_id} is "
                              "not fully computed yet; fork it after its prefill")
        if parent.ahead is not None:
            raise InvalidStep(f"sequence {request.seq_id}: its parent {request.parent_seq_id} "
                              "holds a token decoded ahead (decode_ahead); fork it in a step "
                              "after the one that names that token")
        return SeqState(list(parent.tokens), parent.prompt_len, parent.num_computed,
                        list(parent.block_table), committed=parent.committed,
                        verified=parent.verified, request_id=parent.request_id)

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


