"""Pick each sequence's next token from its logits, with per-sequence SamplingParams.

    logits:  [S, V]  one row per sequence (the last position's logits), converted to fp32
    rows:    S SamplingRow records (params, prompt token ids, output token ids so far)

One step, in the order of vLLM's v1 sampler and of transformers' `generate` warpers:

    1. logprobs (when any row asks): log_softmax of the raw logits, before anything below.
       This is vLLM's default (`logprobs_mode="raw_logprobs"`): the model's own distribution,
       independent of the sampling knobs, which is what beam search and scoring want. They are
       also before the masks of step 2 (vLLM's raw_logprobs are pre-mask too): a constrained
       row's logprobs are the model's, not renormalized over what its constraint allows.
    2. masks (`masks.py`): what the row's structured output does not allow next, and its stop
       tokens while it has generated fewer than min_tokens, at -inf.
    3. penalties (`penalties.py`, in vLLM's order): the repetition penalty over the row's
       prompt + output tokens (transformers' semantics), then the frequency and presence
       penalties over its output tokens only (OpenAI's and vLLM's semantics).
    4. greedy rows (temperature 0) take the argmax of the penalized logits (first index on ties).
    5. temperature: penalized logits / T.
    6. top-k, then top-p on the top-k distribution, then min-p (transformers' warper order;
       vLLM applies min-p before top-k/top-p, which differs only in the mass top-p measures).
       Each keeps a prefix of the tokens sorted by logit, and every token tied with the last one
       kept: the result does not depend on how a sort orders ties.
    7. sample: the exponential race, argmax(probs / E) with E ~ Exp(1) per token, which draws a
       token with probability probs (vLLM does the same; it needs no cumsum or search).

Randomness: a seeded row draws its E from its own generator, seeded from (seed, tokens generated
so far), so the same request gives the same tokens alone or in any batch, at any row. Unseeded
rows draw, in batch order, from one shared generator (the Sampler's, else torch's default).
Seeded streams hold for one device type and torch version (generators differ between CPU and
CUDA); forks sharing a seed sample alike, so `n > 1` will need a seed per child.
Everything but the seeded rows' draws is vectorized over the batch.

Stops: `SampledTokens.finished` says which rows sampled a stop token or reached max_tokens;
`SamplingParams.is_stop(token_id)` is the same check for one token on the client side. A
constrained row's matcher accepts its sampled token on the host (`picks`): a token that
completes the constraint finishes the row too (`Pick.constraint_ended`), stop id or not.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.model_runner.engine.grammar import GrammarState
from pagedkv.model_runner.engine.masks import mask_logits
from pagedkv.model_runner.engine.penalties import (
    apply_output_penalties,
    apply_repetition_penalty,
    token_counts,
)

_M64 = 2**64 - 1


class SamplingRow(NamedTuple):
    """One sequence of the batch, as the sampler needs it (a named tuple, as Pick: one of each
    is made per sequence per step on the forward thread, ~0.2 us against ~0.8 us for a frozen
    dataclass)."""

    # The sequence's sampling parameters.
    params: SamplingParams
    # Its prompt's token ids (repetition penalty).
    prompt_token_ids: Sequence[int]
    # The tokens it generated so far (all three penalties); the count is its step for seeded
    # sampling.
    output_token_ids: Sequence[int]
    # Its structured output's matcher (SeqState.grammar), advanced by `picks`; None: free text.
    grammar: GrammarState | None = None


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """The sampler's result, one entry per row, on the logits' device."""

    # The sampled token of each row: [S] int64.
    token_ids: torch.Tensor
    # log p(sampled token) under the raw logits: [S] fp32; None when no row asked for logprobs.
    logprobs: torch.Tensor | None
    # The K most likely tokens of each row, most likely first: [S, K] int64, K = the largest
    # `logprobs` asked; a row that asked for k < K has -1 in columns k and up; None when K = 0.
    topk_ids: torch.Tensor | None
    # Their raw logprobs, sorted descending: [S, K] fp32, -inf where topk_ids is -1.
    topk_logprobs: torch.Tensor | None
    # Whether the row finished: it sampled a stop token or reached max_tokens: [S] bool.
    finished: torch.Tensor


class Pick(NamedTuple):
    """One row's sampled token as Python values (what a step's answer carries)."""

    token_id: int
    # Raw logprob of the token (0.0 when no row of the batch asked for logprobs).
    logprob: float
    # The row's own top logprobs (as many as it asked), most likely first.
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    # A stop token, or max_tokens reached, or the structured output complete.
    finished: bool
    # The token completed the row's structured output (its matcher accepts nothing more).
    constraint_ended: bool = False


def picks(sampled: SampledTokens, rows: Sequence[SamplingRow]) -> list[Pick]:
    """Each row's result on the host: one device-to-host copy per field, not one per row. A
    constrained row's matcher accepts its token here (the forward thread's, like the masks)."""
    tokens, finished = sampled.token_ids.tolist(), sampled.finished.tolist()
    ended = [row.grammar is not None and row.grammar.accept(token)
             for row, token in zip(rows, tokens, strict=True)]
    if sampled.logprobs is None:  # no row asked for logprobs (a decode step's usual case)
        return [Pick(token, 0.0, (), (), done or end, end)
                for token, done, end in zip(tokens, finished, ended, strict=True)]
    logprobs = sampled.logprobs.tolist()
    top_ids: list[list[int]] = [[] for _ in rows]
    top_logprobs: list[list[float]] = [[] for _ in rows]
    if sampled.topk_ids is not None and sampled.topk_logprobs is not None:
        top_ids, top_logprobs = sampled.topk_ids.tolist(), sampled.topk_logprobs.tolist()
    out = []
    for i, row in enumerate(rows):
        asked = row.params.logprobs or 0
        out.append(Pick(tokens[i], logprobs[i], tuple(top_ids[i][:asked]),
                        tuple(top_logprobs[i][:asked]), finished[i] or ended[i], ended[i]))
    return out


class Sampler:
    """Samples a batch of rows; holds only the unseeded rows' generator."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Shared by unseeded rows; None = torch's default generator for the logits' device.
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampledTokens:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] == 0:
            raise ValueError(f"logits must be [S, V] with S = {len(rows)} rows and V >= 1, "
                             f"got {list(logits.shape)}")
        logits = logits.float()
        params = [row.params for row in rows]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(p.logprobs is not None for p in params) else None)
        logits = penalized(mask_logits(logits, rows), rows)

        token_ids = torch.argmax(logits, dim=-1)
        greedy = [p.is_greedy for p in params]
        if not all(greedy):
            sampled = self._sample(logits, rows, greedy)
            token_ids = torch.where(torch.tensor(greedy, device=logits.device), token_ids, sampled)

        logprobs = topk_ids = topk_logprobs = None
        if raw_logprobs is not None:
            logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            topk_ids, topk_logprobs = _topk(raw_logprobs, [p.logprobs or 0 for p in params])
        return SampledTokens(token_ids, logprobs, topk_ids, topk_logprobs,
                             _finished(token_ids, rows))

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                greedy: Sequence[bool]) -> torch.Tensor:
        """Temperature, truncation and the exponential race over the penalized logits. -> [S]

        Greedy rows go through with T = 1 and no truncation; the caller discards their sample.
        """
        vocab, device = logits.shape[1], logits.device
        params = [SamplingParams() if g else row.params
                  for g, row in zip(greedy, rows, strict=True)]
        scaled = logits / _tensor([p.temperature for p in params], device)[:, None]
        top_k = [vocab if p.top_k < 1 else min(p.top_k, vocab) for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p) or any(min_p):
            scaled = truncate(scaled, torch.tensor(top_k, device=device),
                              _tensor(top_p, device), _tensor(min_p, device))
        noise = self._noise(rows, greedy, vocab, device)
        return exponential_race(torch.softmax(scaled, dim=-1), noise)

    def _noise(self, rows: Sequence[SamplingRow], greedy: Sequence[bool], vocab: int,
               device: torch.device) -> torch.Tensor:
        """E ~ Exp(1): [S, V]; ones for greedy rows (unused)."""
        noise = torch.ones(len(rows), vocab, device=device)
        unseeded = [i for i, row in enumerate(rows) if not greedy[i] and row.params.seed is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab, device=device)
            noise[unseeded] = draws.exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            seed = row.params.seed
            if greedy[i] or seed is None:
                continue
            generator = torch.Generator(device=device)
            generator.manual_seed(step_seed(seed, len(row.output_token_ids)))
            noise[i].exponential_(generator=generator)
        return noise


