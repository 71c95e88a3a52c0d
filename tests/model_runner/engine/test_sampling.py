"""Sampler: masks against plain-Python and transformers references, seeded reproducibility,
the sampled distribution, logprobs, stops, and SamplingParams validation.

Every random input comes from a fixed generator, so each test is deterministic.
"""

import math
from collections.abc import Sequence

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedkv.client import SamplingParams
from pagedkv.model_runner.engine.penalties import apply_repetition_penalty, token_counts
from pagedkv.model_runner.engine.sampling import (
    SampledTokens,
    Sampler,
    SamplingRow,
    penalized,
    truncate,
)

from kernel_utils import DEVICES

NEG_INF = float("-inf")


def _row(params: SamplingParams, prompt: Sequence[int] = (0, 1),
         output: Sequence[int] = ()) -> SamplingRow:
    return SamplingRow(params, prompt, output)


def _truncate(logits: torch.Tensor, params: Sequence[tuple[int, float, float]]) -> torch.Tensor:
    """truncate() with per-row (top_k, top_p, min_p); top_k 0 = off."""
    vocab = logits.shape[1]
    top_k = torch.tensor([k if k > 0 else vocab for k, _, _ in params])
    top_p = torch.tensor([p for _, p, _ in params])
    min_p = torch.tensor([m for _, _, m in params])
    return truncate(logits, top_k, top_p, min_p)


# ---- masks: top-k, top-p, min-p against a plain-Python reference ----

