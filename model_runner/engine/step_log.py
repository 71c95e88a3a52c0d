"""The runner's lines about its clients' sequences, each naming the id of the request the
sequence serves (runner.proto's SequenceStep.request_id), so one id found on the HTTP access
line leads to the runner's and the daemon's lines.

Routine events, one per sequence (admitted, finished, released), are debug lines: a busy
runner at info writes none. A failed step is a warning naming its sequences' request ids (at
most MAX_LOGGED_IDS, then how many more), but the failures a client meets in its ordinary
recovery (UnknownSequence after a runner restart, StalePlan while the runner follows its
session), which change nothing and are resent at once: those are debug lines. The session is
never named: its id is a credential.
"""

from collections.abc import Sequence

from pagedkv.client import SeqOutput, SeqStep
from pagedkv.model_runner.engine.sequences import SessionSequences
from pagedkv.model_runner.engine.steps import StalePlan, UnknownSequence
from pagedkv.process.log_setup import get_logger
from pagedkv.vocab.request_ids import listed

log = get_logger("pagedkv.runner")

# Failures that are part of a client's ordinary recovery: logged at debug.
ROUTINE_FAILURES = (UnknownSequence, StalePlan)
# Longest error message a failure line carries (a daemon's message may quote a long list).
MAX_MESSAGE_CHARS = 256


def admitted(known: SessionSequences, requests: Sequence[SeqStep]) -> None:
    """The step's new sequences, prepared (allocated or forked in the daemon)."""
    for request in requests:
        if request.new_sequence:
            state = known.known(request.seq_id)
            log.debug("sequence admitted", seq_id=request.seq_id, request_id=state.request_id,
                      num_tokens=len(state.tokens), cached_tokens=state.num_cached,
                      parent_seq_id=request.parent_seq_id)


def finished(known: SessionSequences, results: Sequence[SeqOutput]) -> None:
    """The sequences whose sampled token finished them in this step."""
    for result in results:
        if result.finished and (state := known.get(result.seq_id)) is not None:
            log.debug("sequence finished", seq_id=result.seq_id, request_id=state.request_id,
                      num_tokens=result.num_tokens, constraint_ended=result.constraint_ended)


def released(known: SessionSequences, seq_ids: Sequence[int]) -> None:
    """Sequences the client released, about to be freed in the daemon."""
    for seq_id in seq_ids:
        log.debug("sequence released", seq_id=seq_id, request_id=known.known(seq_id).request_id)


def failed(known: SessionSequences, requests: Sequence[SeqStep], exc: Exception) -> None:
    """A step that failed once validated: its sequences' ids, what failed and why."""
    ids = (r.request_id or (state.request_id if (state := known.get(r.seq_id)) else "")
           for r in requests)
    write = log.debug if isinstance(exc, ROUTINE_FAILURES) else log.warning
    write("step failed", request_ids=listed(ids),
          seq_ids=listed(str(r.seq_id) for r in requests), num_seqs=len(requests),
          error=type(exc).__name__, message=str(exc)[:MAX_MESSAGE_CHARS])
