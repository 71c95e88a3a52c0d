"""The sampler's masks (model_runner/engine/masks.py) with exact token ids: a structured output's
bitmask on its rows only, min_tokens on the stop ids, logprobs of the raw logits, the matcher
advanced by the sampled token and rebuilt by replay. The vocabulary is seven raw tokens, so every
expected id is written out."""

import math

import pytest
import torch
import xgrammar as xgr

from pagedkv.client import SamplingParams, StructuredOutputs
from pagedkv.model_runner.engine.grammar import GrammarState
from pagedkv.model_runner.engine.sampling import Sampler, SamplingRow, picks

EOS, A, B, C, AB, ONE, TWO = range(7)
VOCAB = ["<eos>", "a", "b", "c", "ab", "1", "2"]
# "a", then an optional "b", then "c": after nothing, only a / ab; after ab, only c.
REGEX = StructuredOutputs(regex="ab?c")
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=0)


@pytest.fixture(scope="module")
def compiled() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1).compile_regex("ab?c")


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# Raw preference: c > ab > <eos> > a > the rest.
PREFERS_C = [2.0, 1.0, 0.0, 5.0, 4.0, 0.0, 0.0]


def sample(scores: torch.Tensor, rows: list[SamplingRow]) -> list[tuple[int, bool, bool]]:
    return [(p.token_id, p.finished, p.constraint_ended)
            for p in picks(Sampler()(scores, rows), rows)]


def test_the_mask_applies_to_constrained_rows_only_and_the_matcher_advances(
        compiled: xgr.CompiledGrammar) -> None:
    grammar = GrammarState(REGEX, compiled)
    constrained = SamplingParams(temperature=0, max_tokens=16, structured_outputs=REGEX)
    outputs: list[int] = []
    # Row 0 constrained: c is refused first, ab is the best allowed; row 1 free takes c.
    assert sample(logits(PREFERS_C, PREFERS_C),
                  [SamplingRow(constrained, [ONE], outputs, grammar),
                   SamplingRow(GREEDY, [ONE], [])]) == [(AB, False, False), (C, False, False)]
    assert grammar.accepted == [AB]
    outputs.append(AB)
    # After ab only c; then only the stop token, which ends the constraint: finished though
    # the row has no stop ids (ignore_eos).
    assert sample(logits(PREFERS_C), [SamplingRow(constrained, [ONE], outputs, grammar)]) == [
        (C, False, False)]
    outputs.append(C)
    assert sample(logits(PREFERS_C), [SamplingRow(constrained, [ONE], outputs, grammar)]) == [
        (EOS, True, True)]


def test_logprobs_are_of_the_raw_logits(compiled: xgr.CompiledGrammar) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, structured_outputs=REGEX)
    rows = [SamplingRow(params, [ONE], [], GrammarState(REGEX, compiled))]
    sampled = Sampler()(logits(PREFERS_C), rows)
    raw = torch.log_softmax(logits(PREFERS_C), dim=-1)[0]
    assert sampled.token_ids.tolist() == [AB]
    assert sampled.logprobs is not None and sampled.topk_ids is not None
    assert math.isclose(sampled.logprobs.item(), raw[AB].item(), rel_tol=1e-6)
    assert sampled.topk_ids.tolist() == [[C]]  # the raw top token, though the mask refused it


def test_a_fork_and_a_resample_rebuild_the_matcher_by_replay(
        compiled: xgr.CompiledGrammar) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=REGEX)
    # A fork's child (a new state) whose output is already [a]: the matcher replays it, then
    # allows b and c; c is the raw favourite.
    child = GrammarState(REGEX, compiled)
    assert sample(logits(PREFERS_C), [SamplingRow(params, [ONE], [A], child)]) == [
        (C, False, False)]
    assert child.accepted == [A, C]
    # Sampled again at the same position (decode ahead with changed sampling): the matcher
    # holds [a, c] but the output is [a]: rebuilt, it allows b and c again.
    favours_b = [0.0, 0.0, 6.0, 5.0, 0.0, 0.0, 0.0]
    assert sample(logits(favours_b), [SamplingRow(params, [ONE], [A], child)]) == [
        (B, False, False)]
    assert child.accepted == [A, B]


def test_min_tokens_masks_the_stop_ids_until_reached() -> None:
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=2, stop_token_ids=(EOS,))
    prefers_eos = [9.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    early = [SamplingRow(params, [ONE], []), SamplingRow(params, [ONE], [A])]
    assert sample(logits(prefers_eos, prefers_eos), early) == [(A, False, False),
                                                               (A, False, False)]
    # Reached: the stop id is sampled and finishes the row.
    assert sample(logits(prefers_eos), [SamplingRow(params, [ONE], [A, A])]) == [
        (EOS, True, False)]
    # A row without min_tokens in the same batch keeps its stop id.
    free = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(EOS,))
    assert sample(logits(prefers_eos, prefers_eos),
                  [SamplingRow(params, [ONE], []), SamplingRow(free, [ONE], [])]) == [
        (A, False, False), (EOS, True, False)]


def test_a_complete_constraint_wins_over_min_tokens(compiled: xgr.CompiledGrammar) -> None:
    """The constraint allows only its stop token, min_tokens forbids it: the row keeps the stop
    token rather than sampling from nothing."""
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=8, stop_token_ids=(EOS,),
                            structured_outputs=REGEX)
    grammar = GrammarState(REGEX, compiled)
    assert sample(logits(PREFERS_C), [SamplingRow(params, [ONE], [A, C], grammar)]) == [
        (EOS, True, True)]


def test_the_callers_logits_are_left_as_they_are(compiled: xgr.CompiledGrammar) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=1, stop_token_ids=(EOS,),
                            structured_outputs=REGEX)
    scores = logits(PREFERS_C)
    Sampler()(scores, [SamplingRow(params, [ONE], [], GrammarState(REGEX, compiled))])
    assert scores.tolist() == [PREFERS_C]
