"""client/engine/beam_search.py: hand-made steps with exact expected beams, and a reference driver
that feeds it a real (tiny, random) transformers model and compares with `model.generate`."""

import collections
import functools
import itertools
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.client.engine.beam_search import BeamParams, BeamResult, BeamSearch, EarlyStopping

# ---------------------------------------------------------------------------------------------
# Hand-made steps. Logprobs are multiples of 1/8 (exact in float32) unless a test says otherwise.


def _top(*pairs: tuple[int, float]) -> list[tuple[int, float]]:
    return list(pairs)


def test_first_step_forks_the_prompt_beam() -> None:
    search = BeamSearch(BeamParams(beam_width=3, max_tokens=5))
    # No EOS: K = beam_width.
    assert search.candidates_per_beam == 3
    assert [b.tokens for b in search.beams] == [()]
    parents = search.step([_top((7, -0.5), (3, -1.0), (9, -1.25))])
    assert parents == [0, 0, 0]
    assert [(b.tokens, b.score) for b in search.beams] == [
        ((7,), -0.5), ((3,), -1.0), ((9,), -1.25)]


def test_candidates_are_ranked_across_beams() -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=5))
    search.step([_top((1, -0.25), (2, -0.5))])
    # Beam 0 (score -0.25) and beam 1 (-0.5); the best two sums come from beam 1 and beam 0.
    parents = search.step([_top((3, -1.0), (4, -2.0)), _top((5, -0.125), (6, -3.0))])
    assert parents == [1, 0]
    assert [(b.tokens, b.score) for b in search.beams] == [((2, 5), -0.625), ((1, 3), -1.25)]


def test_ties_go_to_the_lower_parent_then_the_lower_token() -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=5))
    search.step([_top((1, -1.0), (2, -1.0))])
    # Listed most likely first with token 8 before 4 in beam 1: the order given does not matter.
    parents = search.step([_top((3, -2.0), (4, -3.0)), _top((8, -1.0), (4, -1.0))])
    assert parents == [1, 1]
    assert [b.tokens for b in search.beams] == [(2, 4), (2, 8)]


def test_sums_are_rounded_to_float32() -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=5))
    search.step([_top((1, -1.0), (2, -1.0))])
    # float32 has 24 bits: -1 - 2**-24 and -1 - 2**-25 both round to -1.0, so the two sums tie
    # and the lower parent goes first; float64 sums would put beam 1's candidate first.
    parents = search.step([_top((3, -(2**-24)), (4, -9.0)), _top((5, -(2**-25)), (6, -9.0))])
    assert parents == [0, 1]
    assert [(b.tokens, b.score) for b in search.beams] == [((1, 3), -1.0), ((2, 5), -1.0)]


def test_eos_within_the_top_beam_width_finishes_the_others_are_dropped() -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=3, eos_token_ids=(0,),
                                   length_penalty=0.0, num_return=2))
    # K = beam_width + one EOS.
    assert search.candidates_per_beam == 3
    search.step([_top((1, -0.5), (2, -1.0), (3, -4.0))])
    # Candidates, best first: (beam 0, EOS) -0.75 finishes (rank 0); (1, 4) -1.0 and (0, 5) -1.5
    # live on; (beam 1, EOS) -1.75 ranks 3rd, beyond beam_width: dropped.
    parents = search.step([_top((0, -0.25), (5, -1.0), (6, -5.0)),
                           _top((4, 0.0), (0, -0.75), (7, -3.0))])
    assert parents == [1, 0]
    assert [b.tokens for b in search.beams] == [(2, 4), (1, 5)]
    assert not search.done
    # Last step: the top two finish at -4 and -4.5. Had the dropped EOS counted, (2, 0) at -1.75
    # would be second.
    search.step([_top((8, -3.0), (0, -8.0), (9, -9.0)), _top((8, -3.0), (0, -8.0), (9, -9.0))])
    assert search.results() == [BeamResult((1, 0), -0.75), BeamResult((2, 4, 8), -4.0)]


def test_last_step_finishes_the_top_beam_width_candidates() -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=2, num_return=2))
    search.step([_top((1, -0.5), (2, -1.0))])
    parents = search.step([_top((3, -1.0), (4, -2.0)), _top((5, -0.25), (6, -3.0))])
    assert parents == []
    assert search.done and search.beams == []
    # Sums -1.25 and -1.5 divided by the length, 2 (length_penalty 1).
    assert search.results() == [BeamResult((2, 5), -0.625), BeamResult((1, 3), -0.75)]


