"""Beam search by the rules of transformers' `generate(num_beams=k, do_sample=False)`, torch-free.

A scheduler drives it: each step it sends every live beam (`BeamSearch.beams`) to the model
runner, which returns each beam's `candidates_per_beam` most likely next tokens with their
logprobs (float32 log_softmax of the raw logits); `step()` picks the (parent, token)
continuations, and the scheduler forks and frees sequences to match the new beams.

The rules, as in transformers 5.x `GenerationMixin._beam_search` and its helpers:

- Start: HF runs `num_beams` copies of the prompt, all but the first scored -1e9 so that only the
  first one's tokens are candidates. Here the search starts with the one beam; the same candidates
  win as long as the vocabulary holds at least `candidates_per_beam` tokens.
- Scores: a beam's score is the sum of its tokens' logprobs, added in float32
  (`log_probs + running_beam_scores`); every sum here is rounded to float32 the same way, so near
  ties resolve as HF's do. A finished hypothesis scores `sum / generated_length ** length_penalty`
  (`_update_finished_beams`, `cur_len + 1 - decoder_prompt_len`: the generated tokens, the EOS
  included), the power taken in float64 and the division in float32, as torch does on the CPU
  (CUDA multiplies by the reciprocal instead, which can differ in the last bit).
- Candidates (`_get_top_k_continuations`): HF takes the top `max(2, 1 + n_eos) * num_beams` of
  all beams' accumulated scores, best first. Only two parts of that list matter: its first
  `num_beams` (the only ones that may finish) and its first `num_beams` non-EOS entries (the next
  live beams). Above any of those in its own beam's list rank at most `num_beams - 1` others of
  them and the `n_eos` EOS tokens, so the runner need send only the `num_beams + n_eos` best
  tokens per beam (`candidates_per_beam`). torch.topk orders exact ties unspecifiedly (libstdc++
  partial_sort/nth_element); here ties go to the lower parent index, then the lower token id.
- Finishing (`_update_finished_beams`): a candidate whose token is an EOS, or any candidate at the
  last step (`max_tokens` generated: HF's `MaxLengthCriteria`), becomes a finished hypothesis only
  if it ranks among the first `num_beams` candidates; the others are dropped. The finished
  hypotheses are pooled, and the `num_beams` best kept.
- Next beams (`_get_running_beams_for_next_iteration`): the first `num_beams` candidates that did
  not finish, in candidate order.
- Stopping (`_check_early_stop_heuristic`, `_beam_search_has_unfinished_sequences`): after the
  last step; or, once `num_beams` hypotheses have finished, when `early_stopping is True`, or when
  the best live beam's score divided by `length ** length_penalty` is not above the worst finished
  score, with `length` the live beams' generated length, or `max_tokens` if
  `early_stopping == "never"` and `length_penalty > 0`.
- Results: the `num_return` best finished hypotheses, best first (`sequences_scores`).
- One beam: `generate` runs greedy search (`_sample`, argmax of the logits) instead, which stops at
  the first EOS. That is beam search with one beam that stops as soon as it has one finished
  hypothesis, i.e. `early_stopping=True`, which this class then uses whatever was asked. (argmax of
  the logprobs and of the logits differ only where float32 rounding turns two logits into one
  logprob.)
"""

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pagedkv.client.pool.checks import check_float, check_int, token_ids

EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True, slots=True)
class BeamParams:
    """One beam search's parameters (HF's names in brackets); validated on construction
    (ValueError)."""

    # Live beams kept each step, >= 1 [num_beams].
    beam_width: int
    # Most tokens to generate, >= 1 [max_new_tokens].
    max_tokens: int
    # Tokens that finish a hypothesis (the EOS is part of its tokens); may be empty
    # [eos_token_id].
    eos_token_ids: tuple[int, ...] = ()
    # Exponent of the generated length that divides a finished hypothesis' summed logprobs; > 0
    # favours longer hypotheses, < 0 shorter ones [length_penalty].
    length_penalty: float = 1.0
    # True: stop as soon as beam_width hypotheses have finished; False: stop once they have and
    # the best live beam, scored at its current length, cannot beat the worst of them; "never":
    # as False, but the live beam is scored at max_tokens when length_penalty > 0
    # [early_stopping].
    early_stopping: EarlyStopping = False
    # Hypotheses returned, 1 <= num_return <= beam_width [num_return_sequences].
    num_return: int = 1

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        eos_token_ids = token_ids("eos_token_ids", self.eos_token_ids)
        if len(set(eos_token_ids)) != len(eos_token_ids):
            raise ValueError(f"eos_token_ids has duplicates: {eos_token_ids}")
        object.__setattr__(self, "eos_token_ids", eos_token_ids)
        check_float("length_penalty", self.length_penalty)
        object.__setattr__(self, "length_penalty", float(self.length_penalty))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        check_int("num_return", self.num_return)
        if not 1 <= self.num_return <= self.beam_width:
            raise ValueError(
                f"num_return must be in [1, beam_width={self.beam_width}], got {self.num_return}")


