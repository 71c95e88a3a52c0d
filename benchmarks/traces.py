"""Synthetic request traces with the length statistics of well-known serving datasets.

The PagedAttention paper's workloads: ShareGPT conversations (mean input ~161 tokens, mean output
~338) and Alpaca instructions (mean input ~19, output ~58). Lengths are drawn from log-normal
distributions with those means (sigma 1.0: long-tailed like the real data), clipped so that a
request fits a `max_model_len` reservation, which keeps the contiguous baseline comparable.

`UniformSpec` draws lengths uniformly from closed ranges instead (the core-vs-reference trace:
prompts in [20, 300], outputs in [20, 650]).
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Length statistics of one dataset."""

    # Name printed in figure names (e.g. "sharegpt").
    name: str
    # Mean prompt and output lengths in tokens.
    mean_input: float
    mean_output: float


@dataclass(frozen=True, slots=True)
class UniformSpec:
    """Lengths drawn uniformly from closed ranges."""

    # Name printed in figure names (e.g. "uniform").
    name: str
    # Smallest and largest prompt and output lengths in tokens (both ends included).
    input_range: tuple[int, int]
    output_range: tuple[int, int]


SHAREGPT = TraceSpec("sharegpt", 161.0, 338.0)
ALPACA = TraceSpec("alpaca", 19.0, 58.0)
UNIFORM = UniformSpec("uniform", (20, 300), (20, 650))


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace."""

    # Prompt token ids.
    prompt: np.ndarray
    # Tokens the request will generate before it finishes.
    output_len: int


def make_trace(spec: TraceSpec | UniformSpec, num_requests: int, max_model_len: int = 2048,
               vocab: int = 32_000, seed: int = 0) -> list[Request]:
    """`num_requests` requests whose prompt + output fit `max_model_len`."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    half = max_model_len // 2

    def lengths(mean: float) -> np.ndarray:
        mu = np.log(mean) - sigma**2 / 2  # log-normal with the given mean
        return np.clip(rng.lognormal(mu, sigma, num_requests).round(), 1, half).astype(int)

    def uniform(low_high: tuple[int, int]) -> np.ndarray:
        low, high = low_high
        return np.clip(rng.integers(low, high, num_requests, endpoint=True), 1, half)

    if isinstance(spec, UniformSpec):
        inputs, outputs = uniform(spec.input_range), uniform(spec.output_range)
    else:
        inputs, outputs = lengths(spec.mean_input), lengths(spec.mean_output)
    return [Request(rng.integers(0, vocab, int(n), dtype=np.int64), int(m))
            for n, m in zip(inputs, outputs, strict=True)]