def step_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from a request's seed and its step (splitmix64 of each)."""
    return _splitmix64(_splitmix64(seed) ^ step)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def penalized(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Step 2: the repetition penalty, then the frequency and presence penalties; each is
    skipped when no row sets it, and counts only the tokens of rows that set it. [S, V] fp32"""
    vocab, device = logits.shape[1], logits.device
    params = [row.params for row in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = token_counts([[*row.prompt_token_ids, *row.output_token_ids]
                             if row.params.repetition_penalty != 1.0 else [] for row in rows],
                            vocab, device) > 0
        logits = apply_repetition_penalty(logits, seen,
                                          _tensor([p.repetition_penalty for p in params], device))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = token_counts([row.output_token_ids
                               if row.params.presence_penalty or row.params.frequency_penalty
                               else [] for row in rows], vocab, device)
        logits = apply_output_penalties(logits, counts,
                                        _tensor([p.presence_penalty for p in params], device),
                                        _tensor([p.frequency_penalty for p in params], device))
    return logits


def truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p, then min-p: dropped tokens' logits become -inf.

    logits: [S, V] fp32 (after temperature); top_k: [S] int64 in [1, V] (V = off);
    top_p: [S] fp32 in (0, 1] (1 = off); min_p: [S] fp32 in [0, 1] (0 = off).

    In sorted (descending) order each filter keeps a prefix, so their intersection is the prefix
    up to a threshold logit; every token at or above it is kept, ties included.
    """
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    # -- top-k: at or above the k-th largest logit --
    kth = sorted_logits.gather(1, (top_k - 1)[:, None])
    keep = sorted_logits >= kth
    # -- top-p on the top-k distribution: the mass of strictly earlier tokens is below top_p --
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1).roll(1, dims=-1)
    mass_before[:, 0] = 0.0
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    # -- min-p: relative to the most likely token, so renormalizing after top-p changes nothing --
    keep &= probs >= min_p[:, None] * probs[:, :1]
    # -- the kept prefix's last logit is the threshold (keep[:, 0] always holds) --
    threshold = sorted_logits.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E) per row, E ~ Exp(1): token i wins with probability probs[i]. -> [S]"""
    return torch.argmax(probs / noise.clamp(min=torch.finfo(noise.dtype).tiny), dim=-1)


def _topk(raw_logprobs: torch.Tensor,
          ks: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The max(ks) most likely tokens per row; columns past a row's own k padded (-1, -inf)."""
    width = min(max(ks), raw_logprobs.shape[1])
    if width == 0:
        return None, None
    values, ids = torch.topk(raw_logprobs, width, dim=-1)
    device = raw_logprobs.device
    past_k = torch.arange(width, device=device)[None, :] >= torch.tensor(ks, device=device)[:, None]
    return ids.masked_fill(past_k, -1), values.masked_fill(past_k, float("-inf"))


def _finished(token_ids: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[S] bool: the row sampled one of its stop tokens or reached max_tokens."""
    device = token_ids.device
    reached = [len(row.output_token_ids) + 1 >= row.params.max_tokens for row in rows]
    finished = torch.tensor(reached, dtype=torch.bool, device=device)
    width = max(len(row.params.stop_token_ids) for row in rows) if rows else 0
    if width:
        stops = torch.tensor([list(row.params.stop_token_ids)
                              + [-1] * (width - len(row.params.stop_token_ids)) for row in rows],
                             dtype=torch.int64, device=device)
        finished |= (stops == token_ids[:, None]).any(dim=1)
    return finished


def _tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