def _reference_keep(row: Sequence[float], top_k: int, top_p: float, min_p: float) -> list[bool]:
    """The documented rule, one token at a time in float64; ties at a cut are all kept."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep = [True] * len(row)
    if top_k > 0:
        kth = row[order[min(top_k, len(row)) - 1]]
        keep = [x >= kth for x in row]

    def probs() -> list[float]:
        top = max(row)
        weights = [math.exp(x - top) if k else 0.0 for x, k in zip(row, keep, strict=True)]
        return [w / sum(weights) for w in weights]

    if top_p < 1.0:
        p, mass, threshold = probs(), 0.0, row[order[0]]
        for i in order:
            if not keep[i] or mass >= top_p:
                break
            threshold, mass = row[i], mass + p[i]
        keep = [k and x >= threshold for x, k in zip(row, keep, strict=True)]
    p = probs()
    return [k and pi >= min_p * max(p) for k, pi in zip(keep, p, strict=True)]


# Hand-picked rows: ties at several ranks, a dominant token, a flat row, a negative row.
FIXED_ROWS = [
    [2.0, 1.0, 1.0, 0.5, 0.0, 0.0, -1.0, -3.0],
    [0.3, 0.3, 0.3, 0.3, 0.1, 0.1, 0.1, 0.1],
    [8.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4],
    [-1.0, -2.5, -0.5, -4.0, -0.5, -3.0, -2.0, -1.5],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
]
# (top_k, top_p, min_p), including each filter alone, pairs, all three, and top_p tiny.
FIXED_PARAMS = [
    (0, 1.0, 0.0), (1, 1.0, 0.0), (2, 1.0, 0.0), (3, 1.0, 0.0), (5, 1.0, 0.0), (8, 1.0, 0.0),
    (0, 0.3, 0.0), (0, 0.55, 0.0), (0, 0.9, 0.0), (0, 0.999, 0.0), (0, 1e-6, 0.0),
    (0, 1.0, 0.05), (0, 1.0, 0.3), (0, 1.0, 0.6), (0, 1.0, 1.0),
    (3, 0.7, 0.0), (4, 1.0, 0.2), (0, 0.8, 0.25), (5, 0.9, 0.1), (2, 0.5, 0.9),
]


def test_truncate_matches_reference_on_fixed_logits() -> None:
    # Every (row, params) pair in one batch: each row carries its own parameters.
    cases = [(row, prm) for row in FIXED_ROWS for prm in FIXED_PARAMS]
    logits = torch.tensor([row for row, _ in cases])
    kept = _truncate(logits, [prm for _, prm in cases]) > NEG_INF
    for i, (row, (top_k, top_p, min_p)) in enumerate(cases):
        expected = _reference_keep(row, top_k, top_p, min_p)
        assert kept[i].tolist() == expected, (row, top_k, top_p, min_p)
    # Kept tokens keep their logits unchanged.
    assert torch.equal(_truncate(logits, [prm for _, prm in cases])[kept], logits[kept])


def test_truncate_ties_and_top_p_edges() -> None:
    # probs 0.5, 0.25, 0.125, 0.125: top_p counts the mass strictly before a token.
    row = [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]
    cases = {
        1e-9: [True, False, False, False],   # so small only the argmax survives
        0.49: [True, False, False, False],
        0.51: [True, True, False, False],
        0.74: [True, True, False, False],
        0.76: [True, True, True, True],      # the cut falls inside a tie: both tied tokens stay
        1.0: [True, True, True, True],
    }
    logits = torch.tensor([row] * len(cases))
    kept = _truncate(logits, [(0, p, 0.0) for p in cases]) > NEG_INF
    assert kept.tolist() == list(cases.values())
    # A flat row: top_k=1 and min_p=1 keep every token (all tie with the best).
    flat = torch.zeros(2, 5)
    assert bool((_truncate(flat, [(1, 1.0, 0.0), (0, 1.0, 1.0)]) == 0).all())


def test_truncate_matches_transformers_warpers() -> None:
    # Random logits have no ties, where our rule is exactly transformers' top-k -> top-p -> min-p.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=gen) * 2.0
    params = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.1), (10, 0.8, 0.0),
              (10, 1.0, 0.05), (0, 0.9, 0.2), (20, 0.95, 0.02), (1, 0.5, 0.5), (50, 0.3, 0.0),
              (3, 0.999, 0.0), (0, 0.01, 0.0)]
    ours = _truncate(logits, params)
    for i, (top_k, top_p, min_p) in enumerate(params):
        row = logits[i : i + 1].clone()
        ids = torch.zeros(1, 1, dtype=torch.int64)
        if top_k > 0:
            row = TopKLogitsWarper(top_k)(ids, row)
        if top_p < 1.0:
            row = TopPLogitsWarper(top_p)(ids, row)
        if min_p > 0.0:
            row = MinPLogitsWarper(min_p)(ids, row)
        assert torch.equal(ours[i] > NEG_INF, row[0] > NEG_INF), (top_k, top_p, min_p)


# ---- repetition penalty and greedy ----

def test_repetition_penalty_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    logits = torch.randn(4, vocab, generator=gen) * 3.0   # positive and negative logits
    penalties = [1.3, 0.7, 1.0, 2.0]
    histories = [([1, 2, 3, 3, 3], [7, 1]), ([0, 39], [5, 5, 5]), ([4, 6], [8]),
                 ([10, 11, 12, 60], [])]   # 60 >= vocab: ignored, as transformers does
    rows = [_row(SamplingParams(repetition_penalty=pen), prompt, output)
            for pen, (prompt, output) in zip(penalties, histories, strict=True)]
    seen = token_counts([[*row.prompt_token_ids, *row.output_token_ids] for row in rows], vocab,
                        logits.device) > 0
    ours = apply_repetition_penalty(logits, seen, torch.tensor(penalties))
    for i, (pen, (prompt, output)) in enumerate(zip(penalties, histories, strict=True)):
        processor = RepetitionPenaltyLogitsProcessor(penalty=pen)
        expected = processor(torch.tensor([prompt + output]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], expected[0], rtol=0, atol=0)


def _reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row, the documented rules one token at a time: transformers' repetition penalty over
    prompt + output, then logit -= frequency * count + presence * (count > 0) over the output."""
    p = row.params
    history = [*row.prompt_token_ids, *row.output_token_ids]
    out = RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)(
        torch.tensor([history]), logits[None].clone())[0]
    for token in set(row.output_token_ids):
        if token < len(out):
            count = list(row.output_token_ids).count(token)
            out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_frequency_and_presence_penalties_match_a_reference(device: str) -> None:
    """A batch mixing rows with and without penalties: each row's penalized logits are the
    reference's; the prompt never counts (token 3 is only in row 0's prompt)."""
    gen = torch.Generator().manual_seed(5)
    vocab = 32
    logits = (torch.randn(6, vocab, generator=gen) * 3.0).to(device)
    rows = [_row(SamplingParams(frequency_penalty=0.5), (3, 3, 4), (4, 7, 7, 7, 9)),
            _row(SamplingParams(), (1, 2), (2, 2, 2)),   # no penalty: untouched
            _row(SamplingParams(presence_penalty=1.5), (5,), (5, 6, 6, 40)),   # 40 >= vocab
            _row(SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0), (), (8, 8, 0)),
            _row(SamplingParams(repetition_penalty=1.3, frequency_penalty=-0.75,
                                presence_penalty=0.25), (10, 11), (11, 12, 12, 10)),
            _row(SamplingParams(frequency_penalty=1.0), (13, 14), ())]   # nothing generated yet
    ours = penalized(logits, rows)
    for i, row in enumerate(rows):
        torch.testing.assert_close(ours[i].cpu(), _reference_penalties(logits[i].cpu(), row))
    torch.testing.assert_close(ours[1], logits[1], rtol=0, atol=0)
    assert float(ours[0, 7]) == pytest.approx(float(logits[0, 7]) - 1.5)
    assert float(ours[0, 3]) == float(logits[0, 3])


