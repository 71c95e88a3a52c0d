"""The sequences a client step names that the runner does not know, or must check first, read
back from the daemon before anything is computed (one GetBlockTables with the token ids it holds).

    read_back = ReadBack(session_holds)
    await read_back.learn(known, requests)   # UnknownSequence / InvalidStep: nothing changed

A sequence the runner does not know is a child the client forked itself (it names its parent) or
one from before a runner restart (it comes with its history). Nothing a client states is
believed: what the daemon holds of it must be the ids the client names, and only the daemon's
committed tokens (or the parent's own blocks) count as computed; the rest is computed again.
The daemon may hold fewer tokens than the client was told (the runner appends decode tokens to
it once a block, reservations.py): a history's tail is appended by the runner and computed
again, and a child the client forked while its parent held more in the runner names its
history. A known sequence the step computes without appending to it is read back too: between
two steps the client may have freed or re-created it directly.
"""

from collections.abc import Sequence

from pagedkv.client import SeqStep, SequenceBlocks
from pagedkv.model_runner.engine.holds import SessionHolds
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.sequences import Ahead, SeqState, SessionSequences
from pagedkv.model_runner.engine.step_checks import check_daemon_ids
from pagedkv.model_runner.engine.steps import InvalidStep, UnknownSequence


class ReadBack:
    """Learns and checks sequences from the daemon's tables, under the client's session."""

    def __init__(self, holds: SessionHolds, metrics: RunnerMetrics | None = None) -> None:
        # The runner's holds: the read-back holds the session, as a call before a forward.
        self.holds = holds
        # Where the tokens of resent histories computed again are counted.
        self.metrics = metrics

    async def learn(self, known: SessionSequences, requests: Sequence[SeqStep]) -> None:
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
        sent = known.asking_hold()
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
            if self.metrics is not None and request.history is not None:
                self.metrics.recomputed(max(len(request.history.token_ids) - state.num_computed,
                                            0))

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
        state = known.known(seq_id)
        if (table.num_tokens != state.held or table.block_ids != state.block_table
                or (table.token_ids and table.token_ids != state.tokens[:state.held])):
            known.stale(seq_id)

    def _adopt(self, known: SessionSequences, request: SeqStep,
               table: SequenceBlocks) -> SeqState:
        """The state of a sequence the client forked itself (its parent's tokens, or its
        history) or resends after a runner restart (its history), checked against the daemon's
        `table`."""
        parent = self._parent(known, request)
        if parent is not None and request.history is None:
            return self._adopt_fork(request, parent, table)
        assert request.history is not None
        history = request.history
        tokens = list(history.token_ids)
        # One token more in the daemon: the runner that restarted appended it ahead (the
        # client's last answer sampled it, and this step names it).
        ahead = len(request.token_ids) == 1 and table.num_tokens == len(tokens) + 1
        if ahead:
            tokens.append(request.token_ids[0])
        # Fewer: the runner that restarted decoded the rest into reserved slots and never
        # certified them (reservations.py); this runner appends them and computes them again.
        held = table.num_tokens
        if held > len(tokens):
            raise InvalidStep(f"sequence {request.seq_id}: the daemon holds {held} tokens, its "
                              f"history says {len(history.token_ids)}")
        check_daemon_ids(request.seq_id, tokens[:held], table)
        # Computed: the daemon's committed tokens only, whatever history.num_computed says; a
        # fork's child: what its parent computed, as `_adopt_fork` says.
        computed = table.num_cached_tokens
        if parent is not None:
            computed = _fork_computed(parent, table)
            if tokens[:held] != parent.tokens[:held]:
                raise InvalidStep(f"sequence {request.seq_id}: its history differs from its "
                                  f"parent {request.parent_seq_id}'s tokens")
        state = SeqState(tokens, history.prompt_len, computed,
                         list(table.block_ids), committed=table.num_cached_tokens,
                         verified=bool(table.token_ids) or not held)
        state.held = held
        if ahead:
            state.ahead = Ahead(request.token_ids[0])
        return state

    @staticmethod
    def _adopt_fork(request: SeqStep, parent: SeqState,
                    table: SequenceBlocks) -> SeqState:
        """A sequence the client forked from `parent` holds its first num_tokens tokens. What
        the parent computed counts only if the child's table holds the parent's very blocks
        (the same K/V); else the daemon's committed tokens. When the daemon holds fewer than
        the parent's tokens, which of the parent's tokens the client forked is unknown (the
        daemon gets decode tokens once a block, reservations.py): UnknownSequence, and the
        client resends the step with the child's history."""
        n = table.num_tokens
        tokens = parent.tokens[:n]
        if len(tokens) != n:
            raise InvalidStep(f"sequence {request.seq_id}: the daemon holds {n} tokens, more "
                              f"than its parent {request.parent_seq_id}'s {len(parent.tokens)}")
        if n < len(parent.tokens):
            raise UnknownSequence(
                f"sequence {request.seq_id}: the daemon holds {n} of its parent "
                f"{request.parent_seq_id}'s {len(parent.tokens)} tokens (the runner appends "
                "decode tokens to the daemon once a block): resend it with its history")
        check_daemon_ids(request.seq_id, tokens, table)
        return SeqState(tokens, min(parent.prompt_len, n), _fork_computed(parent, table),
                        list(table.block_ids),
                        committed=table.num_cached_tokens,
                        verified=bool(table.token_ids) or not tokens)

    @staticmethod
    def _parent(known: SessionSequences, request: SeqStep) -> SeqState | None:
        return None if request.parent_seq_id is None else known.get(request.parent_seq_id)


def _fork_computed(parent: SeqState, table: SequenceBlocks) -> int:
    """How many leading tokens of a child the client forked from `parent` are computed: what
    the parent computed of them if the child's table holds the parent's very blocks (the same
    K/V), else the daemon's committed tokens."""
    if table.block_ids != parent.block_table[:len(table.block_ids)]:
        return table.num_cached_tokens
    return min(parent.num_computed, table.num_tokens)
