"""The engine's runner steps, carried across a runner restart (the engine's runner client sends
them on one stream, `RunnerStream`).

The KV cache lives in the daemon, so a runner that crashes and comes back (systemd restarts it
on the same socket) loses nothing but what it knew of the client's sequences. A step meets the
restart in one of two ways:

- It reaches the new runner, which does not know the sequences it names (nor their sampling,
  sent only with a sequence's first step): `UnknownSequence`, nothing changed. The step is sent
  again with the history and sampling of each sequence it names.
- The old runner died while the step ran: an `OutcomeUnknown` (a broken stream, or no answer
  within the runner client's timeout; the stream is cancelled and the next step opens another).
  The link asks for the runner's info until one answers (at most `restart_wait_s`). Another
  `runner_id` means the runner restarted: the step's new sequences are freed in the daemon
  through the new runner (their allocation may have happened), and the step is sent again with
  histories and sampling. The daemon then holds at most one token more of a sequence than the
  last answer said (the lost step appended it, or the runner appended it ahead), and the runner
  takes it for the token the step names (runner.proto). The same `runner_id` means a living
  runner may have applied the step: the error stands, but for a release alone (a preemption),
  which is sent again to whichever runner answers: frees of sequences gone are ignored.

A step the runner refuses with `RunnerUnavailable` changed nothing (its daemon is away): it is
sent again every RESTART_POLL_S until the runner takes it (restart_wait_s at most). A daemon
restarted with `restore = "auto"` kept the session, its sequences and the runner's mapping, so
the step then goes through as if the daemon had only paused. A step whose daemon call found the
daemon gone (the runner relays `DaemonUnavailable`) may have been applied: the runner forgot
the session's sequences, so, as after a runner restart, its new sequences are freed and it is
sent again with histories once the runner takes steps; the runner reads them back from the
daemon's records (after a crash, a daemon restored from its crash log: only the tokens past the
committed ones are computed again).

A step is sent at most twice; a second failure is the engine's to report. Any other error is
never resent: `StepNotComputed` (the step was applied, its forward failed) resent as it was would
append its tokens twice.
"""

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence

from pagedkv.client.engine.sequences import Seq
from pagedkv.client.pool.errors import (
    DaemonUnavailable,
    NotFound,
    OutcomeUnknown,
    RunnerUnavailable,
    UnknownSequence,
)
from pagedkv.client.pool.runner_client import History, RunnerClient, SeqStep
from pagedkv.client.pool.session import Session
from pagedkv.client.pool.step_outputs import StepOutputs

# How long a step waits for a runner that stopped answering to answer again (a restart takes a
# process start and a model load), how often it asks, and the deadline of each question.
RESTART_WAIT_S = 120.0
RESTART_POLL_S = 0.2
INFO_TIMEOUT_S = 5.0


class RunnerLink:
    """Steps of one session through one runner, across the runner's restarts."""

    def __init__(self, runner: RunnerClient, session: Session, runner_id: str, *,
                 restart_wait_s: float = RESTART_WAIT_S) -> None:
        self.runner = runner
        self.session = session
        # The runner_id of the runner that answered last ("" = unknown: a step that got no
        # answer is then never resent).
        self.runner_id = runner_id
        self.restart_wait_s = restart_wait_s
        # Steps sent again because the runner restarted.
        self.restarts = 0

    async def step(self, seqs: Sequence[Seq], steps: Sequence[SeqStep],
                   release: Sequence[int], *, follow: bool = False,
                   resend: bool = True) -> StepOutputs:
        """One step (`steps[i]` is what to send for `seqs[i]`; `follow`: runner.proto's), sent
        again once if the runner restarted under it. `resend` False: a step without an answer
        is never sent again (the runner may have stepped its sequences past what the caller
        read: runner.proto's following), only the runner it then meets is learnt."""
        try:
            return await self._step(steps, release, follow)
        except UnknownSequence:
            pass
        except DaemonUnavailable:  # relayed: the runner forgot the session's sequences
            if not resend:
                raise
            await self._free_new(steps)
        except OutcomeUnknown:
            before = self.runner_id
            if not await self._runner_answers():
                raise
            if not steps:  # a release alone: frees of sequences gone are ignored, send it again
                return await self._step([], release, False)
            # An empty id (unknown, or a runner that draws none) never proves a restart.
            if not before or self.runner_id == before or not resend:
                raise
            await self._free_new(steps)
        self.restarts += 1
        return await self._step(with_history(seqs, steps), release, follow)

    async def _step(self, steps: Sequence[SeqStep], release: Sequence[int],
                    follow: bool) -> StepOutputs:
        """The step, sent again while the runner refuses it with RunnerUnavailable (nothing
        changed: its daemon is away, or restarted and being mapped again), restart_wait_s at
        most: a daemon restarted with its state restored keeps the session, so the step then
        goes through; one that started cold answers that the session is gone."""
        deadline = time.monotonic() + self.restart_wait_s
        while True:
            try:
                return await self.runner.step(self.session, steps, release, follow=follow)
            except RunnerUnavailable:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(RESTART_POLL_S)

    async def _runner_answers(self) -> bool:
        """Wait (at most restart_wait_s) for a runner to answer, and learn its runner_id;
        whether one did."""
        deadline = time.monotonic() + self.restart_wait_s
        while True:
            try:
                info = await self.runner.info(timeout=INFO_TIMEOUT_S)
            except OutcomeUnknown:
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(RESTART_POLL_S)
                continue
            self.runner_id = info.runner_id
            return True

    async def _free_new(self, steps: Sequence[SeqStep]) -> None:
        """Free the step's new sequences in the daemon, where the lost step may have allocated
        them, through the new runner (it knows nothing of them, so nothing writes their blocks):
        the old runner's hold on the session may outlast it, and the daemon refuses the
        client's own Free while it lasts (SessionBusy)."""
        new = [step.seq_id for step in steps if step.new_sequence]
        if new:
            with contextlib.suppress(NotFound):
                await self._step([], new, False)


def with_history(seqs: Sequence[Seq], steps: Sequence[SeqStep]) -> list[SeqStep]:
    """`steps`, each existing sequence's with what the daemon holds of it per the last answer
    (the tokens, the prompt's length, how many are computed), its sampling and its request id,
    which the restarted runner does not keep."""
    return [dataclasses.replace(step, history=History(seq.tokens[:seq.held], seq.prompt_len,
                                                      seq.computed), params=seq.params,
                                request_id=seq.request_id)
            if seq.allocated and not step.new_sequence else step
            for seq, step in zip(seqs, steps, strict=True)]