def test_length_penalty_divides_by_the_generated_length_eos_included() -> None:
    search = BeamSearch(BeamParams(beam_width=1, max_tokens=3, eos_token_ids=(0,),
                                   length_penalty=2.0))
    search.step([_top((1, -1.0), (0, -3.0))])
    search.step([_top((0, -1.0), (2, -3.0))])
    assert search.done
    # (-1 - 1) / 2 ** 2.
    assert search.results() == [BeamResult((1, 0), -0.5)]


def test_results_are_the_best_num_return_finished() -> None:
    search = BeamSearch(BeamParams(beam_width=3, max_tokens=2, eos_token_ids=(0,), num_return=2,
                                   length_penalty=0.0))
    search.step([_top((0, -1.0), (1, -2.0), (2, -3.0), (3, -4.0))])
    # Finished: (0,) at -1. Live: (1,) -2, (2,) -3, (3,) -4. Last step: the top three, (1, 5)
    # -2.5, (2, 6) -3.5 and (3, 7) -4.5, finish; the best three of the four are kept.
    search.step([_top((5, -0.5), (0, -9.0), (8, -9.0), (9, -9.0)),
                 _top((6, -0.5), (0, -9.0), (8, -9.0), (9, -9.0)),
                 _top((7, -0.5), (0, -9.0), (8, -9.0), (9, -9.0))])
    assert search.results() == [BeamResult((0,), -1.0), BeamResult((1, 5), -2.5)]


@pytest.mark.parametrize(("early_stopping", "done"), [(True, True), (False, False)])
def test_early_stopping_true_stops_once_beam_width_finished(
        early_stopping: EarlyStopping, done: bool) -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=4, eos_token_ids=(0,),
                                   early_stopping=early_stopping))
    search.step([_top((0, -1.0), (1, -1.0), (2, -4.0))])
    assert not search.done
    # Both finished slots are full: (0,) at -1 and (1, 0) at -2.5 / 2. The best live beam, (1, 2)
    # at -1.5 / 2, still beats the worst: only True stops.
    search.step([_top((0, -1.5), (2, -0.5), (3, -3.0)), _top((5, -4.0), (6, -5.0), (0, -6.0))])
    assert search.done == done
    if done:
        assert search.results() == [BeamResult((0,), -1.0)]


@pytest.mark.parametrize(
    ("early_stopping", "length_penalty", "done"),
    [(False, 1.0, True), ("never", 1.0, False), (False, 0.0, True), ("never", 0.0, True)],
)
def test_early_stopping_false_and_never(
        early_stopping: EarlyStopping, length_penalty: float, done: bool) -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=4, eos_token_ids=(0,),
                                   length_penalty=length_penalty, early_stopping=early_stopping))
    search.step([_top((0, -1.0), (1, -2.0), (2, -3.0))])
    # Finished: (0,) at -1 and (1, 0) at -2.5 / 2 ** length_penalty; (2, 0) ranks 3rd, dropped.
    # The best live beam, (1, 3) at -3, cannot beat the worst at the current length 2 (-1.5 vs
    # -1.25; -3 vs -2.5 without a penalty). "never" with length_penalty > 0 divides by
    # max_tokens = 4 instead: -0.75 beats -1.25, so it goes on; with length_penalty <= 0 it is
    # False.
    search.step([_top((0, -0.5), (3, -1.0), (4, -5.0)), _top((0, -1.0), (5, -8.0), (6, -9.0))])
    assert [b.tokens for b in search.beams] == ([] if done else [(1, 3), (1, 4)])
    assert search.done == done


def test_one_beam_is_greedy_and_stops_at_its_first_eos() -> None:
    search = BeamSearch(BeamParams(beam_width=1, max_tokens=4, eos_token_ids=(0,),
                                   early_stopping="never", length_penalty=2.0))
    search.step([_top((1, -0.5), (0, -1.0))])
    assert search.step([_top((0, -0.5), (2, -0.75))]) == []
    assert search.done
    assert search.results() == [BeamResult((1, 0), -0.25)]


