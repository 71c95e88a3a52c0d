"""Continuous batching: which sequences each step computes, which requests wait or are preempted.

Pure bookkeeping, no I/O: the engine asks for a `Plan` with the pool's free blocks from the
runner's latest answer (the daemon's figure, never a guess), sends it as one runner step, and
hands the answers back. Each step:
1. every running request's sequences are stepped together: decodes (one token each) first,
   then prefill chunks in admission order while `max_num_batched_tokens` lasts;
2. if those steps need more blocks than are free, the most recently admitted request is
   preempted instead (its sequences are freed by a release-only step; their committed prefix
   blocks stay cached, so recomputing them is cheap) and the plan is made again;
3. waiting requests are admitted in their line's turns (fair_queue.py: oldest first within a
   key, the key served longest ago first; preempted ones go back to the front of their key),
   while `max_num_seqs` and the token budget allow and the free blocks stay above the
   watermark.
Finished and dropped sequences are released with the next step (a step frees only after it
computes, so when the blocks are short a release-only step goes first).

On a contiguous daemon (PoolInfo.reservation_blocks) a sequence takes a whole reservation when
it is made (allocated, forked or re-admitted) and no block as it grows: no watermark is kept,
and a request is admitted only with a reservation for each sequence it runs at once, so its
forks do not push out the requests admitted after it.

A new sequence without a parent (a first admission, or a re-admission after preemption) says
whether the daemon restores its prefix from its host tier or it is recomputed: the rule of
swap_rule.py, as `SchedulerConfig.swap` sets it.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedkv.client.engine.fair_queue import FairQueue, Line
from pagedkv.client.engine.requests import Request
from pagedkv.client.engine.sequences import Seq
from pagedkv.client.engine.swap_rule import SWAP_MODES, HostTier, SwapRule
from pagedkv.client.pool.runner_client import SeqStep
from pagedkv.client.pool.step_outputs import SeqOutput


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one client's batch and requests (vLLM's names and defaults where they exist)."""

    # Most sequences stepped together.
    max_num_seqs: int = 256
    # Most tokens computed per step (decodes count one each); longer prompts are chunked.
    max_num_batched_tokens: int = 2048
    # Fraction of the pool's blocks kept free when admitting, for running sequences to grow.
    watermark: float = 0.01
    # Let the runner compute a sequence's next decode step before this client sends it
    # (runner.proto's decode_ahead): sampled sequences, not beams, whose token the next step
    # appends as sampled.
    decode_ahead: bool = True
    # Let the runner go on stepping those sequences by itself and push each answer, while this
    # client's plan is that same step (runner.proto's `follow`; steps on a stream only).
    follow: bool = True
    # Swap or recompute a new sequence's prefix that the daemon's host tier holds (a request
    # re-admitted after preemption, a prompt's prefix): "auto" by the cost rule of
    # swap_rule.py, "always" restore, "never" recompute.
    swap: str = "auto"
    # The most tokens a sequence may hold (vLLM's max_model_len), at most the runner's model's
    # positions; 0: the model's.
    max_model_len: int = 0
    # The seed of each request that brings none (derived per request: requests.request_seed);
    # None: those draw from the runner's shared generator.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_seqs} and {self.max_num_batched_tokens}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.swap not in SWAP_MODES:
            raise ValueError(f"swap must be one of {', '.join(SWAP_MODES)}, got {self.swap!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")


@dataclass
class Plan:
    """One runner step, or a preemption to carry out first."""

    # The sequences to step, what to send for each and the request of each, in the same order.
    seqs: list[Seq] = field(default_factory=list)
    steps: list[SeqStep] = field(default_factory=list)
    owners: list[Request] = field(default_factory=list)
    # Sequences to free after the step (finished, dropped or preempted).
    release: list[int] = field(default_factory=list)
    # Requests to preempt (a release-only step), then plan again.
    preempt: list[Request] = field(default_factory=list)
    # Requests admitted by this plan (running once the step succeeds).
    admit: list[Request] = field(default_factory=list)
    # Blocks the steps may take (an upper bound).
    blocks: int = 0


