"""Preemption by recompute end to end: one trace on a pool too small for it and on one large
enough, side by side (two real pagedkvd + runner pairs, benchmarks/e2e.py).

The trace: ShareGPT-like lengths (input ~161, output ~338 tokens, each request within
MAX_MODEL_LEN), every request submitted at once, greedy, exactly its output length. On the small
pool the engine admits by free blocks and, when running sequences outgrow the pool, preempts the
newest request (frees its blocks) and recomputes it once blocks are free again. Both pools are
up at once; runs alternate between them, one round each per --rounds.

Computed tokens are the runner's own count (prefill + decode, /metrics). The large pool computes
exactly what the trace needs (each prompt once, one token per generated token but the last);
what the small pool computes beyond that is recomputation of preempted sequences.

Figures (medians over rounds): preempt_tok_s and preempt_baseline_tok_s (generated tokens per
second), preempt_tok_s_ratio (small / large), preempt_recomputed_frac (recomputed tokens /
all tokens the small pool computed), preempt_num_preemptions.
Usage: python benchmarks/bench_preempt.py [--requests 48] [--rounds 2] [--quick]
"""

import argparse
import asyncio
import statistics

from e2e import VOCAB, add_quick_flag, figure, greedy, jobs_from_trace, run_trace, serving

from pagedkv.client.engine.scheduler import SchedulerConfig

from traces import SHAREGPT, make_trace

MAX_MODEL_LEN = 1024
# The trace's sequences at full length need ~1,500 blocks together; the small pool holds a
# quarter of that, the large one all of it.
SMALL_BLOCKS, LARGE_BLOCKS = 384, 4096
# No watermark: the small pool's preemptions come from growth alone, not from admission slack.
CONFIG = SchedulerConfig(watermark=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    add_quick_flag(parser)
    args = parser.parse_args()
    requests, max_model_len, small_blocks, rounds = (args.requests, MAX_MODEL_LEN, SMALL_BLOCKS,
                                                     args.rounds)
    if args.quick:  # one sequence at most 256 tokens (16 blocks), the small pool 24 blocks
        requests, max_model_len, small_blocks, rounds = 6, 256, 24, 1
    jobs = jobs_from_trace(make_trace(SHAREGPT, requests, max_model_len, VOCAB), greedy)
    tok_s: dict[str, list[float]] = {"small": [], "large": []}
    recomputed, preemptions = [], []
    with serving(small_blocks) as small, serving(LARGE_BLOCKS) as large:
        for _ in range(rounds):
            short = asyncio.run(run_trace(small, jobs, CONFIG))
            roomy = asyncio.run(run_trace(large, jobs, CONFIG))
            assert roomy.num_preemptions == 0, "the large pool preempted: make it larger"
            tok_s["small"].append(short.tok_s)
            tok_s["large"].append(roomy.tok_s)
            recomputed.append((short.computed_tokens - roomy.computed_tokens)
                              / short.computed_tokens)
            preemptions.append(short.num_preemptions)
    small_tok_s, large_tok_s = statistics.median(tok_s["small"]), statistics.median(tok_s["large"])
    figure("preempt_tok_s", small_tok_s, "tok/s", 1)
    figure("preempt_baseline_tok_s", large_tok_s, "tok/s", 1)
    figure("preempt_tok_s_ratio", small_tok_s / large_tok_s, "ratio", 2)
    figure("preempt_recomputed_frac", statistics.median(recomputed), "fraction")
    figure("preempt_num_preemptions", statistics.median(preemptions), "preemptions", 0)


if __name__ == "__main__":
    main()