def test_a_greedy_row_with_a_frequency_penalty_avoids_what_it_generated() -> None:
    """The penalty moves the argmax off a token the row generated twice, not off one only in
    its prompt; the same row without the penalty keeps its favourite."""
    logits = torch.zeros(2, 8)
    logits[:, 5] = 3.0
    logits[:, 2] = 2.5
    rows = [_row(SamplingParams(temperature=0.0, frequency_penalty=0.5), (2, 2, 2), (5, 5)),
            _row(SamplingParams(temperature=0.0), (2,), (5, 5))]
    assert Sampler()(logits, rows).token_ids.tolist() == [2, 5]


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_zero_is_argmax_of_penalized_logits(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=gen).to(device)
    favourite = int(logits[0].argmax())
    # Row 0 penalizes its own argmax hard; seed, top_k and top_p do not matter to greedy rows.
    rows = [_row(SamplingParams(temperature=0.0, repetition_penalty=100.0), [favourite]),
            _row(SamplingParams(temperature=0.0, seed=3, top_k=2, top_p=0.1)),
            _row(SamplingParams(temperature=0.8, seed=4)),
            _row(SamplingParams(temperature=0.0)),
            _row(SamplingParams(temperature=1e-7)),   # below the greedy threshold
            _row(SamplingParams(temperature=1.2))]
    out = Sampler()(logits, rows)
    penalized = logits[0].clone()
    assert penalized[favourite] > 0   # so the penalty divides it
    penalized[favourite] = penalized[favourite] / 100.0
    assert int(out.token_ids[0]) == int(penalized.argmax()) != favourite
    argmax = logits.argmax(dim=-1)
    for i in (1, 3, 4):
        assert int(out.token_ids[i]) == int(argmax[i])


# ---- seeded reproducibility ----

def _generate(params: Sequence[SamplingParams], logits_ids: Sequence[int],
              logits: torch.Tensor, sampler: Sampler) -> list[list[int]]:
    """One step per logits[t]; row r's logits at step t are logits[t, logits_ids[r]]."""
    outputs: list[list[int]] = [[] for _ in params]
    for t in range(logits.shape[0]):
        rows = [_row(p, (1, 2, 3), out) for p, out in zip(params, outputs, strict=True)]
        tokens = sampler(logits[t, list(logits_ids)], rows).token_ids.tolist()
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
    return outputs


STEPS = 8
VOCAB = 64