class Scheduler:
    """The waiting and running requests of one client."""

    def __init__(self, config: SchedulerConfig, block_size: int, num_blocks: int,
                 reservation_blocks: int = 0, host_tier: HostTier | None = None,
                 waiting: Line | None = None) -> None:
        self.config = config
        self.block_size = block_size
        # Whether new sequences restore their prefix from the daemon's host tier (none: no
        # tier); the engine feeds it its prefill rate.
        self.swap = SwapRule(config.swap, host_tier or HostTier(), block_size)
        # Blocks a contiguous daemon reserves per sequence (PoolInfo); 0 when paged.
        self.reservation_blocks = reservation_blocks
        # Reservations never grow: nothing to keep back for them.
        self.watermark_blocks = 0 if reservation_blocks else int(config.watermark * num_blocks)
        # Its waiting requests, in the turns of a queue it may share with other engines (none
        # given: a queue of its own, first in first out when every request has the same key).
        self.waiting = waiting if waiting is not None else FairQueue().line()
        # In admission order: the last is the first to be preempted.
        self.running: list[Request] = []
        # Sequence ids to free with the next step, each once (`_release_later`).
        self.to_release: list[int] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.to_release)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    # ------------------------------------------------------------------ planning

    def abort(self, request: Request) -> None:
        """Drop `request` at the next plan (its sequences are released with that step): its
        caller went away. Safe while a step carrying it is in flight."""
        request.aborted = True

    def drop(self, request: Request) -> None:
        """Forget `request` (it failed, or its caller went away). A waiting request holds
        nothing; any other has every one of its sequences released with the next step: after a
        lost answer (UNAVAILABLE, DEADLINE_EXCEEDED) the step may have allocated more than it
        knows, and the runner ignores frees of sequences that do not exist."""
        if request in self.waiting:
            self.waiting.remove(request)
            return
        if request in self.running:
            self.running.remove(request)
        self.waiting.left(request)  # admitted, maybe by a step that got no answer
        self._release_later(seq.seq_id for seq in request.seqs)

    def _release_later(self, seq_ids: Iterable[int]) -> None:
        """Queue sequences for the next step's release, each once: a request dropped while the
        runner follows it still gets the pushes it had not read, and the one finishing it
        names its sequence again (a release naming one twice is refused whole)."""
        queued = set(self.to_release)
        for seq_id in seq_ids:
            if seq_id not in queued:
                queued.add(seq_id)
                self.to_release.append(seq_id)

    def _drop_aborted(self) -> None:
        for request in [r for r in (*self.waiting, *self.running) if r.aborted]:
            self.drop(request)

    def plan(self, free_blocks: int) -> Plan:
        self._drop_aborted()
        plan = Plan(release=list(self.to_release))
        budget = self.config.max_num_batched_tokens
        for request in self.running:
            budget = self._add_request(plan, request, budget)
        if plan.blocks > free_blocks:
            if plan.release:  # a step frees only after it computes: free them first
                return Plan(release=plan.release)
            if len(self.running) > 1:
                return Plan(preempt=[self.running[-1]])
            return plan  # one request alone: the daemon's answer decides
        self._admit(plan, free_blocks, budget)
        return plan

    def _add_request(self, plan: Plan, request: Request, budget: int) -> int:
        """Add a request's sequences to the plan; return the token budget left."""
        ready = [seq for seq in request.seqs if seq.finish_reason is None and seq.ready()]
        forked_from = {id(seq.parent) for seq in ready if seq.parent is not None}
        # A parent that samples fork from in a later step must hold then what it holds now: no
        # token appended ahead. A beam's next token is chosen by the search, not sampled.
        ahead = self.config.decode_ahead and request.beam is None
        for seq in ready:
            chunk = 0
            if seq.is_prefilling:
                if budget <= 0:
                    continue  # its prefill goes on next step
                chunk = min(budget, seq.prompt_tokens_left())
                budget -= chunk
            else:
                budget -= 1
            plan.seqs.append(seq)
            skip = seq.allocates() and self.swap.skip_host_tier()
            plan.steps.append(seq.step(chunk, ahead and not request.forks_later(seq, ready),
                                       skip_host_tier=skip))
            plan.owners.append(request)
            plan.blocks += seq.blocks_needed(self.block_size, id(seq) in forked_from,
                                             self.reservation_blocks)
        return budget

    def _admit(self, plan: Plan, free_blocks: int, budget: int) -> None:
        num_seqs = self.num_running_seqs
        # Contiguous: the reservations that requests admitted by this plan take next step, when
        # their samples or beams fork from the computed prompt.
        forks_ahead = 0
        while budget > 0 and (request := self.waiting.head()) is not None:
            size = _width(request)
            if num_seqs + size > self.config.max_num_seqs and (num_seqs or plan.admit):
                return
            need = self.blocks_to_admit(request)
            if plan.blocks + forks_ahead + need + self.watermark_blocks > free_blocks:
                return
            self.waiting.popleft()
            plan.admit.append(request)
            num_seqs += size
            if self.reservation_blocks:
                forks_ahead += need - self.reservation_blocks * len(request.seqs)
            budget = self._add_request(plan, request, budget)

    def blocks_to_admit(self, request: Request) -> int:
        """An upper bound on the blocks admitting `request` takes (its prompt, or after a
        preemption every token of each of its sequences). Contiguous: a reservation for each
        sequence it runs at once, forks to come included (a paged fork shares its blocks)."""
        if self.reservation_blocks:
            return _width(request) * self.reservation_blocks
        return sum(seq.blocks_needed(self.block_size, False) for seq in request.seqs)

    # ------------------------------------------------------------------ outcomes

    def preempted(self, plan: Plan) -> None:
        """The plan's preemption was carried out: requeue its requests first in line."""
        for request in plan.preempt:
            self.running.remove(request)
            self.waiting.appendleft(request)
            self.num_preemptions += 1

    def preempt_ids(self, plan: Plan) -> list[int]:
        """The sequences a preemption plan frees (and marks them freed)."""
        return [seq_id for request in plan.preempt for seq_id in request.preempt()]

    def unadmit(self, plan: Plan) -> None:
        """The plan's step failed (nothing changed): its admissions wait again, in order."""
        for request in reversed(plan.admit):
            self.waiting.appendleft(request)

    def release_sent(self, plan: Plan) -> None:
        """The plan's step was answered, or failed for a reason a retry would not cure (its
        session gone, whose sequences went with it): its releases are not sent again."""
        released = set(plan.release)
        self.to_release = [i for i in self.to_release if i not in released]

    def update(self, plan: Plan, outputs: Sequence[SeqOutput]) -> list[Request]:
        """Apply a step's answers; return the requests that made progress (finished ones are
        no longer running)."""
        self.release_sent(plan)
        self.running.extend(plan.admit)
        # Each request's answers, requests in the order of their first sequence in the plan.
        by_request: dict[int, tuple[Request, list[tuple[Seq, SeqOutput]]]] = {}
        for request, seq, out in zip(plan.owners, plan.seqs, outputs, strict=True):
            entry = by_request.get(id(request))
            if entry is None:
                by_request[id(request)] = (request, [(seq, out)])
            else:
                entry[1].append((seq, out))
        for request, results in by_request.values():
            self._release_later(request.on_outputs(results))
        progressed = [request for request, _ in by_request.values()]
        for request in [r for r in self.running if r.finished]:
            self.running.remove(request)
            self.waiting.left(request)
        return progressed


def _width(request: Request) -> int:
    """The sequences `request` runs at once: its samples (best_of of them), beams or live
    sequences, whichever is most."""
    return max(request.params.num_samples, request.params.beam_width, len(request.seqs))
