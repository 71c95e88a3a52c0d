"""The request ids of a session's sequences, and the daemon's lines about single sequences.

A sequence may carry the id of the client's request it serves (kvpool.proto's
AllocateRequest.request_id; a fork's child inherits its parent's): the session keeps it
(`Session.request_ids`) while the sequence lives, so every line about the sequence names it,
and an operator greps one id from the HTTP access line through the runner to the daemon.

Lines about single sequences (allocated, forked, freed) are routine: debug level, so a busy
daemon at info writes none. Each is written only once its call's transaction succeeded (the
journal's `after`): a Batch whose later op fails, undone whole, logs nothing of its ops. The
ids are changed through the same journal, so a failed call leaves them as they were. Lines
about many sequences (a lease expiry) list their ids bounded (`listed`).
"""

import logging

from pagedkv.daemon.core import InvalidArgument, Journal
from pagedkv.daemon.service.sessions import Session
from pagedkv.process.log_setup import get_logger
from pagedkv.vocab.request_ids import check_request_id

log = get_logger(__name__)
# The same logger's stdlib side: whether debug lines are on (structlog's own logger, before
# log_setup.configure runs, cannot say).
_level = logging.getLogger(__name__)


def check(request_id: str) -> None:
    """InvalidArgument naming request_id when it is not an id (vocab's rule)."""
    problem = check_request_id(request_id)
    if problem is not None:
        raise InvalidArgument(problem)


class SequenceLog:
    """Keeps sessions' request ids through `journal` and writes the sequence lines."""

    def __init__(self, journal: Journal) -> None:
        # The pool's journal: the calls' transactions, where the ids' undo is recorded and the
        # lines wait for success.
        self._journal = journal
        # The lines of the open transaction, written once it succeeds.
        self._lines: list[tuple[str, dict[str, object]]] = []

    def allocated(self, session: Session, seq_id: int, request_id: str, num_tokens: int,
                  cached_tokens: int) -> None:
        """A new sequence of `request_id` ("" = none), checked before the pool changed."""
        self._keep(session, seq_id, request_id)
        self._debug("sequence allocated", session, seq_id, num_tokens=num_tokens,
                    cached_tokens=cached_tokens)

    def forked(self, session: Session, parent_seq_id: int, child_seq_id: int) -> None:
        """A fork's child: it serves its parent's request."""
        self._keep(session, child_seq_id, session.request_ids.get(parent_seq_id, ""))
        self._debug("sequence forked", session, child_seq_id, parent_seq_id=parent_seq_id)

    def freed(self, session: Session, seq_id: int, released_blocks: int) -> None:
        """A sequence freed (a Free, or its session's end): its id goes with it."""
        request_id = session.request_ids.pop(seq_id, "")
        if request_id:
            self._journal.record(session.request_ids.__setitem__, seq_id, request_id)
        self._debug("sequence freed", session, seq_id, request_id,
                    released_blocks=released_blocks)

    def _keep(self, session: Session, seq_id: int, request_id: str) -> None:
        if request_id:
            session.request_ids[seq_id] = request_id
            self._journal.record(session.request_ids.pop, seq_id, None)

    def _debug(self, event: str, session: Session, seq_id: int, request_id: str | None = None,
               **fields: object) -> None:
        """A debug line about one sequence, written once the transaction succeeds (nothing is
        kept when debug is off: a busy daemon pays nothing for it)."""
        if not _level.isEnabledFor(logging.DEBUG):
            return
        if request_id is None:
            request_id = session.request_ids.get(seq_id, "")
        self._lines.append((event, {"session": session.label, "seq_id": seq_id,
                                    "request_id": request_id, **fields}))
        self._journal.record(self._lines.clear)  # a failed call logs none of its lines
        self._journal.after(self._write)

    def _write(self) -> None:
        lines, self._lines = self._lines, []
        for event, fields in lines:
            log.debug(event, **fields)
