"""The server's /metrics: the engine's figures under vLLM's names, `pagedkv:` for `vllm:`.

Every series carries `model_name="<served name>"`, as vLLM labels its own, so a dashboard built
for `vllm serve` (ops/grafana/pagedkv.json is one) reads the same series here: requests running
and waiting, KV usage, prefix-cache queries and hits (in tokens, as vLLM counts them),
preemptions, prompt and generation tokens, time to first token, inter-token latency and
end-to-end latency histograms, finished requests by reason. Gauges are read from the engine at
scrape time; counters and histograms are fed by the request streams (backend.py), from the
engine that is current (a daemon's restart opens a new one: server/recovery.py); a stopped
engine runs nothing. Runner and daemon restarts come from their supervisors, when the server
started them.

The KV usage is the pool's, read from the daemon when /metrics is scraped (`refresh`): the free
blocks an engine's answers carry stay as they were while the runner steps into reserved slots,
while the engine is idle (after an abort), and for every engine but the one that made the call
(a server with API keys has one per cache group).
"""

import asyncio
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.client.pool.errors import PagedKVError
from pagedkv.server.key_engines import KeyEngines

PREFIX = "pagedkv:"
# The label naming the served model on every series (vLLM's).
MODEL_LABEL = "model_name"
# vLLM's buckets (seconds) for time to first token and inter-token latency.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
               120.0)


class ServerMetrics:
    """Series of one server, in their own registry (a test may run several servers).

    `cache_figures=False` (a server with API keys) leaves out the prefix-cache queries and hits:
    /metrics needs no key, and the hits counted after one request say how much of its prompt
    some earlier request cached, a figure only its own key may see (its usage says it)."""

    def __init__(self, model_name: str, cache_figures: bool = True) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The served name: the value of every series' model_name label.
        self.model_name = model_name
        # Only with cache_figures: else their counters are in no registry, never served.
        cache_registry = r if cache_figures else None
        label = (MODEL_LABEL,)
        # Each series is its model_name child: the one sample /metrics serves.
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests being computed.",
                             label, registry=r).labels(model_name)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting for room.",
                             label, registry=r).labels(model_name)
        self.kv_usage = Gauge(f"{PREFIX}kv_cache_usage_perc",
                              "Share of the KV pool's blocks in use (1 = full).", label,
                              registry=r).labels(model_name)
        self.runner_restarts = Gauge(f"{PREFIX}runner_restarts",
                                     "Times the supervisor restarted the runner.", label,
                                     registry=r).labels(model_name)
        self.daemon_restarts = Gauge(f"{PREFIX}daemon_restarts",
                                     "Times the supervisor restarted the daemon.", label,
                                     registry=r).labels(model_name)
        self.cache_queries = Counter(f"{PREFIX}prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.", label,
                                     registry=cache_registry).labels(model_name)
        self.cache_hits = Counter(f"{PREFIX}prefix_cache_hits",
                                  "Prompt tokens served by the prefix cache.", label,
                                  registry=cache_registry).labels(model_name)
        self.preemptions = Counter(f"{PREFIX}num_preemptions",
                                   "Preemptions of finished requests.", label,
                                   registry=r).labels(model_name)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens admitted.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.",
                                         label, registry=r).labels(model_name)
        # By finish reason too: a child per reason, made as reasons come.
        self.finished = Counter(f"{PREFIX}request_success", "Finished requests.",
                                (MODEL_LABEL, "finished_reason"), registry=r)
        self.rejected = Counter(f"{PREFIX}requests_rejected",
                                "Requests refused because the queue was full.", label,
                                registry=r).labels(model_name)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Arrival to the first generated token.", label,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds",
                             "Time between two steps that generated tokens of a request.",
                             label, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Arrival to the last token.", label, buckets=E2E_BUCKETS,
                             registry=r).labels(model_name)
        # The engine of the moment (set by `watch`): its daemon is asked for the KV usage.
        self._engine: Callable[[], Engine] | None = None
        # The KV usage's read in flight: scrapes arriving meanwhile wait for it, not another.
        self._usage_read: asyncio.Task[None] | None = None

    def watch(self, engine: Callable[[], Engine], runner_restarts: Callable[[], int],
              daemon_restarts: Callable[[], int]) -> None:
        """Read the gauges from the engine `engine()` returns (that of the moment) and the
        supervisors' restarts at each scrape."""
        self.running.set_function(lambda: _live(engine(), lambda e: len(e.scheduler.running)))
        self.waiting.set_function(lambda: _live(engine(), lambda e: len(e.scheduler.waiting)))
        self._engine = engine
        self.runner_restarts.set_function(runner_restarts)
        self.daemon_restarts.set_function(daemon_restarts)

    async def refresh(self) -> None:
        """Read the KV usage from the daemon before a scrape: one GetStats, shared by the
        scrapes that arrive while it is read (a flood of scrapes costs the daemon one call at a
        time)."""
        if self._usage_read is None or self._usage_read.done():
            self._usage_read = asyncio.create_task(self._read_usage())
        await asyncio.shield(self._usage_read)  # a scrape that goes does not cancel the others'

    async def _read_usage(self) -> None:
        if self._engine is None:
            return
        engine = self._engine()
        if engine.failure() is not None:  # a stopped engine runs nothing
            self.kv_usage.set(0.0)
            return
        try:
            self.kv_usage.set(await engine.kv_usage())
        except PagedKVError:
            return  # the daemon is away (its restart: server/recovery.py): the last read stays

    def watch_keys(self, engines: KeyEngines) -> None:
        """Read the requests running and waiting from every cache group's engine."""
        self.running.set_function(engines.running)
        self.waiting.set_function(lambda: len(engines.queue))

    def arrived(self, prompt_len: int) -> None:
        self.prompt_tokens.inc(prompt_len)

    def refused(self) -> None:
        self.rejected.inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, count: int, since_last_s: float | None) -> None:
        """`count` new tokens of a request; the time since its last ones (None: its first)."""
        self.generation_tokens.inc(count)
        if since_last_s is not None:
            self.itl.observe(since_last_s)

    def done(self, output: RequestOutput, reasons: list[str], seconds: float) -> None:
        """A request that ended (`reasons`: its choices' finish reasons, "abort" for one cut
        short): its cache figures, preemptions, reasons and latency."""
        self.cache_queries.inc(output.num_prompt_tokens)
        self.cache_hits.inc(output.num_cached_tokens)
        self.preemptions.inc(output.num_preemptions)
        for reason in reasons:
            self.finished.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)


def _live(engine: Engine, figure: Callable[[Engine], float]) -> float:
    """`figure` of `engine`, 0 once it stopped (its scheduler's lists are what it had then)."""
    return figure(engine) if engine.failure() is None else 0.0