def _step_logits() -> torch.Tensor:
    """[STEPS, 4 logits ids, VOCAB]: flat enough that sampling varies a lot."""
    return torch.randn(STEPS, 4, VOCAB, generator=torch.Generator().manual_seed(5)) * 0.5


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, repetition_penalty=1.1)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_reproducible_across_runs(device: str) -> None:
    logits = _step_logits().to(device)
    first = _generate([SEEDED], [0], logits, Sampler())
    torch.manual_seed(99)   # the global RNG does not feed seeded rows
    second = _generate([SEEDED], [0], logits, Sampler())
    assert first == second
    assert len(set(first[0])) > 1   # it really sampled


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_independent_of_batch_composition(device: str) -> None:
    logits = _step_logits().to(device)
    alone = _generate([SEEDED], [0], logits, Sampler())[0]
    others = [SamplingParams(temperature=1.0),                      # unseeded
              SamplingParams(temperature=0.0),                      # greedy
              SamplingParams(temperature=0.5, seed=7, min_p=0.1)]   # another seed
    batches = {
        "first": ([SEEDED, *others], [0, 1, 2, 3], 0),
        "last": ([*others, SEEDED], [1, 2, 3, 0], 3),
        "middle": ([others[0], SEEDED, others[2]], [3, 0, 1], 1),
        "twice": ([SEEDED, others[1], SEEDED], [0, 2, 0], 2),
    }
    for name, (params, logits_ids, position) in batches.items():
        outputs = _generate(params, logits_ids, logits, Sampler())
        assert outputs[position] == alone, name


def test_different_seeds_give_different_tokens() -> None:
    logits = _step_logits()
    runs = {seed: _generate([SamplingParams(seed=seed)], [0], logits, Sampler())[0]
            for seed in range(5)}
    assert len({tuple(tokens) for tokens in runs.values()}) == len(runs)


# ---- the sampled distribution ----

def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_sampling_matches_softmax(device: str) -> None:
    draws, temperature = 40_000, 0.7
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -2.0])
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))
    # One batch of `draws` rows with the same logits: one draw each.
    batch = logits.repeat(draws, 1).to(device)
    tokens = sampler(batch, [_row(SamplingParams(temperature=temperature))] * draws).token_ids
    expected = torch.softmax(logits / temperature, dim=-1)
    # Binomial standard deviation is at most sqrt(0.25 / 40000) = 0.0025: 0.01 is 4 sigma.
    torch.testing.assert_close(_frequencies(tokens.cpu(), 5), expected, rtol=0, atol=0.01)
    # With top_k=2 the two best share all the mass, renormalized.
    tokens = sampler(batch, [_row(SamplingParams(temperature=temperature, top_k=2))] * draws)
    expected = torch.softmax(logits / temperature + torch.tensor(
        [0.0, NEG_INF, NEG_INF, 0.0, NEG_INF]), dim=-1)
    torch.testing.assert_close(_frequencies(tokens.token_ids.cpu(), 5), expected, rtol=0,
                               atol=0.01)


def test_seeded_sampling_over_many_seeds_matches_softmax() -> None:
    draws = 5_000
    logits = torch.tensor([0.5, 0.0, -1.0, 1.0])
    rows = [_row(SamplingParams(seed=seed)) for seed in range(draws)]
    tokens = Sampler()(logits.repeat(draws, 1), rows).token_ids
    # sqrt(0.25 / 5000) = 0.007: 0.03 is about 4 sigma.
    torch.testing.assert_close(_frequencies(tokens, 4), torch.softmax(logits, dim=-1), rtol=0,
                               atol=0.03)


# ---- logprobs and stops ----

