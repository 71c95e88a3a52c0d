"""A step's end, on the event loop once its forward is done (step_engine.py's stage 3): the
commits of what its prefill chunks computed made due, and the sequences the client released
freed in one daemon Batch, their computed blocks committed first so they stay cached.

    await finish_step(known, prepared, release, holds, block_size)
"""

import contextlib
from collections.abc import Sequence

from pagedkv.client import Append, Commit, Free, SequenceNotFound
from pagedkv.model_runner.engine import step_log
from pagedkv.model_runner.engine.forward_loop import Prepared
from pagedkv.model_runner.engine.holds import SessionHolds
from pagedkv.model_runner.engine.sequences import SeqState, SessionSequences


async def finish_step(known: SessionSequences, prepared: Prepared, release: Sequence[int],
                      holds: SessionHolds, block_size: int) -> None:
    """Make the commits of what prefill chunks computed due (they ride the session's next
    daemon call, holds.py); free the released sequences (their computed blocks committed
    first, so they stay cached). Only sequences whose ids the runner knows are the daemon's
    are committed (SeqState.verified). The step's forward is done and the session's lock
    held, so no forward of it is left: when sequences are released the hold ends, with the
    Batch (which carries the commits due), and the client may close at once."""
    for index, chunk in prepared.chunks:
        state = prepared.states[index]
        if len(chunk.token_ids) > 1 and state.num_computed >= block_size and state.verified:
            state.commit_due = state.num_computed
    if not release:
        return
    released = [seq_id for seq_id in release if known.get(seq_id) is not None]
    step_log.released(known, released)
    certified = [(seq_id, state, _computed(state)) for seq_id in released
                 if (state := known.known(seq_id)).verified]
    due = known.due(skip=released)
    ops: list[Commit | Free | Append] = [due] if due is not None else []
    # The tokens they decoded into reserved slots and computed are appended first (by id:
    # certified), so their blocks are committed too; nothing past them ever is.
    ops.extend(Append(seq_id, token_ids=state.tokens[state.held:n])
               for seq_id, state, n in certified if n > state.held)
    if certified:
        ops.append(Commit([seq_id for seq_id, _, _ in certified],
                          [n for _, _, n in certified]))
    ops.extend(Free(seq_id) for seq_id in released)
    if ops:
        await known.session.batch(ops, end_hold=True)
        known.hold_ended()
        known.clear_due(due.seq_ids if due is not None else ())
    known.drop(released)
    for seq_id in set(release) - set(released):  # never stepped here (a pruned fork)
        with contextlib.suppress(SequenceNotFound):
            await known.session.free(seq_id)
    if not ops:  # a hold of a forgotten entry's too
        await holds.end(known)


def _computed(state: SeqState) -> int:
    """The leading tokens of a released sequence whose K/V the runner computed and may certify:
    not a token it decoded ahead that its client never named (an overshoot past a stop)."""
    return min(state.num_computed, len(state.tokens) - (state.ahead is not None))
