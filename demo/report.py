"""The demo's report and chart: the paged run's figures, the contiguous run's beside them.

Where each figure comes from:
- requests, tokens, preemptions, prefix-cache lookups: what each client's engine and session
  reported (`WorkerResult`);
- peak concurrent sequences, KV utilization, blocks saved by sharing: the daemon's /metrics
  sampled during the run (`PoolSample`): pool-wide, so both clients' sequences count together
  and a block they share counts once; a peak shorter than the sampling period may be missed.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.demo.runs import RunResult
from pagedkv.demo.svg_chart import Series, line_chart
from pagedkv.demo.workload import BLOCK_SIZE, KINDS, MODEL, NUM_WORKERS, SYSTEM_PROMPT

# How the report names each kind of request.
KIND_NAMES = {"plain": "plain", "parallel": "parallel sampling n=4", "beam": "beam width 4",
              "system": f"on a shared {len(SYSTEM_PROMPT)}-token system prompt"}
# Width of the report's label column.
LABEL_WIDTH = 27


@dataclass(frozen=True, slots=True)
class Figures:
    """What one run measured."""

    num_requests: int
    wall_s: float
    generated_tokens: int
    # The most sequences the daemon held at once.
    peak_seqs: int
    # Used / total blocks: the largest and the mean over the run's samples.
    peak_used: float
    mean_used: float
    # Mean over samples with used blocks of the fraction of their slots filled.
    mean_filled: float
    # Mean over samples with block-table entries of 1 - blocks held / entries.
    sharing_saved: float
    # Prompt tokens, and of them served by the prefix cache, at each request's first admission.
    prompt_tokens: int
    cached_tokens: int
    # Prefix-cache lookups and hits in tokens, re-admissions after a preemption included.
    prefix_queries: int
    prefix_hits: int
    preemptions: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


def figures(run: RunResult) -> Figures:
    workers = run.workers
    samples = [s for s in run.samples if run.started_s <= s.time_s <= run.finished_s]
    used = [s.used_blocks / s.num_blocks for s in samples] or [0.0]
    shared = [1 - s.blocks_held / s.block_table_entries for s in samples
              if s.block_table_entries]
    return Figures(
        num_requests=sum(len(w.requests) for w in workers),
        wall_s=run.finished_s - run.started_s,
        generated_tokens=sum(r.generated_tokens for w in workers for r in w.requests),
        peak_seqs=max((s.num_sequences for s in samples), default=0),
        peak_used=max(used), mean_used=sum(used) / len(used),
        mean_filled=_mean([s.filled for s in samples if s.used_blocks]),
        sharing_saved=_mean(shared),
        prompt_tokens=sum(r.prompt_tokens for w in workers for r in w.requests),
        cached_tokens=sum(r.cached_tokens for w in workers for r in w.requests),
        prefix_queries=sum(w.prefix_cache_queries for w in workers),
        prefix_hits=sum(w.prefix_cache_hits for w in workers),
        preemptions=sum(w.preemptions for w in workers))


def report(paged: RunResult, contiguous: RunResult) -> str:
    """The report's text: the paged run, then the contiguous run beside it."""
    p, c = figures(paged), figures(contiguous)
    kinds = Counter(r.kind for w in paged.workers for r in w.requests)
    return "\n".join([
        f"pagedkv demo: {NUM_WORKERS} client processes, one pagedkvd, one runner "
        f"({MODEL!r} model, random weights, CPU)",
        f"pool: {paged.stack.num_blocks} blocks x {BLOCK_SIZE} tokens; workload: "
        + ", ".join(f"{kinds[kind]} {KIND_NAMES[kind]}" for kind in KINDS),
        "",
        _line("requests", f"{p.num_requests} in {p.wall_s:.1f} s"),
        _line("tokens per second", f"{p.tokens_per_s:,.0f} ({p.generated_tokens:,} tokens "
                                   "generated)"),
        _line("peak concurrent sequences", f"{p.peak_seqs}"),
        _utilization(p, paged.stack.num_blocks),
        _line("blocks saved by sharing", f"{p.sharing_saved:.0%} (1 - blocks held / "
                                         "block-table entries, mean over the run)"),
        _line("prefix-cache hit rate", f"{_ratio(p.cached_tokens, p.prompt_tokens):.0%} of "
                                       f"prompt tokens ({p.cached_tokens:,} of "
                                       f"{p.prompt_tokens:,}); "
                                       f"{_ratio(p.prefix_hits, p.prefix_queries):.0%} with "
                                       "re-admissions after preemption"),
        _line("preemptions", f"{p.preemptions}"),
        "",
        f"the same workload, contiguous max-length reservation "
        f"({contiguous.stack.max_model_len} tokens a sequence):",
        _line("peak concurrent sequences", f"{c.peak_seqs} (paged: {p.peak_seqs}, "
                                           f"{_ratio(p.peak_seqs, c.peak_seqs):.1f}x)"),
        _utilization(c, contiguous.stack.num_blocks),
        _line("requests", f"{c.num_requests} in {c.wall_s:.1f} s ({c.tokens_per_s:,.0f} "
                          "tokens per second)"),
        _line("preemptions", f"{c.preemptions} (each fork of a sample or a beam needs a whole "
                             "reservation)"),
    ]) + "\n"


def chart(runs: Sequence[RunResult]) -> str:
    """KV blocks used over each run's time, one line per run."""
    return line_chart(
        [Series(run.stack.allocator, [(s.time_s - run.started_s, s.used_blocks)
                                      for s in run.samples if s.time_s >= run.started_s])
         for run in runs],
        title="KV blocks used over time, same workload", x_label="seconds since start",
        y_label="blocks used (dashed: the pool)",
        y_limit=max(run.stack.num_blocks for run in runs))


def _utilization(run: Figures, num_blocks: int) -> str:
    return _line("KV utilization", f"peak {run.peak_used:.0%}, mean {run.mean_used:.0%} of "
                                   f"{num_blocks} blocks in use; {run.mean_filled:.0%} of their "
                                   "slots filled (mean)")


def _line(label: str, value: str) -> str:
    return f"{label + ':':<{LABEL_WIDTH}}{value}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0
