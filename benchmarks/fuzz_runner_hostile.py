"""The runner fuzzer's hostile and careless clients: actions that must be refused or harmless.

    hostile = Hostile(seed, corpus, pool_client, runner_client, report, max_model_len)
    await hostile.run(deadline)                       # rounds of every kind, seeded order

Every action opens a session of its own under the honest clients' cache salt (so it meets their
cached blocks), acts, and closes it. Kinds (`KINDS`; MUST_REFUSE in fuzz_runner_report):
- forged_history: allocate a corpus prefix directly in the daemon (a cache hit on honest
  blocks), then step it through the runner with a history of other tokens, num_computed 0;
- computed_lie: the same with the true tokens but num_computed lying (0: recompute the shared
  blocks; all: K/V nobody computed), then released so the runner commits it;
- oov_history / oov_token: a token id outside the vocabulary in a history / a step;
- junk_session: a step for a session id nobody holds;
- cancelled_step / cancelled_then_closed / closed_mid_step: a prefill cancelled mid-flight, then
  released through the runner; or, queued behind another session's long forward, cancelled or
  not, its session closed at once: its blocks go back while its forward may still be queued;
- commit_uncomputed / step_commit_uncomputed: allocate a corpus prefix and certify it (Commit,
  or a Step with commit) without computing anything.
The attacks on uncomputed K/V (computed_lie, *_uncomputed) probe for a corpus prefix with a block
the cache does not hold yet: honest prompts will hit it later.
Killed client processes are fuzz_runner_victim's.
"""

import asyncio
import contextlib
import random
from collections.abc import Awaitable

import grpc
from fuzz_runner_corpus import GREEDY, SHARED_SALT, Corpus
from fuzz_runner_report import RunnerFuzzReport

from pagedkv.client import (
    History,
    PagedKVError,
    PoolClient,
    RunnerClient,
    SeqStep,
    Session,
    StepOutputs,
)

KINDS = ("forged_history", "computed_lie", "oov_history", "oov_token", "junk_session",
         "cancelled_step", "cancelled_then_closed", "closed_mid_step", "commit_uncomputed",
         "step_commit_uncomputed")
# Seconds between two hostile actions; how long a cancelled step may run before its cancel.
PAUSE_S = (0.02, 0.2)
CANCEL_AFTER_S = (0.0, 0.05)
# The long forward a step cancelled then closed waits behind: sequences of random tokens (at
# most max_model_len - 1 each), sent this long before the cancelled step.
BLOCKER_SEQS = 4
BLOCKER_TOKENS = 240
BLOCKER_LEAD_S = 0.005
# Corpus prefixes an attack on uncomputed K/V tries before it settles for a cached one.
PROBES = 4