@dataclass(frozen=True, slots=True)
class Beam:
    """A live beam."""

    # Generated tokens so far (the prompt excluded).
    tokens: tuple[int, ...]
    # Sum of the tokens' logprobs, added in float32 (a float32 value), no length penalty.
    score: float


@dataclass(frozen=True, slots=True)
class BeamResult:
    """A finished hypothesis."""

    # Generated tokens, the EOS that finished it included (none if it ran to max_tokens).
    tokens: tuple[int, ...]
    # Summed logprobs / len(tokens) ** length_penalty, in float32 [sequences_scores].
    score: float


class BeamSearch:
    """One prompt's beam search: `step()` until `done`, then `results()`."""

    def __init__(self, params: BeamParams) -> None:
        self.params = params
        # One beam runs greedy search in HF's generate (module docstring).
        self._stop_when_full = params.early_stopping is True or params.beam_width == 1
        self._eos = frozenset(params.eos_token_ids)
        # Live beams, best first; empty once done.
        self._beams = [Beam(tokens=(), score=0.0)]
        # Finished hypotheses, best first, at most beam_width.
        self._finished: list[BeamResult] = []
        self._generated = 0
        self._done = False

    @property
    def candidates_per_beam(self) -> int:
        """K: how many of its most likely (token, logprob) pairs `step()` needs per beam."""
        return self.params.beam_width + len(self.params.eos_token_ids)

    @property
    def beams(self) -> list[Beam]:
        """The live beams, in the order `step()` wants their candidates; empty once done."""
        return list(self._beams)

    @property
    def done(self) -> bool:
        """Whether the search has finished (then `results()` holds the answer)."""
        return self._done

    def step(self, tops: Sequence[Sequence[tuple[int, float]]]) -> list[int]:
        """Advance one token. `tops[i]`: `beams[i]`'s `candidates_per_beam` most likely
        (token, logprob) pairs, in any order. Returns, for each new live beam in order, the index
        of its parent in the previous `beams`; empty once the search is done."""
        if self._done:
            raise RuntimeError("step() after the beam search is done")
        self._check_tops(tops)
        width = self.params.beam_width
        self._generated += 1
        last = self._generated == self.params.max_tokens
        # Power in float64 (Python's int ** float), then the float32 division, as in HF.
        length_divisor = _f32(self._generated**self.params.length_penalty)
        candidates = sorted(
            (
                (_f32(beam.score + _f32(logprob)), parent, token)
                for parent, (beam, top) in enumerate(zip(self._beams, tops, strict=True))
                for token, logprob in top
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )
        beams: list[Beam] = []
        parents: list[int] = []
        finished: list[BeamResult] = []
        for rank, (score, parent, token) in enumerate(candidates):
            # Past the first beam_width, only live beams are wanted, and none at the last step.
            if rank >= width and (last or len(beams) == width):
                break
            tokens = (*self._beams[parent].tokens, token)
            if last or token in self._eos:
                # Finishing candidates below the first beam_width are dropped.
                if rank < width:
                    finished.append(BeamResult(tokens, _f32(score / length_divisor)))
            elif len(beams) < width:
                beams.append(Beam(tokens, score))
                parents.append(parent)
        # The sort is stable: on equal scores, earlier hypotheses stay ahead.
        self._finished = sorted(self._finished + finished, key=lambda r: -r.score)[:width]
        # K = beam_width + n_eos candidates per beam leave beam_width that did not finish.
        assert last or len(beams) == width, f"{len(beams)} live beams out of {width}"
        if last or self._can_stop(beams[0].score):
            self._done = True
            self._beams = []
            return []
        self._beams = beams
        return parents

    def results(self) -> list[BeamResult]:
        """The `num_return` best finished hypotheses, best first."""
        if not self._done:
            raise RuntimeError("results() before the beam search is done")
        assert len(self._finished) == self.params.beam_width, "done with too few hypotheses"
        return self._finished[: self.params.num_return]

    def _can_stop(self, best_live_score: float) -> bool:
        """HF's stop test after a step that is not the last (`best_live_score`: the best new live
        beam's summed logprobs)."""
        if len(self._finished) < self.params.beam_width:
            return False
        if self._stop_when_full:
            return True
        lp = self.params.length_penalty
        # With a positive penalty a longer beam scores better: "never" assumes the longest.
        length = self._generated
        if self.params.early_stopping == "never" and lp > 0:
            length = self.params.max_tokens
        best_possible = _f32(best_live_score / _f32(length**lp))
        return not best_possible > self._finished[-1].score

    def _check_tops(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        if len(tops) != len(self._beams):
            raise ValueError(f"{len(tops)} candidate lists for {len(self._beams)} live beams")
        k = self.candidates_per_beam
        for i, top in enumerate(tops):
            if len({token for token, _ in top}) != len(top) or len(top) != k:
                raise ValueError(f"beam {i} needs {k} distinct candidate tokens, got {list(top)}")


def _f32(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float. (A float64 sum or quotient of
    two float32 values, rounded so, equals the float32 operation: float64 has enough bits.)"""
    try:
        rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range: torch's float32 gives an infinity
        return math.copysign(math.inf, value)
    return rounded

