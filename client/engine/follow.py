"""What the runner steps by itself while it follows the engine's session (runner.proto's
`follow`), as the engine's own records.

The engine sends each step with `follow`; the runner then goes on stepping the sequences the
step marked decode_ahead whose token did not finish them, and pushes each answer. Each push
answers the step the engine would have sent next (its "implied step"), so the engine applies it
exactly as that step's answer (`Scheduler.update`) and sends nothing while its own plan is that
same step. Once the plan differs (a request arrives, finishes or is aborted, the pool is short,
a prefill or a fork is due), the engine sends it: the runner stops following at that message,
and refuses it as StalePlan if it pushed meanwhile (the engine then reads those pushes and
plans again).

Pushes that arrive after the engine sent a message (a release is never stale) still answer the
implied step the runner took: a sequence that a preemption or release freed meanwhile is
skipped when they are applied, and its tokens go with it.
"""

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedkv.client.engine.requests import Request
from pagedkv.client.engine.scheduler import Plan
from pagedkv.client.engine.sequences import Seq
from pagedkv.client.pool.runner_client import RunnerClient, SeqStep
from pagedkv.client.pool.session import Session
from pagedkv.client.pool.step_outputs import SeqOutput, StepOutputs


@dataclass
class Following:
    """The runner's implied step for this session, and whether more pushes may come."""

    # The sequences of the runner's next implied step (with their requests), in its order: what
    # the next push answers, output for output. Empty when the runner follows none.
    implied: Plan = field(default_factory=Plan)
    # Whether the runner may push again without a message from the engine: true from an
    # answer to a message sent with follow, false once the engine sends another message (the
    # runner stops at it), or a push failed or ended the following.
    active: bool = False

    def answered(self, plan: Plan, outputs: Sequence[SeqOutput], follow: bool) -> None:
        """The engine's step `plan` got `outputs`: the runner follows the sequences it marked
        decode_ahead whose token goes on (runner.proto's implied step). A step naming no
        sequences (a release) leaves the implied step as it was: pushes the runner sent before
        it answer that one."""
        if not plan.seqs:
            self.active = False
            return
        released = set(plan.release)
        self.implied = _going_on(
            (seq, step, owner) for seq, step, owner, out in zip(
                plan.seqs, plan.steps, plan.owners, outputs, strict=True)
            if follow and step.decode_ahead and out.sampled and not out.finished
            and seq.seq_id not in released)
        self.active = bool(self.implied.seqs)

    def pushed(self, outputs: Sequence[SeqOutput]) -> tuple[Plan, list[SeqOutput]]:
        """A push answered the implied step: the part of it still the engine's to apply (its
        sequences not freed since), and the implied step the runner takes next."""
        live, live_outputs, going_on = Plan(), [], Plan()
        for seq, step, owner, out in zip(self.implied.seqs, self.implied.steps,
                                         self.implied.owners, outputs, strict=True):
            if seq.allocated and seq.finish_reason is None and not owner.finished:
                _add(live, seq, step, owner)
                live_outputs.append(out)
            # The runner's next implied step counts every output, those freed here included.
            if out.sampled and not out.finished:
                _add(going_on, seq, SeqStep(seq.seq_id, (out.token_id,), decode_ahead=True),
                     owner)
        self.implied = going_on
        self.active = self.active and bool(going_on.seqs)
        return live, live_outputs

    def covers(self, plan: Plan) -> bool:
        """Whether `plan` is exactly the step the runner takes by itself: the same sequences,
        each one decode token marked decode_ahead, nothing admitted, released or preempted."""
        if not self.active or plan.release or plan.admit or plan.preempt:
            return False
        if len(plan.seqs) != len(self.implied.seqs):
            return False
        followed = {id(seq) for seq in self.implied.seqs}
        return all(id(seq) in followed and _plain_decode(step)
                   for seq, step in zip(plan.seqs, plan.steps, strict=True))

    def stop(self) -> None:
        """The engine sends a message (the runner stops following at it), or the following
        ended: no push comes without another answer. Pushes already sent still apply."""
        self.active = False

    def lost(self) -> list[Request]:
        """The stream broke while the runner followed: the requests whose sequences it may have
        stepped past what the engine read (released and computed again, as preempted)."""
        self.active = False
        requests = list(dict.fromkeys(owner for owner in self.implied.owners
                                      if not owner.finished))
        self.implied = Plan()
        return requests


async def next_push(runner: RunnerClient, session: Session,
                    wake: asyncio.Event) -> StepOutputs | None:
    """The runner's next push on the session's stream, or None if `wake` was set first (the
    push waits on the stream: cancelling the wait loses nothing)."""
    push = asyncio.ensure_future(runner.next_push(session))
    woken = asyncio.ensure_future(wake.wait())
    try:
        await asyncio.wait((push, woken), return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
        if not push.done():
            push.cancel()
    return push.result() if push.done() and not push.cancelled() else None


def _going_on(entries: Iterable[tuple[Seq, SeqStep, Request]]) -> Plan:
    """A plan of these (sequence, step, request) entries, in their order."""
    plan = Plan()
    for seq, step, owner in entries:
        _add(plan, seq, step, owner)
    return plan


def _add(plan: Plan, seq: Seq, step: SeqStep, owner: Request) -> None:
    plan.seqs.append(seq)
    plan.steps.append(step)
    plan.owners.append(owner)


def _plain_decode(step: SeqStep) -> bool:
    return (step.decode_ahead and len(step.token_ids) == 1 and not step.new_sequence
            and step.max_compute_tokens == 0 and step.params is None
            and step.parent_seq_id is None and step.history is None)
