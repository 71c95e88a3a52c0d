"""The texts' worked example end to end: one trace through a paged pool and through a
contiguous one (`pagedkvd --allocator contiguous`) of the same size, with real generation (two
real pagedkvd + runner pairs, benchmarks/e2e.py).

The worked example (seeds, "A worked example"): 14 GB of KV at 800 KB a token (OPT-13B),
max_model_len 2048, blocks of 16, sequences averaging 256 tokens: a contiguous system reserving
2,048 slots per sequence fits 8 of them, a paged one about 71. Here the same pool in blocks
(14 GiB / (16 x 800 KiB) = 1,146 blocks of 16), the same max_model_len and block size, and a
trace of --requests requests whose lengths average about 256 tokens (ShareGPT's log-normal
shape, its 161:338 input:output split scaled to a 256-token mean), greedy, exactly their output
length; all submitted at once, or Poisson arrivals with --rate. The model is a tiny random one,
so the KV of a block is far smaller than OPT-13B's, but the pool holds the same 18,336 slots.

Paged: the engine admits by the daemon's free blocks and preempts when running sequences
outgrow the pool (vLLM's policy, watermark 1%). Contiguous: each sequence reserves max_model_len
slots; the engine admits by whole reservations (the daemon reports their size) with no
watermark, and never preempts. Both pairs are up at once; the runs alternate.

Figures (medians over --rounds): e2e_peak_seqs_paged / _contiguous (most sequences one step
computed together), e2e_saturated_seqs_paged / _contiguous (sequences per step, averaged over
the steps after which requests still waited: the pool's capacity in a live system, the analog
of the texts' count), e2e_mean_seqs_paged / _contiguous (over all steps), e2e_concurrency_ratio
(peaks, paged / contiguous; texts: 71 vs 8, ~9x), e2e_saturated_ratio (the same for the
saturated means), e2e_tok_s_paged / _contiguous (generated tokens per second, first arrival to
last answer) and e2e_throughput_ratio (paged / contiguous; the vLLM paper: 2-4x over systems
without paging), e2e_saturated_tok_s_paged / _contiguous and e2e_saturated_throughput_ratio
(the same over the steps planned while requests waited: the pool-bound part of the run, without
the tail where the longest requests finish alone), e2e_preemptions_paged / _contiguous.
Usage: python benchmarks/bench_e2e_concurrency.py [--requests 240] [--rate R] [--rounds 2]
       [--quick]
"""

import argparse
import asyncio
import statistics

from e2e import (
    VOCAB,
    TraceRun,
    add_quick_flag,
    figure,
    greedy,
    jobs_from_trace,
    run_trace,
    serving,
)

from pagedkv.client.engine.scheduler import SchedulerConfig

from traces import TraceSpec, make_trace

MAX_MODEL_LEN = 2048
NUM_BLOCKS = 1146
# ShareGPT's input:output split (161:338) scaled to the worked example's 256-token mean.
WORKED = TraceSpec("worked", 82.6, 173.4)


def contiguous_args(max_model_len: int) -> list[str]:
    """The daemon flags of the contiguous baseline."""
    return ["--allocator", "contiguous", "--max-model-len", str(max_model_len)]


def contiguous_config() -> SchedulerConfig:
    """The engine's settings on the contiguous pool: no watermark. Sequences grow inside their
    reservations, never into free blocks, and the daemon reports free blocks in whole
    reservations, so any watermark would keep one reservation idle (7 sequences instead of 8)."""
    return SchedulerConfig(watermark=0.0)


def report(name: str, runs: list[TraceRun]) -> float:
    """Print one allocator's figures (medians over rounds); return its tok/s."""
    figure(f"e2e_peak_seqs_{name}", statistics.median(r.peak_batch for r in runs), "seqs", 0)
    figure(f"e2e_saturated_seqs_{name}", statistics.median(r.saturated_batch for r in runs),
           "seqs", 1)
    figure(f"e2e_mean_seqs_{name}", statistics.median(r.mean_batch for r in runs), "seqs", 1)
    tok_s = statistics.median(r.tok_s for r in runs)
    figure(f"e2e_tok_s_{name}", tok_s, "tok/s", 1)
    figure(f"e2e_saturated_tok_s_{name}", statistics.median(r.saturated_tok_s for r in runs),
           "tok/s", 1)
    figure(f"e2e_preemptions_{name}", statistics.median(r.num_preemptions for r in runs),
           "preemptions", 0)
    return tok_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (default: all "
                                                     "at once)")
    parser.add_argument("--rounds", type=int, default=2)
    add_quick_flag(parser)
    args = parser.parse_args()
    requests, max_model_len, num_blocks, rounds = (args.requests, MAX_MODEL_LEN, NUM_BLOCKS,
                                                   args.rounds)
    if args.quick:  # pool and reservation 16x smaller (8 reservations fit), lengths clipped
        requests, max_model_len, num_blocks, rounds = 24, 128, 71, 1
    trace = make_trace(WORKED, requests, max_model_len, VOCAB)
    jobs = jobs_from_trace(trace, greedy, args.rate)
    mean_len = statistics.mean(len(r.prompt) + r.output_len for r in trace)
    figure("e2e_trace_mean_len", mean_len, "tokens", 1)
    runs: dict[str, list[TraceRun]] = {"paged": [], "contiguous": []}
    with serving(num_blocks) as paged, \
            serving(num_blocks, *contiguous_args(max_model_len)) as contiguous:
        for _ in range(rounds):
            runs["paged"].append(asyncio.run(run_trace(paged, jobs)))
            runs["contiguous"].append(asyncio.run(run_trace(contiguous, jobs,
                                                            contiguous_config())))
    paged_tok_s = report("paged", runs["paged"])
    contiguous_tok_s = report("contiguous", runs["contiguous"])
    peaks = [statistics.median(r.peak_batch for r in runs[name])
             for name in ("paged", "contiguous")]
    figure("e2e_concurrency_ratio", peaks[0] / peaks[1], "ratio", 2)
    saturated = [statistics.median(r.saturated_batch for r in runs[name])
                 for name in ("paged", "contiguous")]
    figure("e2e_saturated_ratio", saturated[0] / saturated[1], "ratio", 2)
    figure("e2e_throughput_ratio", paged_tok_s / contiguous_tok_s, "ratio", 2)
    saturated_tok_s = [statistics.median(r.saturated_tok_s for r in runs[name])
                       for name in ("paged", "contiguous")]
    figure("e2e_saturated_throughput_ratio", saturated_tok_s[0] / saturated_tok_s[1], "ratio", 2)


if __name__ == "__main__":
    main()
