"""The demo's report and chart: the paged run's figures, the contiguous run's beside them.

Where each figure comes from:
- requests, tokens, preemptions, prefix-cache lookups: what each client's engine and session
  reported (`WorkerResult`);
- peak concurrent sequences, KV utilization, blocks saved by sharing: the daemon's /metrics
  sampled during the run (`PoolSample`): pool-wide, so both clients' sequences count together
  and a block they share counts once; a peak shorter than the sampling period may be missed.

The chart shows why paging wins, from the same samples: beside the blocks used, the sequences
the daemon holds (running) and the token slots filled in the used blocks (the slots of the used
blocks times the fill ratio, both of one scrape). Contiguous reservations take as many blocks,
but hold fewer sequences and fill fewer of their slots.
"""

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.demo.pool_sampler import PoolSample
from pagedkv.demo.runs import RunResult
from pagedkv.demo.svg_chart import Panel, Series, line_charts
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
    samples = _in_run(run)
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
    """Blocks used, running sequences and filled token slots over each run's time: a panel
    each, one line per run."""
    num_blocks = max(run.stack.num_blocks for run in runs)
    peak_seqs = max((s.num_sequences for run in runs for s in _in_run(run)), default=0)

    def panel(title: str, y_label: str, y_limit: float,
              value: Callable[[PoolSample], float]) -> Panel:
        return Panel(title, y_label, y_limit,
                     [Series(run.stack.allocator, [(s.time_s - run.started_s, value(s))
                                                   for s in _in_run(run)]) for run in runs])

    return line_charts([
        panel("KV blocks used", "blocks (dashed: the pool)", num_blocks,
              lambda s: s.used_blocks),
        panel("running sequences (the daemon's live sequences)", "sequences (dashed: peak)",
              max(peak_seqs, 1), lambda s: s.num_sequences),
        panel("filled token slots of the used blocks", "slots (dashed: the pool)",
              num_blocks * BLOCK_SIZE, filled_slots)],
        title="Same workload: paged holds more sequences and fills the slots it uses",
        x_label="seconds since start")


def filled_slots(sample: PoolSample) -> int:
    """Token slots holding a token in the used blocks: their slots times the fill ratio (one
    scrape of the daemon's used_blocks and kv_cache_slot_fill_ratio)."""
    return round(sample.used_blocks * BLOCK_SIZE * sample.filled)


def _in_run(run: RunResult) -> list[PoolSample]:
    """The samples taken from the clients' start to their end."""
    return [s for s in run.samples if run.started_s <= s.time_s <= run.finished_s]


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
