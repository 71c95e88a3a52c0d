"""Prefix caching end to end: requests behind one 1,000-token system prompt, with and without
the cache, side by side on one real pagedkvd and runner (benchmarks/e2e.py).

Each request is the system prompt plus a distinct random suffix of SUFFIX_TOKENS, and generates
OUTPUT_TOKENS greedily. With the cache: one Engine (one session, one cache salt); a warm request
first computes the system prompt, then each request finds its full blocks in the cache and
computes only the rest. Without: each request comes through an Engine of its own with a cache
salt of its own, so no cached block is visible to it (the same daemon, the same runner, the
same pool). The two kinds alternate, one request at a time, so each time to first token is a
lone prefill's and both see the same machine load.

Figures: prefix_prefill_tokens_cached / _uncached (prompt tokens computed per request, mean:
prompt - num_cached_tokens), prefix_ttft_ms_cached / _uncached (medians of the engine's
time_to_first_token), prefix_ttft_speedup (uncached median / cached median).
Usage: python benchmarks/bench_prefix.py [--requests 20] [--quick]
"""

import argparse
import asyncio
import statistics

import numpy as np
from e2e import VOCAB, Stack, add_quick_flag, figure, serving

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import RequestOutput

SYSTEM_TOKENS = 1000
SUFFIX_TOKENS = 24
OUTPUT_TOKENS = 4
# Every request's blocks stay cached: nothing is evicted during the run.
NUM_BLOCKS = 4096
PARAMS = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts: one system prompt, then a distinct suffix each."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, SYSTEM_TOKENS).tolist()
    return [system + rng.integers(0, VOCAB, SUFFIX_TOKENS).tolist() for _ in range(count)]


async def alternate(stack: Stack, count: int) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """(cached outputs, uncached outputs) of `count` requests each, the warm one left out."""
    warm, *rest = prompts(2 * count + 1)
    cached, uncached = [], []
    async with await Engine.connect(stack.daemon, stack.runner,
                                    client_name="bench-prefix", cache_salt="shared") as shared:
        await shared.generate(warm, PARAMS)
        for index in range(count):
            cached.append(await shared.generate(rest[2 * index], PARAMS))
            async with await Engine.connect(stack.daemon, stack.runner,
                                            client_name="bench-prefix",
                                            cache_salt=f"alone-{index}") as alone:
                uncached.append(await alone.generate(rest[2 * index + 1], PARAMS))
    return cached, uncached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="of each kind")
    add_quick_flag(parser)
    args = parser.parse_args()
    with serving(NUM_BLOCKS) as stack:
        cached, uncached = asyncio.run(alternate(stack, 2 if args.quick else args.requests))
    ttft: dict[str, float] = {}
    for name, outputs in (("cached", cached), ("uncached", uncached)):
        computed = [o.num_prompt_tokens - o.num_cached_tokens for o in outputs]
        figure(f"prefix_prefill_tokens_{name}", statistics.mean(computed), "tokens", 1)
        ttft[name] = statistics.median(o.metrics["time_to_first_token_s"] for o in outputs)
        figure(f"prefix_ttft_ms_{name}", ttft[name] * 1e3, "ms", 2)
    figure("prefix_ttft_speedup", ttft["uncached"] / ttft["cached"], "ratio", 2)


if __name__ == "__main__":
    main()
