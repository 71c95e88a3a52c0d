"""An honest client of the runner fuzzer: random valid steps, every sampled token checked.

    client = HonestClient("honest-0", seed, corpus, reference, session, runner, report)
    await client.run(deadline)

Each step names every live sequence of the client (a decode of its last sampled token, more of
a chunked prefill), may start one (a prompt from the shared corpus: other clients' cached
blocks), may fork one (empty or one token of its own, as parallel sampling and beams do), may
mark decodes `decode_ahead`, and releases sequences that reached their length. Greedy sampling
with logprobs: every token is judged by the shadow (`Reference`) on the exact tokens this client
holds. A sequence given a wrong token is released (one count per incident, not a cascade).
A client whose runner channel streams steps has the runner follow some of them, and takes and
checks its pushes (`fuzz_runner_follow`).

A failed step is handled as runner.proto's retry rules say: a full pool changed nothing (the
client releases its longest sequence and goes on); any other failure of a valid step is a
finding, and the client releases every sequence the step named.
"""

import asyncio
import contextlib
import random
from dataclasses import dataclass

import grpc
from fuzz_runner_corpus import GREEDY, Corpus
from fuzz_runner_follow import Following
from fuzz_runner_report import RunnerFuzzReport
from fuzz_runner_shadow import Reference

from pagedkv.client import PagedKVError, RunnerClient, SeqStep, Session

# Sequences one honest client holds at most; tokens generated per sequence.
MAX_LIVE = 4
GENERATED = (2, 24)


@dataclass
class HonestSeq:
    """One sequence as its honest client knows it."""

    # Every token it holds (prompt, then the tokens appended), as this client sent them.
    tokens: list[int]
    # The token its last step sampled, to append next (None until one is sampled).
    pending: int | None
    # Its last step was decode_ahead and sampled: the next step must name `pending`.
    ahead: bool
    # Released once it holds this many tokens.
    stop_at: int