def test_logprobs_are_raw_log_softmax_and_topk_sorted() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 20, generator=gen)
    rows = [_row(SamplingParams(temperature=0.5, repetition_penalty=1.5, seed=1, logprobs=3)),
            _row(SamplingParams(temperature=0.0, logprobs=0)),
            _row(SamplingParams(temperature=1.0, top_k=3, seed=2, logprobs=5)),
            _row(SamplingParams(temperature=1.0, seed=3))]   # asked for nothing
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    # Logprobs of the raw logits, whatever penalty or temperature shaped the sample.
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.topk_ids is not None and out.topk_logprobs is not None
    assert out.topk_ids.shape == (4, 5)
    for i, k in enumerate([3, 0, 5, 0]):
        values, ids = torch.topk(raw[i], k)
        assert out.topk_ids[i, :k].tolist() == ids.tolist()
        torch.testing.assert_close(out.topk_logprobs[i, :k], values)
        assert bool((out.topk_logprobs[i, :k].diff() <= 0).all())
        assert out.topk_ids[i, k:].tolist() == [-1] * (5 - k)
        assert bool((out.topk_logprobs[i, k:] == NEG_INF).all())


def test_no_logprobs_unless_asked() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(7))
    none = Sampler()(logits, [_row(SamplingParams())] * 2)
    assert none.logprobs is None and none.topk_ids is None and none.topk_logprobs is None
    only_sampled = Sampler()(logits, [_row(SamplingParams(logprobs=0))] * 2)
    assert only_sampled.logprobs is not None and only_sampled.topk_ids is None


def test_finished_on_stop_token_or_max_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0]] * 3)   # greedy picks token 1
    rows = [_row(SamplingParams(temperature=0.0, stop_token_ids=(2, 1))),
            _row(SamplingParams(temperature=0.0, stop_token_ids=(2,), max_tokens=3), (), [0, 0]),
            _row(SamplingParams(temperature=0.0, max_tokens=4), (), [0, 0])]
    out: SampledTokens = Sampler()(logits, rows)
    assert out.token_ids.tolist() == [1, 1, 1]
    assert out.finished.tolist() == [True, True, False]
    assert rows[0].params.is_stop(1) and not rows[1].params.is_stop(1)


def test_sampler_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[S, V\] with S = 2"):
        Sampler()(torch.zeros(3, 4), [_row(SamplingParams())] * 2)
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        Sampler()(torch.zeros(4), [_row(SamplingParams())])
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        Sampler()(torch.zeros(1, 4), [_row(SamplingParams(repetition_penalty=1.2), [-1])])


# ---- SamplingParams ----

def test_params_defaults_and_normalization() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0 and params.top_k == 0 and params.top_p == 1.0
    assert params.seed is None and params.logprobs is None and not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    listed = SamplingParams(stop_token_ids=[3, 4])   # type: ignore[arg-type]
    assert listed.stop_token_ids == (3, 4)
    assert hash(listed) == hash(SamplingParams(stop_token_ids=(3, 4)))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"top_k": -2}, "top_k must be >= 1, or 0 or -1"),
    ({"top_k": 2.5}, "top_k must be an int"),
    ({"top_k": True}, "top_k must be an int"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be finite"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": -2.01}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be finite"),
    ({"presence_penalty": "1"}, "presence_penalty must be a number"),
    ({"seed": -1}, r"seed must be in \[0, 2\*\*64\)"),
    ({"seed": 2**64}, r"seed must be in \[0, 2\*\*64\)"),
    ({"stop_token_ids": (1, -2)}, "stop_token_ids must be >= 0"),
    ({"stop_token_ids": ("a",)}, "stop_token_ids must be an int"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"logprobs": -1}, "logprobs must be >= 0"),
    ({"n": 0}, "n must be >= 1"),
    ({"n": 3, "best_of": 2}, r"best_of must be >= n \(3\)"),
    ({"beam_width": -1}, "beam_width must be >= 1, or 0"),
    ({"beam_width": 2}, "beam search needs temperature=0"),
    ({"beam_width": 2, "temperature": 0, "n": 3}, r"n <= beam_width \(2\)"),
    ({"beam_width": 2, "temperature": 0, "best_of": 2}, "takes no best_of"),
    ({"early_stopping": "sometimes"}, "early_stopping must be True, False or 'never'"),
    ({"length_penalty": float("nan")}, "length_penalty must be finite"),
])
def test_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
