"""An honest client's steps in the runner fuzzer, and the runner following it (runner.proto's
StepStream, "Following") when its runner channel streams steps (`stream_steps=True`).

    following = Following(client)                  # client: a HonestClient
    steps, follow = following.choose(steps)        # maybe follow: every decode decode_ahead
    outputs = await following.send(steps, release, follow)   # None: refused StalePlan
    await following.answered(steps, outputs, follow)         # take some pushes, then...

After a step with follow the client takes a random number of pushes (`next_push`), applies each
as the answer of the implied step it computes itself (each sequence of the last step or push
marked decode_ahead that sampled a token not finishing it) and checks every pushed token with
the shadow as its own steps' tokens. Then it goes on with its next step, planned from what it
read, while the runner is still pushing: sometimes after a release-only step (never stale),
sometimes after a sleep that lets pushes queue (so the step is surely stale), mostly at once.
A step naming sequences that the runner refuses StalePlan must have missed a push: the pushes
queued before the refusal are applied and the client plans again (with the same new ids: a
refused step allocated nothing, so the resend must not meet them). Findings: a pushed answer
that is not the implied step's (sequences, order, tokens), a StalePlan when every push was
taken, a stale step accepted, a release-only step refused mid-follow.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from pagedkv.client import PagedKVError, SeqStep, StalePlan, StepOutputs

if TYPE_CHECKING:
    from fuzz_runner_honest import HonestClient

# Chance that a stream client's step with decodes asks the runner to follow.
FOLLOW_P = 0.35
# Pushes taken after a step with follow: a random number up to this (0 included: the next
# step is then planned before any).
MAX_PUSHES = 6
# Once those are taken and the runner still follows: chances of a release-only step (which is
# never stale), and of a sleep letting pushes queue before the next step (surely stale then).
RELEASE_P = 0.15
STALE_P = 0.3
STALE_SLEEP_S = (0.01, 0.05)
# Seconds a push may take (one forward of a tiny model, on cores shared with everything).
PUSH_TIMEOUT_S = 30.0


class Following:
    """One honest client's steps, and what it knows of the runner following it."""

    def __init__(self, client: HonestClient) -> None:
        self.client = client
        self.report = client.report
        # Only a stream client's runner can follow (pushes come on a step stream).
        self.streams = client.runner.streams is not None
        # The sequences of the runner's next implied step, in its order: non-empty while the
        # runner follows (a push comes), empty once a message, a failure or the end stopped it.
        self.implied: list[int] = []

    def choose(self, steps: list[SeqStep]) -> tuple[list[SeqStep], bool]:
        """`steps`, and whether to follow after them: then every decode is decode_ahead (the
        runner steps exactly those)."""
        decodes = [bool(s.token_ids) and not s.new_sequence for s in steps]
        if not self.streams or not any(decodes) or self.client.rng.random() >= FOLLOW_P:
            return steps, False
        return [dataclasses.replace(s, decode_ahead=True) if decode else s
                for s, decode in zip(steps, decodes, strict=True)], True

    async def send(self, steps: list[SeqStep], release: list[int],
                   follow: bool) -> StepOutputs | None:
        """The step's outputs, or None if it was refused as a stale plan (the pushes it missed
        are applied: plan again); its other errors raised once the pushes before them are
        applied. Any message ends following: the pushes queued before its answer are the
        runner's last ones (`drain`), or those of the following it starts (`answered`)."""
        client, following = self.client, bool(self.implied)
        try:
            outputs = await client.runner.step(client.session, steps, release, follow=follow)
        except StalePlan as exc:
            await self.stale(exc)
            return None
        except PagedKVError:
            if following:
                await self.drain()
            raise
        if following and not steps:  # a release alone is never stale: pushes went before it
            await self.drain()
        elif following and not follow and await self.drain():  # none may come after it
            self.report.follow_findings.append(
                f"{self.where()}: a step planned before pushes it had not read was accepted")
            client.doomed.update(s.seq_id for s in steps)
        return outputs

    async def stale(self, exc: StalePlan) -> None:
        """A refused stale plan: it must have missed a push, queued before the refusal."""
        if await self.drain():
            self.report.stale_refusals += 1
        else:
            self.report.follow_findings.append(
                f"{self.where()}: refused StalePlan after every push was taken: {exc.message}")

    async def answered(self, steps: list[SeqStep], outputs: StepOutputs, follow: bool) -> None:
        """After an accepted step (applied by the client): if it asked to follow, take some
        pushes, then maybe release a followed sequence, or sleep so the next step goes stale."""
        if not follow:
            return
        self.report.follow_steps += 1
        self.implied = [s.seq_id for s, out in zip(steps, outputs, strict=True)
                        if s.decode_ahead and out.sampled and not out.finished]
        rng = self.client.rng
        for _ in range(rng.randint(0, MAX_PUSHES)):
            if not self.implied:  # the runner stopped: no push comes
                return
            try:
                pushed = await self.client.runner.next_push(self.client.session, PUSH_TIMEOUT_S)
            except PagedKVError as exc:
                await self.failed_push(exc)
                return
            self.apply(pushed)
        roll = rng.random()
        if self.implied and roll < RELEASE_P:
            await self.release_one(rng.choice(self.implied))
        elif self.implied and roll < RELEASE_P + STALE_P:
            self.report.stale_sent += 1
            await asyncio.sleep(rng.uniform(*STALE_SLEEP_S))

    async def release_one(self, seq_id: int) -> None:
        """Release a followed sequence while the runner follows: never refused."""
        try:
            await self.send([], [seq_id], False)
        except PagedKVError as exc:
            self.report.follow_findings.append(
                f"{self.where()}: a release-only step mid-follow was refused: "
                f"{exc.code.name} {exc.message[:200]}")
            await self.client.release([seq_id])
            return
        self.report.steps += 1
        self.report.releases_mid_follow += 1
        self.client.live.pop(seq_id, None)
        self.client.doomed.discard(seq_id)

    async def drain(self) -> int:
        """After a message's answer (which ended following): take and apply every push queued
        before it (a pushed failure handled); how many there were."""
        taken = 0
        while True:
            try:
                pushed = self.client.runner.take_push(self.client.session)
            except PagedKVError as exc:
                await self.failed_push(exc)
                return taken + 1
            if pushed is None:
                self.implied = []  # no push comes after them
                return taken
            taken += 1
            self.apply(pushed)

    def apply(self, pushed: StepOutputs) -> None:
        """A pushed answer as the implied steps' it carries, in order (several when the stream
        lagged)."""
        self.report.pushes_taken += 1
        for step in pushed.steps():
            self.apply_step(step)

    def apply_step(self, pushed: StepOutputs) -> None:
        """One implied step's answer: each followed sequence appends its token and samples the
        next, checked by the shadow; the next implied step is those going on."""
        client = self.client
        ids = [out.seq_id for out in pushed]
        if ids != self.implied or not all(i in client.live for i in ids):
            self.report.follow_findings.append(
                f"{self.where()}: a push answers {ids}, the implied step is {self.implied} "
                f"(live: {sorted(client.live)})")
            client.doomed.update(client.live)
            self.implied = []
            return
        for out in pushed:
            seq = client.live[out.seq_id]
            assert seq.pending is not None, "a followed sequence sampled a token"
            seq.tokens = [*seq.tokens, seq.pending]
            if out.seq_id not in client.doomed:  # a wrong token's sequence: one finding only
                step = SeqStep(out.seq_id, [seq.pending], decode_ahead=True)
                client.check(step, seq, out.num_tokens, out.sampled, out.token_id, out.logprob)
            seq.pending = out.token_id if out.sampled else None
            seq.ahead = out.sampled and not out.finished
            if out.finished:
                client.doomed.add(out.seq_id)
        self.implied = [out.seq_id for out in pushed if client.live[out.seq_id].ahead]

    async def failed_push(self, exc: PagedKVError) -> None:
        """A pushed failure (it ends following) as the implied step's: a full pool changed
        nothing; anything else is a finding, and the followed sequences are released."""
        followed, self.implied = self.implied, []
        await self.client.failed([], followed, exc)

    def where(self) -> str:
        return f"seed {self.report.seed} {self.client.name} step {self.client.step_no}"