class Hostile:
    """One hostile client: rounds of every kind in `kinds` (seeded order), each action counted
    by outcome."""

    def __init__(self, seed: int, corpus: Corpus, pool: PoolClient, runner: RunnerClient,
                 report: RunnerFuzzReport, max_model_len: int,
                 kinds: tuple[str, ...] = KINDS) -> None:
        self.rng = random.Random(f"hostile-{seed}")
        # The runner's RunnerInfo.max_model_len: no sequence may hold more tokens.
        self.max_model_len = max_model_len
        self.corpus = corpus
        self.pool = pool
        self.runner = runner
        self.report = report
        self.kinds = kinds
        self.actions = 0

    async def run(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        order: list[str] = []
        while loop.time() < deadline:
            if not order:  # every kind once per round, in a seeded order
                order = self.rng.sample(self.kinds, len(self.kinds))
            kind = order.pop()
            self.actions += 1
            self.report.hostile_started(kind, f"(action {self.actions})")
            session = await self.pool.open_session("hostile", cache_salt=SHARED_SALT,
                                                   keep_alive=False)
            try:
                outcome = await getattr(self, kind)(session)
            except PagedKVError as exc:  # a setup call failed (a full pool): no attack made
                outcome = f"skipped {exc.code.name}"
            finally:
                with contextlib.suppress(PagedKVError):
                    await session.close()
            self.report.hostile_action(kind, outcome, f"(action {self.actions})")
            await asyncio.sleep(self.rng.uniform(*PAUSE_S))

    async def outcome(self, call: Awaitable[object]) -> str:
        """"accepted", or "refused CODE"; INTERNAL and UNKNOWN are findings too."""
        try:
            await call
        except PagedKVError as exc:
            if exc.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                self.report.internal_errors.append(f"hostile action {self.actions}: "
                                                   f"{exc.code.name} {exc.message[:200]}")
            return f"refused {exc.code.name}"
        return "accepted"

    def token(self) -> int:
        return self.rng.randrange(self.corpus.vocab_size)

    async def allocate_uncached(self, session: Session) -> list[int]:
        """Allocate sequence 1 as a corpus prefix with a block the cache does not hold (one of
        PROBES tries): certified without being computed, it is what honest prompts will hit."""
        for _ in range(PROBES - 1):
            tokens = self.corpus.blocks(self.rng)
            if (await session.allocate(1, token_ids=tokens)).num_cached_tokens < len(tokens):
                return tokens
            await session.free(1)
        tokens = self.corpus.blocks(self.rng)
        await session.allocate(1, token_ids=tokens)
        return tokens

    # ------------------------------------------------------------------ forged histories

    async def forged_history(self, session: Session) -> str:
        real = self.corpus.blocks(self.rng)
        await session.allocate(1, token_ids=real)
        forged = list(real)
        for i in self.rng.sample(range(len(forged)), self.rng.randint(1, len(forged))):
            forged[i] = (forged[i] + self.rng.randrange(1, self.corpus.vocab_size)) \
                % self.corpus.vocab_size
        step = SeqStep(1, [self.token()], params=GREEDY, history=History(forged, len(forged), 0))
        return await self.outcome(self.runner.step(session, [step], [1]))

    async def computed_lie(self, session: Session) -> str:
        real = await self.allocate_uncached(session)
        computed = self.rng.choice((0, len(real)))
        step = SeqStep(1, [self.token()], params=GREEDY, history=History(real, len(real), computed))
        return await self.outcome(self.runner.step(session, [step], [1]))

    async def oov_history(self, session: Session) -> str:
        tokens = self.corpus.tokens(self.rng, self.rng.randint(1, 40))
        await session.allocate(1, token_ids=tokens)
        tokens[self.rng.randrange(len(tokens))] = self.corpus.vocab_size + self.rng.randrange(9)
        step = SeqStep(1, [self.token()], params=GREEDY, history=History(tokens, len(tokens), 0))
        return await self.outcome(self.runner.step(session, [step], [1]))

    async def oov_token(self, session: Session) -> str:
        tokens = self.corpus.prompt(self.rng)
        bad = self.rng.choice((self.corpus.vocab_size + self.rng.randrange(9), -1))
        tokens[self.rng.randrange(len(tokens))] = bad
        step = SeqStep(1, tokens, new_sequence=True, params=GREEDY)
        return await self.outcome(self.runner.step(session, [step], [1]))

    async def junk_session(self, session: Session) -> str:
        junk = self.pool.attach(f"junk-{self.rng.randrange(1 << 30)}", session.block_size)
        step = SeqStep(1, [self.token()], new_sequence=True, params=GREEDY)
        return await self.outcome(self.runner.step(junk, [step]))

    # ------------------------------------------------------------------ cancelled steps

    async def cancelled_step(self, session: Session) -> str:
        """Cancel a prefill mid-flight, then release what it named (the retry rules)."""
        task = await self.prefill_in_flight(session)
        outcome = await self.outcome(task) if task.done() else await self.cancelled(task)
        with contextlib.suppress(PagedKVError):
            await self.runner.step(session, [], [1])
        return outcome

    async def cancelled_then_closed(self, session: Session) -> str:
        """A long forward of another session first, so the prefill cancelled next waits in the
        runner's queue; the session is closed at once: its blocks go back to the pool while
        its forward may still be queued, and honest forks' copy-on-write may get them."""
        return await self.behind_long_forward(session, cancel=True)

    async def closed_mid_step(self, session: Session) -> str:
        """The same without the cancel: the session is closed while its step is in flight."""
        return await self.behind_long_forward(session, cancel=False)

    async def behind_long_forward(self, session: Session, cancel: bool) -> str:
        """Another session's long forward, then a prefill of `session` (cancelled or not), then
        `session` closed at once."""
        blocker = await self.pool.open_session("hostile-blocker", cache_salt=SHARED_SALT,
                                               keep_alive=False)
        try:
            length = min(BLOCKER_TOKENS, self.max_model_len - 1)
            seqs = [SeqStep(i, self.corpus.tokens(self.rng, length), new_sequence=True,
                            params=GREEDY) for i in range(1, BLOCKER_SEQS + 1)]
            long_forward = asyncio.create_task(self.runner.step(blocker, seqs,
                                                                [s.seq_id for s in seqs]))
            await asyncio.sleep(BLOCKER_LEAD_S)
            outcome = await self.prefill_then_close(session, cancel)
            with contextlib.suppress(PagedKVError):
                await long_forward
        finally:
            with contextlib.suppress(PagedKVError):
                await blocker.close()
        return outcome

    async def prefill_then_close(self, session: Session, cancel: bool) -> str:
        """A prefill in flight, cancelled (`cancel`) or not, then its session closed at once:
        "cancelled", "closed" (closed under the step, whatever the step answered then), or the
        outcome of a step answered before."""
        task = await self.prefill_in_flight(session)
        if task.done():
            outcome = await self.outcome(task)
        elif cancel:
            outcome = await self.cancelled(task)
        else:
            outcome = "closed"
        await session.close()
        with contextlib.suppress(asyncio.CancelledError, PagedKVError):
            await task
        return outcome

    async def prefill_in_flight(self, session: Session) -> "asyncio.Task[StepOutputs]":
        """A new sequence's step, sent and left to run a random moment."""
        prompt = self.corpus.prompt(self.rng) + self.corpus.tokens(self.rng,
                                                                  self.rng.randint(0, 64))
        task = asyncio.create_task(self.runner.step(
            session, [SeqStep(1, prompt, new_sequence=True, params=GREEDY)]))
        await asyncio.sleep(self.rng.uniform(*CANCEL_AFTER_S))
        return task

    @staticmethod
    async def cancelled(task: "asyncio.Task[StepOutputs]") -> str:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, PagedKVError):
            await task
        return "cancelled"

    # ------------------------------------------------------------------ K/V nobody computed

    async def commit_uncomputed(self, session: Session) -> str:
        await self.allocate_uncached(session)
        return await self.outcome(session.commit([1]))

    async def step_commit_uncomputed(self, session: Session) -> str:
        await self.allocate_uncached(session)
        return await self.outcome(session.step([1], [self.token()], commit=True))
