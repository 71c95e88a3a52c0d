"""Memory saved by block sharing during real generation: parallel sampling and beam search.

A real pagedkvd and runner (benchmarks/e2e.py); per trace (Alpaca-like: input ~19, output ~58
tokens; ShareGPT-like: ~161 / ~338, benchmarks/traces.py) and per width, every request of the
trace is submitted at once through one Engine:
- parallel sampling: n samples (temperature 1, a seed per request): the prompt is computed once
  and every sample shares its blocks, copying only a partial last block;
- beam search: beam_width beams (temperature 0): beams share their common prefix, fork where
  they branch and drop what no beam continues.
After every engine step the session's figures are read; saved = 1 - blocks_held /
block_table_entries (the physical blocks its sequences hold over the blocks the same tables
would hold without sharing), averaged over the steps. The pool is large enough that nothing is
preempted (a recomputed sequence would share through the prefix cache instead). Fewer requests
than a real trace, at the traces' full lengths.

Figures: sharing_saved_parallel_n{W}_{trace} and sharing_saved_beam_w{W}_{trace} (fractions),
beside the vLLM paper's (parallel 6.1-9.8% Alpaca, 16.2-30.5% ShareGPT; beam 37.6-55.2% Alpaca,
44.3-66.3% ShareGPT, over widths 2-6).
Usage: python benchmarks/bench_sharing.py [--alpaca-requests 32] [--sharegpt-requests 6] [--quick]
"""

import argparse
import asyncio

from e2e import VOCAB, ParamsFor, Stack, add_quick_flag, figure, jobs_from_trace, run_trace, serving

from pagedkv.client import SamplingParams

from traces import ALPACA, SHAREGPT, Request, make_trace

# Every sequence of the largest run fits at once (ShareGPT at width 6): nothing is preempted.
NUM_BLOCKS = 16_384
WIDTHS = (2, 4, 6)


def parallel(width: int) -> ParamsFor:
    def params(index: int, request: Request) -> SamplingParams:
        return SamplingParams(temperature=1.0, n=width, seed=index,
                              max_tokens=request.output_len)
    return params


def beam(width: int) -> ParamsFor:
    def params(index: int, request: Request) -> SamplingParams:
        return SamplingParams(temperature=0.0, beam_width=width, max_tokens=request.output_len)
    return params


async def mean_saved(stack: Stack, trace: list[Request], params: ParamsFor) -> float:
    run = await run_trace(stack, jobs_from_trace(trace, params), sample_sharing=True)
    assert run.num_preemptions == 0, "the pool is too small: recomputed sequences share less"
    return run.mean_saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--alpaca-requests", type=int, default=32)
    parser.add_argument("--sharegpt-requests", type=int, default=6)
    add_quick_flag(parser)
    args = parser.parse_args()
    counts = {ALPACA.name: args.alpaca_requests, SHAREGPT.name: args.sharegpt_requests}
    widths: tuple[int, ...] = WIDTHS
    max_model_len = 2048
    if args.quick:  # shorter lengths too: the quick run only shows the script works
        counts = dict.fromkeys(counts, 2)
        widths, max_model_len = (2,), 128
    with serving(NUM_BLOCKS) as stack:
        for spec in (ALPACA, SHAREGPT):
            trace = make_trace(spec, counts[spec.name], max_model_len, VOCAB)
            for kind, params in (("parallel_n", parallel), ("beam_w", beam)):
                for width in widths:
                    value = asyncio.run(mean_saved(stack, trace, params(width)))
                    figure(f"sharing_saved_{kind}{width}_{spec.name}", value, "fraction")


if __name__ == "__main__":
    main()
