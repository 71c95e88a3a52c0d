"""A request and its sequences: what each kind of request does with a step's outputs.

- Plain and parallel sampling (`n`, `best_of`): sample 0 computes the prompt; on the next step
  the other samples fork from it in the runner (sharing every block) and each recomputes the
  last prompt position, writing nothing, to sample a first token of its own. Each sample has
  its own seed (derived from the request's), so seeded requests are reproducible. With
  best_of > n, the n samples with the highest cumulative logprob are returned.
- Beam search: each step `BeamSearch` picks beam_width (parent, token) continuations; a parent
  continued once keeps its sequence, one continued k times is forked k - 1 times on the next
  step, and one not continued is released.

A request's sequences are always stepped together (a fork needs its parent exactly as it was
before the step), and preempted together.
"""

import hashlib
import time
from collections.abc import Callable, Sequence

from pagedkv.client.engine.beam_search import BeamParams, BeamResult, BeamSearch
from pagedkv.client.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from pagedkv.client.engine.sequences import Seq
from pagedkv.client.pool.sampling_params import MAX_SEED, SamplingParams
from pagedkv.client.pool.step_outputs import SeqOutput


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: the request's for sample 0, a hash of (seed, index) for the rest
    (n samples with one seed must differ, and stay reproducible)."""
    if seed is None or index == 0:
        return seed
    return _seed_of(f"{seed}:{index}")


def request_seed(seed: int, number: int) -> int:
    """The seed of an engine's `number`th request that brings none, under the engine's default
    `seed` (vLLM's --seed): each request its own, reproducible from run to run."""
    return _seed_of(f"request:{seed}:{number}")


def _seed_of(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (MAX_SEED + 1)


class Request:
    """One request: its prompt, its sequences, and its outputs."""

    def __init__(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                 new_seq_id: Callable[[], int], eos_token_ids: Sequence[int] = (),
                 key: str = "", client_request_id: str = "") -> None:
        # The engine's name of the request: unique among its running requests.
        self.request_id = request_id
        # The id of the client's request it serves (an HTTP X-Request-Id; several engine
        # requests may share one), sent with each sequence's first step: the runner and the
        # daemon log it (runner.proto's SequenceStep.request_id). "" = none.
        self.client_request_id = client_request_id
        # Whose request it is (fair_queue.py: waiting requests take turns by key).
        self.key = key
        self.prompt = tuple(prompt)
        self.params = params
        self._new_seq_id = new_seq_id
        # Stop tokens: the request's and the model's end-of-sequence ids (unless ignore_eos).
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.stop_ids = tuple(dict.fromkeys((*params.stop_token_ids, *eos)))
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Its caller went away (a cancelled generate, a stream left early): free it.
        self.aborted = False
        # Every sequence still to step, in output order (beams: BeamSearch's order).
        self.live: list[Seq] = []
        # Sequences done generating (plain and parallel sampling).
        self.done_seqs: list[Seq] = []
        self.beam: BeamSearch | None = None
        # Beam search: each live beam's top-K once it sampled; a step of the search needs all
        # of them (after a preemption the beams finish recomputing in different steps).
        self._tops: dict[int, list[tuple[int, float]]] = {}
        # Delta outputs (`output(delta=True)`): per sample index, the generated tokens already
        # handed out.
        self._shown: dict[int, int] = {}
        if params.beam_width:
            self.beam = BeamSearch(BeamParams(
                beam_width=params.beam_width, max_tokens=params.max_tokens,
                eos_token_ids=self.stop_ids, length_penalty=params.length_penalty,
                early_stopping=params.early_stopping, num_return=params.n))
        self.live.append(self._seq(list(self.prompt), 0))

    # ------------------------------------------------------------------ sequences

    def _seq(self, tokens: list[int], index: int, parent: Seq | None = None) -> Seq:
        p = self.params
        if self.beam is not None:  # the runner reports each beam's top-K; nothing stops it
            params = SamplingParams(temperature=0.0, logprobs=self.beam.candidates_per_beam,
                                    max_tokens=p.max_tokens + 1)
        else:
            params = SamplingParams(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, seed=sample_seed(p.seed, index),
                stop_token_ids=self.stop_ids, max_tokens=p.max_tokens, logprobs=p.logprobs or 0,
                min_tokens=p.min_tokens, structured_outputs=p.structured_outputs)
        return Seq(self._new_seq_id(), tokens, len(self.prompt), params, index,
                   self.client_request_id, parent=parent)

    @property
    def seqs(self) -> list[Seq]:
        return self.live

    @property
    def finished(self) -> bool:
        return not self.live

    def forks_later(self, seq: Seq, ready: Sequence[Seq]) -> bool:
        """Whether sequences fork from `seq` after the step of the `ready` ones: the other
        parallel samples once sample 0's prefill sampled, or children not ready yet."""
        if seq.index == 0 and seq.num_generated == 0 and self.params.num_samples > 1:
            return True
        return any(other.parent is seq and other not in ready for other in self.live)

    # ------------------------------------------------------------------ outputs of a step

    def on_outputs(self, results: Sequence[tuple[Seq, SeqOutput]]) -> list[int]:
        """Apply a step's answers about this request's sequences; return the seq ids to release
        (finished or dropped sequences)."""
        for seq, out in results:
            seq.stepped(out)
            if seq.index == 0 and self.num_cached_tokens == 0 and self.num_preemptions == 0:
                self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached)
        sampled = [(seq, out) for seq, out in results if out.sampled]
        if sampled and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if self.beam is not None:
            return self._beam_step(sampled) if sampled else []
        return self._sample_step(sampled)

    def _sample_step(self, sampled: Sequence[tuple[Seq, SeqOutput]]) -> list[int]:
        for seq, out in sampled:
            if seq.index == 0 and seq.num_generated == 0 and self.params.num_samples > 1:
                # Sample 0's prefill is done: the other samples fork from it next step.
                self.live.extend(self._seq(list(seq.tokens), index, parent=seq)
                                 for index in range(1, self.params.num_samples))
            seq.record(out, self._finish_reason(seq, out))
        release = []
        for seq in [s for s in self.live if s.finish_reason is not None]:
            if any(other.parent is seq for other in self.live):
                continue  # its samples fork from it first
            self.live.remove(seq)
            self.done_seqs.append(seq)
            release.append(seq.seq_id)
        return release

    def _finish_reason(self, seq: Seq, out: SeqOutput) -> FinishReason | None:
        if out.token_id in self.stop_ids or out.constraint_ended:
            return "stop"  # constraint_ended: the structured output is complete
        if seq.num_generated + 1 >= self.params.max_tokens or out.finished:
            return "length"  # out.finished: max_tokens, or the model's context is full
        return None

    def _beam_step(self, sampled: Sequence[tuple[Seq, SeqOutput]]) -> list[int]:
        beam = self.beam
        assert beam is not None
        for seq, out in sampled:
            self._tops[seq.seq_id] = list(zip(out.top_token_ids, out.top_logprobs, strict=True))
        if len(self._tops) < len(self.live):
            return []  # re-admitted beams still computing: wait for every beam
        parents = beam.step([self._tops[seq.seq_id] for seq in self.live])
        self._tops.clear()
        old = self.live
        if beam.done:
            self.live = []
            return [seq.seq_id for seq in old if seq.allocated]
        kept: set[int] = set()
        live: list[Seq] = []
        for index, (parent, hypothesis) in enumerate(zip(parents, beam.beams, strict=True)):
            tokens = [*self.prompt, *hypothesis.tokens]
            source = old[parent]
            if parent not in kept:
                kept.add(parent)
                source.tokens = tokens
                source.index = index
                live.append(source)
            else:
                live.append(self._seq(tokens, index, parent=source))
        self.live = live
        return [seq.seq_id for i, seq in enumerate(old) if i not in kept and seq.allocated]

    # ------------------------------------------------------------------ preemption

    def preempt(self) -> list[int]:
        """Free every sequence (the caller releases the returned ids); each is re-admitted
        later from its tokens."""
        held = [seq.seq_id for seq in self.live if seq.allocated]
        for seq in self.live:
            seq.preempted()
        self.num_preemptions += 1
        return held

    # ------------------------------------------------------------------ the answer

    def output(self, delta: bool = False) -> RequestOutput:
        """Its outputs now: every token so far, or with `delta` only those generated since its
        last delta output (their logprobs alike; cumulative_logprob and the request's counts
        stay totals). Delta outputs suit plain and parallel sampling only: beam search and
        best_of > n choose their outputs at the end (the engine refuses them)."""
        if self.beam is not None and self.finished:
            outputs = [self._beam_output(i, r) for i, r in enumerate(self.beam.results())]
            generated = sum(len(o.token_ids) for o in outputs)
        else:
            seqs = self._output_seqs()
            outputs = [self._sample_output(i, seq, delta) for i, seq in enumerate(seqs)]
            generated = sum(seq.num_generated for seq in seqs)
        metrics = {}
        if self.first_token_at is not None:
            metrics["time_to_first_token_s"] = self.first_token_at - self.arrival
        return RequestOutput(self.request_id, self.prompt, outputs, self.finished,
                             len(self.prompt), self.num_cached_tokens, generated,
                             self.num_preemptions, metrics=metrics)

    def _beam_output(self, index: int, result: BeamResult) -> CompletionOutput:
        # The score is sum(logprobs) / len ** length_penalty: undo the division.
        total = result.score * len(result.tokens) ** self.params.length_penalty
        reason: FinishReason = "stop" if result.tokens and result.tokens[-1] in self.stop_ids \
            else "length"
        return CompletionOutput(index, result.tokens, total, None, None, reason, result.score)

    def _output_seqs(self) -> list[Seq]:
        """The sequences the outputs show, in output order: the samples (a child not forked
        yet has nothing to show), at the end the n most likely of best_of."""
        seqs = sorted(self.done_seqs + [s for s in self.live if s.parent is None],
                      key=lambda s: s.index)
        if self.finished and self.params.num_samples > self.params.n:
            seqs = sorted(seqs, key=lambda s: -sum(s.logprobs))[:self.params.n]
        return seqs

    def _sample_output(self, index: int, seq: Seq, delta: bool) -> CompletionOutput:
        """Output `index` of `seq`: its generated tokens, or with `delta` those not shown yet."""
        start = self._shown.get(seq.index, 0) if delta else 0
        if delta:
            self._shown[seq.index] = seq.num_generated
        logprobs = tuple(seq.logprobs[start:]) if self.params.logprobs is not None else None
        tops = tuple(seq.top_logprobs[start:]) if self.params.logprobs else None
        return CompletionOutput(index, tuple(seq.tokens[seq.prompt_len + start:]),
                                sum(seq.logprobs), logprobs, tops, seq.finish_reason)