def test_misuse_is_refused() -> None:
    search = BeamSearch(BeamParams(beam_width=2, max_tokens=1, eos_token_ids=(0,)))
    with pytest.raises(RuntimeError, match="before the beam search is done"):
        search.results()
    with pytest.raises(ValueError, match="2 candidate lists for 1 live beams"):
        search.step([_top((1, -1.0), (2, -2.0), (3, -3.0))] * 2)
    with pytest.raises(ValueError, match="beam 0 needs 3 distinct candidate tokens"):
        search.step([_top((1, -1.0), (2, -2.0))])
    with pytest.raises(ValueError, match="distinct"):
        search.step([_top((1, -1.0), (1, -2.0), (3, -3.0))])
    search.step([_top((1, -1.0), (2, -2.0), (3, -3.0))])
    with pytest.raises(RuntimeError, match="after the beam search is done"):
        search.step([])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 0}, "beam_width must be >= 1"),
        ({"beam_width": True}, "beam_width must be an int"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 2.0}, "max_tokens must be an int"),
        ({"eos_token_ids": (-1,)}, "eos_token_ids must be >= 0"),
        ({"eos_token_ids": (2, 2)}, "eos_token_ids has duplicates"),
        ({"length_penalty": float("nan")}, "length_penalty must be finite"),
        ({"length_penalty": float("inf")}, "length_penalty must be finite"),
        ({"early_stopping": "always"}, "early_stopping must be True, False or 'never'"),
        ({"early_stopping": 1}, "early_stopping must be True, False or 'never'"),
        ({"num_return": 0}, r"num_return must be in \[1, beam_width=2\]"),
        ({"num_return": 3}, r"num_return must be in \[1, beam_width=2\]"),
    ],
)
def test_params_are_validated(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"beam_width": 2, "max_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        BeamParams(**fields)  # type: ignore[arg-type]


def test_params_normalize_types() -> None:
    params = BeamParams(beam_width=2, max_tokens=4, eos_token_ids=[3, 1],  # type: ignore[arg-type]
                        length_penalty=2)
    assert params.eos_token_ids == (3, 1)
    assert isinstance(params.length_penalty, float)


def test_imports_neither_torch_nor_numpy() -> None:
    code = ("import sys; import pagedkv.client.engine.beam_search; "
            "assert not {'torch', 'numpy'} & set(sys.modules), 'torch or numpy was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Reference driver: a tiny random Llama, its log_softmax fed to BeamSearch, against generate().

VOCAB = 128
PAD = VOCAB - 1
MAX_NEW_TOKENS = 8
PROMPTS = ((5, 17, 99, 3), (42, 8, 8, 61, 23, 2, 90), (11,))
SEEDS = (0, 1)
LENGTH_PENALTIES = (1.0, 0.0, 2.0, -0.5)
EARLY_STOPPING: tuple[EarlyStopping, ...] = (True, False, "never")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """The model is tiny: a second thread buys nothing and contends on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, initializer_range=0.2,
                         attn_implementation="eager", torch_dtype=torch.float32)
    model = LlamaForCausalLM(config).eval()
    # Nothing but the search itself: no default EOS, and no logits processor (each one's "off"
    # value). The driver below also checks that generate's scores equal its own logprobs.
    gen = model.generation_config
    gen.eos_token_id = None
    gen.bos_token_id = None
    assert gen.repetition_penalty in (None, 1.0) and gen.no_repeat_ngram_size in (None, 0)
    assert gen.min_length in (None, 0) and gen.min_new_tokens is None
    assert gen.bad_words_ids is None and gen.suppress_tokens is None
    assert gen.begin_suppress_tokens is None and gen.sequence_bias is None
    assert gen.forced_bos_token_id is None and gen.forced_eos_token_id is None
    assert gen.exponential_decay_length_penalty is None and not gen.renormalize_logits
    return model


@dataclass(frozen=True)
class Case:
    seed: int
    prompt: tuple[int, ...]
    width: int
    length_penalty: float
    early_stopping: EarlyStopping
    # Index into _eos_choices: 0 = no EOS, 1 = one, 2 = two.
    eos_choice: int
    num_return: int


@functools.cache
def _eos_choices(seed: int, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """No EOS, then EOS sets that make hypotheses finish early: the tokens most often produced
    after the first by a no-EOS search of width 6."""
    out = _model(seed).generate(torch.tensor([prompt]), num_beams=6, num_return_sequences=6,
                                do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=PAD,
                                use_cache=False)
    counts = collections.Counter(t for row in out[:, len(prompt) + 1:].tolist() for t in row)
    common = [t for t, _ in counts.most_common(2)]
    return ((), (common[0],), tuple(common))


def _cases() -> list[Case]:
    cases = []
    for i, (width, lp) in enumerate(itertools.product(range(1, 7), LENGTH_PENALTIES)):
        # The three early_stopping modes search the same prompt with the same EOS set.
        seed = SEEDS[i % len(SEEDS)]
        prompt = PROMPTS[i % len(PROMPTS)]
        # EOS sets rotate: none, one, two, one.
        eos_choice = (0, 1, 2, 1)[i % 4]
        num_return = 1 + i % width
        cases.extend(Case(seed, prompt, width, lp, es, eos_choice, num_return)
                     for es in EARLY_STOPPING)
    return cases


@dataclass(frozen=True)
class Outcome:
    results: list[BeamResult]
    steps: int


@functools.cache
def _run(case: Case) -> Outcome:
    """Runs the case both ways and asserts they agree; the outcome, for the coverage test."""
    model = _model(case.seed)
    eos = _eos_choices(case.seed, case.prompt)[case.eos_choice]
    params = BeamParams(beam_width=case.width, max_tokens=MAX_NEW_TOKENS, eos_token_ids=eos,
                        length_penalty=case.length_penalty, early_stopping=case.early_stopping,
                        num_return=case.num_return)
    # use_cache=False: generate forwards the whole [num_beams, length] batch each step, as the
    # driver does, so both get bit-identical logits (cached decoding differs in the last bits).
    out = model.generate(torch.tensor([case.prompt]), num_beams=case.width, do_sample=False,
                         max_new_tokens=MAX_NEW_TOKENS, length_penalty=case.length_penalty,
                         early_stopping=case.early_stopping, eos_token_id=list(eos) or None,
                         num_return_sequences=case.num_return, pad_token_id=PAD, use_cache=False,
                         return_dict_in_generate=True, output_scores=True)
    search = BeamSearch(params)
    steps = 0
    while not search.done:
        beams = search.beams
        # Full forwards, no KV cache. All beams have the same length: no padding, so the default
        # attention mask and positions are right.
        rows = [list(case.prompt) + list(beam.tokens) for beam in beams]
        # Pad the batch to width rows, as generate's is (its first step runs width copies of the
        # prompt): matmuls of another batch size round differently.
        rows += [rows[0]] * (case.width - len(rows))
        with torch.no_grad():
            logits = model(torch.tensor(rows), logits_to_keep=1).logits[:, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)[: len(beams)]
        # generate's scores: its processed logprobs per beam (greedy: its logits) this step.
        theirs = out.scores[steps]
        if case.width == 1:
            theirs = torch.log_softmax(theirs, dim=-1)
        assert torch.equal(theirs[: len(beams)], logprobs), f"step {steps}: other logprobs"
        top = torch.topk(logprobs, search.candidates_per_beam, dim=-1)
        search.step([list(zip(ids, values, strict=True))
                     for ids, values in zip(top.indices.tolist(), top.values.tolist(),
                                            strict=True)])
        steps += 1
    results = search.results()
    assert steps == len(out.scores), "stopped at another step"
    sequences = out.sequences[:, len(case.prompt):].tolist()
    assert len(sequences) == case.num_return == len(results)
    longest = max(len(r.tokens) for r in results)
    for result, sequence in zip(results, sequences, strict=True):
        # generate pads the shorter hypotheses to the longest.
        assert sequence == list(result.tokens) + [PAD] * (longest - len(result.tokens))
    if case.width > 1:
        # Exact: the sums are float32 as generate's.
        assert out.sequences_scores.tolist() == [r.score for r in results]
    return Outcome(results, steps)


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c.width}-lp{c.length_penalty}-"
                         f"es{c.early_stopping}-eos{c.eos_choice}-r{c.num_return}-s{c.seed}")
def test_matches_generate(case: Case) -> None:
    _run(case)


def test_reference_cases_cover_early_finishes() -> None:
    outcomes = {case: _run(case) for case in CASES}
    # Some hypotheses end with an EOS before max_tokens.
    assert any(len(r.tokens) < MAX_NEW_TOKENS for o in outcomes.values() for r in o.results)
    # Beam searches (not greedy) stop early under True and under False.
    for mode in (True, False):
        assert any(o.steps < MAX_NEW_TOKENS for c, o in outcomes.items()
                   if c.width > 1 and c.early_stopping is mode)
    # Somewhere "never" (length_penalty > 0) searches on where False stops.
    assert any(o.steps < outcomes[replace(c, early_stopping="never")].steps
               for c, o in outcomes.items() if c.early_stopping is False and c.length_penalty > 0)