class HonestClient:
    """Random valid steps on one session of its own, checked by the shadow."""

    def __init__(self, name: str, seed: int, corpus: Corpus, reference: Reference,
                 session: Session, runner: RunnerClient, report: RunnerFuzzReport) -> None:
        self.name = name
        self.rng = random.Random(f"{name}-{seed}")
        self.corpus = corpus
        self.reference = reference
        self.session = session
        self.runner = runner
        self.report = report
        self.live: dict[int, HonestSeq] = {}
        self.next_id = 1
        self.step_no = 0
        # Sequences to release in the next step (a wrong token, a finished sequence).
        self.doomed: set[int] = set()
        # Sends the steps; on a stream channel, has the runner follow some of them.
        self.following = Following(self)

    async def run(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < deadline:
            await self.one_step()
            await asyncio.sleep(self.rng.uniform(0.0, 0.005))
        with contextlib.suppress(PagedKVError):
            await self.release(list(self.live))

    # ------------------------------------------------------------------ planning

    def plan(self) -> tuple[list[SeqStep], list[int], dict[int, HonestSeq]]:
        """The next step, the sequences it releases, and each named sequence after the step."""
        rng, steps, after = self.rng, [], {}
        release = [seq_id for seq_id, seq in self.live.items()
                   if seq_id in self.doomed or len(seq.tokens) + 1 >= seq.stop_at]
        for seq_id, seq in self.live.items():
            if seq_id in release:
                continue
            if seq.pending is None:  # a chunked prefill goes on
                steps.append(SeqStep(seq_id, [], max_compute_tokens=self.chunk(), params=GREEDY))
                after[seq_id] = HonestSeq(seq.tokens, None, False, seq.stop_at)
                continue
            steps.append(SeqStep(seq_id, [seq.pending], params=GREEDY,
                                 decode_ahead=rng.random() < 0.3))
            after[seq_id] = HonestSeq([*seq.tokens, seq.pending], None, False, seq.stop_at)
        parents = [i for i in after if self.live[i].pending is not None and not self.live[i].ahead]
        if parents and len(self.live) < MAX_LIVE and rng.random() < 0.15:
            parent_id = rng.choice(parents)
            parent = self.live[parent_id]
            own = self.corpus.tokens(rng, rng.randint(0, 1))
            seq_id = self.new_id()
            steps.append(SeqStep(seq_id, own, new_sequence=True, params=GREEDY,
                                 parent_seq_id=parent_id))
            after[seq_id] = HonestSeq([*parent.tokens, *own], None, False, parent.stop_at)
        if len(self.live) < MAX_LIVE and (not self.live or rng.random() < 0.3):
            prompt = self.corpus.prompt(rng)
            seq_id = self.new_id()
            stop_at = min(len(prompt) + rng.randint(*GENERATED), self.reference.max_model_len - 1)
            steps.append(SeqStep(seq_id, prompt, new_sequence=True, params=GREEDY,
                                 max_compute_tokens=self.chunk()))
            after[seq_id] = HonestSeq(prompt, None, False, stop_at)
        return steps, release, after

    def chunk(self) -> int:
        """Most tokens to compute now: mostly all (0), sometimes a chunked prefill."""
        return self.rng.choice((0, 0, 0, self.corpus.block_size, 2 * self.corpus.block_size - 3))

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # ------------------------------------------------------------------ the step

    async def one_step(self) -> None:
        first_id = self.next_id
        steps, release, after = self.plan()
        if not steps and not release:
            return
        steps, follow = self.following.choose(steps)
        self.step_no += 1
        try:
            outputs = await self.following.send(steps, release, follow)
        except PagedKVError as exc:
            await self.failed(steps, release, exc)
            return
        if outputs is None:  # a stale plan changed nothing: plan again, reusing its new ids
            self.next_id = first_id
            return
        self.report.steps += 1
        for seq_id in release:
            self.live.pop(seq_id, None)
            self.doomed.discard(seq_id)
        for step, out in zip(steps, outputs, strict=True):
            seq = after[step.seq_id]
            if step.new_sequence and step.parent_seq_id is None:
                self.report.sequences += 1
                self.report.cached_sequences += out.num_cached > 0
            elif step.new_sequence:
                self.report.forks += 1
            self.live[step.seq_id] = seq
            self.check(step, seq, out.num_tokens, out.sampled, out.token_id, out.logprob)
            if out.sampled:
                seq.pending = out.token_id
                seq.ahead = step.decode_ahead and not out.finished
            if out.finished:
                self.doomed.add(step.seq_id)
        await self.following.answered(steps, outputs, follow)

    def check(self, step: SeqStep, seq: HonestSeq, num_tokens: int, sampled: bool,
              token_id: int, logprob: float) -> None:
        """The shadow's judgement of one output."""
        where = (f"seed {self.report.seed} {self.name} step {self.step_no} seq {step.seq_id} "
                 f"({len(seq.tokens)} tokens)")
        wrong = ""
        if num_tokens != len(seq.tokens):
            wrong = f"the runner says it holds {num_tokens} tokens"
        elif not sampled and (step.token_ids and not step.new_sequence):
            wrong = "a decode step sampled no token"
        elif sampled:
            verdict = self.reference.judge(seq.tokens, token_id, logprob)
            self.report.checked_tokens += 1
            self.report.ties += verdict.tie
            wrong = verdict.wrong
        if wrong:
            self.report.wrong_tokens.append(f"{where}: {wrong}; hostile actions in the last "
                                            f"seconds: {self.report.recent()}")
            self.doomed.add(step.seq_id)

    async def failed(self, steps: list[SeqStep], release: list[int], exc: PagedKVError) -> None:
        """A full pool changed nothing: release the longest sequence. Anything else failed a
        valid step: a finding; release what the step named."""
        self.report.honest_failures[exc.code.name] += 1
        if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            if self.live:
                longest = max(self.live, key=lambda i: len(self.live[i].tokens))
                self.doomed.add(longest)
            return
        text = (f"seed {self.report.seed} {self.name} step {self.step_no}: {exc.code.name} "
                f"{exc.message[:200]}; hostile actions in the last seconds: "
                f"{self.report.recent()}")
        if exc.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            self.report.internal_errors.append(text)
        self.report.honest_findings.append(text)
        named = [s.seq_id for s in steps] + release
        with contextlib.suppress(PagedKVError):
            await self.release(named)
        for seq_id in named:
            self.live.pop(seq_id, None)
            self.doomed.discard(seq_id)

    async def release(self, seq_ids: list[int]) -> None:
        """Free sequences through the runner (it commits what it computed), else directly."""
        if not seq_ids:
            return
        try:
            await self.runner.step(self.session, [], seq_ids)
        except PagedKVError:
            for seq_id in seq_ids:
                with contextlib.suppress(PagedKVError):
                    await self.session.free(seq_id)
        for seq_id in seq_ids:
            self.live.pop(seq_id, None)
