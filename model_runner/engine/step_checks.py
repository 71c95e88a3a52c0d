"""What the runner checks of a client's step before it acts on it, and of its own work before a
forward: the runner is a trust boundary (runner.proto's "Trust").

    validate_step(requests, release, vocab)     # InvalidStep before any daemon call
    check_daemon_ids(seq_id, tokens, table)     # a client's history against the daemon's ids
    check_writes(prepared)                      # no write in a committed prefix or unheld slot

A client's statement about the pool is never believed: its token ids must be in the vocabulary
(else the forward it shares with other clients would fail for all of them), a sequence it
resends must hold the ids the daemon holds, and no forward may write K/V into committed blocks,
which other sessions (other tenants sharing a cache salt) read.
"""

from collections import Counter
from collections.abc import Sequence

from pagedkv.client import History, SeqStep, SequenceBlocks
from pagedkv.model_runner.engine.forward_loop import Prepared
from pagedkv.model_runner.engine.steps import InvalidStep, StepNotComputed
from pagedkv.vocab.request_ids import check_request_id


def validate_step(requests: Sequence[SeqStep], release: Sequence[int], vocab: int) -> None:
    """InvalidStep for a malformed step, before anything is read or changed: its shape, and
    every token id it gives (token_ids, stop_token_ids, history) in [0, vocab), and its
    request ids (vocab's rule: log lines name them)."""
    if not requests and not release:
        raise InvalidStep("a step needs at least one sequence")
    if len({r.seq_id for r in requests}) != len(requests):
        raise InvalidStep("a sequence appears twice in one step")
    if len(set(release)) != len(release):
        twice = next(seq_id for seq_id, n in Counter(release).items() if n > 1)
        raise InvalidStep(f"release_seq_ids names sequence {twice} twice: name each once")
    new = {r.seq_id for r in requests if r.new_sequence}
    for r in requests:
        if r.new_sequence and not r.token_ids and r.parent_seq_id is None:
            raise InvalidStep(f"new sequence {r.seq_id} has no prompt tokens")
        if r.new_sequence and r.params is None:
            raise InvalidStep(f"new sequence {r.seq_id} has no sampling: a sequence's first "
                              "step carries it")
        if r.parent_seq_id is not None and r.parent_seq_id in new | {r.seq_id}:
            raise InvalidStep(f"sequence {r.seq_id}: its parent {r.parent_seq_id} must be an "
                              "existing sequence, not new in the same step")
        if r.num_prompt_tokens and not (r.new_sequence and r.parent_seq_id is None
                                        and r.num_prompt_tokens <= len(r.token_ids)):
            raise InvalidStep(f"sequence {r.seq_id}: num_prompt_tokens applies to a new "
                              f"sequence without a parent and must be <= its {len(r.token_ids)}"
                              " tokens")
        _check_ids(r.seq_id, "token_ids", r.token_ids, vocab)
        if r.params is not None:
            _check_ids(r.seq_id, "sampling.stop_token_ids", r.params.stop_token_ids, vocab)
        if r.history is not None:
            _check_history(r.seq_id, r.history, vocab)
        if r.max_compute_tokens < 0:
            raise InvalidStep(f"sequence {r.seq_id}: max_compute_tokens must be >= 0")
        if (problem := check_request_id(r.request_id)) is not None:
            raise InvalidStep(f"sequence {r.seq_id}: {problem}")


def check_daemon_ids(seq_id: int, tokens: Sequence[int], table: SequenceBlocks) -> None:
    """A sequence's tokens as the client states them must be the ids the daemon holds (when
    it knows them): else the runner would compute other tokens' K/V into its blocks."""
    if table.token_ids and list(tokens) != table.token_ids:
        # The first differing position, or the shorter length when one is a prefix of the other.
        first = next((i for i, (a, b) in enumerate(zip(tokens, table.token_ids, strict=False))
                      if a != b),
                     min(len(tokens), len(table.token_ids)))
        raise InvalidStep(f"sequence {seq_id}: its history differs from the token ids the "
                          f"daemon holds (first at position {first}); nothing changed")


def check_writes(prepared: Prepared) -> None:
    """Defence in depth, before a step joins a forward: no chunk writes a slot below its
    sequence's committed tokens (certified K/V that other sequences, other tenants', read), and
    none past both the tokens the daemon holds and the slots reserved for the sequence alone
    (a slot the daemon never gave it)."""
    for index, chunk in prepared.chunks:
        state = prepared.states[index]
        seq_id = prepared.requests[index].seq_id
        inside = chunk.slot_mapping[:max(state.committed - chunk.start, 0)]
        if any(slot >= 0 for slot in inside):
            raise StepNotComputed(
                f"sequence {seq_id}: the runner would write position "
                f"{chunk.start}, inside its {state.committed} committed tokens; refused")
        given = max(state.held, state.private_end)
        if any(slot >= 0 for slot in chunk.slot_mapping[max(given - chunk.start, 0):]):
            raise StepNotComputed(
                f"sequence {seq_id}: the runner would write past the {given} slots the daemon "
                "gave it; refused")


def _check_ids(seq_id: int, field: str, ids: Sequence[int], vocab: int) -> None:
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidStep(f"sequence {seq_id}: {field} must be in [0, {vocab})")


def _check_history(seq_id: int, history: History, vocab: int) -> None:
    _check_ids(seq_id, "history.token_ids", history.token_ids, vocab)
    n = len(history.token_ids)
    if not (0 <= history.prompt_len <= n and 0 <= history.num_computed <= n):
        raise InvalidStep(f"sequence {seq_id}: history.prompt_len and history.num_computed must "
                          f"be at most its {n} token ids")

