"""Prometheus metrics and HTTP probes: /metrics, /healthz, /readyz on --metrics-listen.

Pool figures are read from the service when Prometheus scrapes (a custom collector), so there
is no polling loop and a scrape always sees the pool as it is. The scrape runs on the event
loop, the same thread as every pool operation, so it needs no lock. Names follow vLLM's where
the figure is the same (`vllm:kv_cache_usage_perc` is `pagedkv:kv_cache_usage_perc` here), so
existing dashboards carry over.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.core.types import PoolStats
from pagedkv.daemon.events.sink import EventCounts
from pagedkv.daemon.service.fence import RunnerProcesses
from pagedkv.daemon.service.models import ModelFigures
from pagedkv.daemon.service.tenants import TenantFigures

# RPCs take tens of microseconds to milliseconds; the top buckets catch a stalled loop.
RPC_LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0,
)


class PoolFigures(Protocol):
    """What the collector reads from the pool service (PoolService provides it)."""

    def pool_stats(self) -> PoolStats: ...

    @property
    def num_sessions(self) -> int: ...

    @property
    def lease_expiries_total(self) -> int: ...

    def tenant_figures(self) -> list[TenantFigures]: ...

    def model_figures(self) -> list[ModelFigures]: ...

    @property
    def page_moves_total(self) -> int: ...

    @property
    def host_tier(self) -> HostTier | None: ...

    @property
    def runner_processes(self) -> RunnerProcesses: ...


class PoolCollector(Collector):
    """Turns one PoolStats snapshot per scrape into metric families."""

    def __init__(self, figures: PoolFigures) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        stats = self._figures.pool_stats()
        yield GaugeMetricFamily(
            "pagedkv:kv_cache_usage_perc",
            "KV-cache usage: used blocks / all blocks (1 means 100 percent).",
            value=stats.used_blocks / stats.num_blocks,
        )
        yield CounterMetricFamily(
            "pagedkv:prefix_cache_queries",
            "Prefix-cache lookups, in tokens offered for reuse.",
            value=stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "pagedkv:prefix_cache_hits",
            "Prefix-cache hits, in tokens found cached.",
            value=stats.prefix_cache_hits,
        )
        for name, value, text in (
            ("num_blocks", stats.num_blocks, "Physical blocks in the pool."),
            ("free_blocks", stats.free_blocks, "Blocks an allocation could take now "
             "(contiguous: free blocks in runs that hold whole reservations)."),
            ("used_blocks", stats.used_blocks, "Blocks referenced (contiguous: reserved) by a "
             "live sequence."),
            ("cached_blocks", stats.cached_blocks, "Evictable cached blocks (part of free)."),
            ("pending_blocks", stats.pending_blocks,
             "Full blocks not yet committed (K/V not certified written; never shared)."),
            ("num_sequences", stats.num_sequences, "Live sequences."),
            ("num_sessions", self._figures.num_sessions, "Open sessions."),
        ):
            yield GaugeMetricFamily(f"pagedkv:{name}", text, value=value)
        if stats.allocated_slots:  # no figure, not a vacuous 1.0, while no slot is allocated
            yield GaugeMetricFamily(
                "pagedkv:kv_cache_slot_fill_ratio",
                "Filled token slots / slots of used blocks (internal fragmentation is 1 - this); "
                "absent while no block is used. The share of blocks in use is "
                "kv_cache_usage_perc.",
                value=stats.utilization,
            )
        yield CounterMetricFamily(
            "pagedkv:lease_expiries",
            "Sessions closed by the daemon because their lease ran out.",
            value=self._figures.lease_expiries_total,
        )
        yield from _tenant_families(self._figures.tenant_figures())
        yield from _model_families(self._figures.model_figures())
        yield CounterMetricFamily(
            "pagedkv:page_moves",
            "Pages of the pool given to another model format (each zeroed).",
            value=self._figures.page_moves_total,
        )
        fences = self._figures.runner_processes.counts
        yield CounterMetricFamily(
            "pagedkv:runner_fences",
            "Runners killed because a hold of theirs lapsed while its blocks were needed "
            "(kvpool.proto, \"Runner holds\").",
            value=fences.fenced,
        )
        yield CounterMetricFamily(
            "pagedkv:runner_fences_refused",
            "Runners the kernel would not let the daemon kill: their lapsed holds stay.",
            value=fences.refused,
        )
        if self._figures.host_tier is not None:
            yield from _host_families(self._figures.host_tier)


def _host_families(tier: HostTier) -> Iterator[Metric]:
    """The host tier's figures (kvpool.proto, "The host-memory tier")."""
    yield GaugeMetricFamily("pagedkv:host_tier_blocks", "Blocks the host tier holds at most.",
                            value=tier.num_slots)
    yield GaugeMetricFamily("pagedkv:host_tier_used_blocks", "Host-tier slots holding a copy "
                            "of an evicted committed block.", value=tier.num_held)
    yield CounterMetricFamily("pagedkv:host_tier_stores", "Evicted committed blocks copied to "
                              "the host tier.", value=tier.stores)
    yield CounterMetricFamily("pagedkv:host_tier_restores", "Blocks restored from the host tier "
                              "by a prefix hit (counted in prefix_cache_hits too).",
                              value=tier.restores)


class EventCollector(Collector):
    """The KV-event publisher's figures (daemon/events/), read per scrape."""

    def __init__(self, counts: Callable[[], EventCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        for name, text, value in (
            ("kv_events_sent", "KV-event batches published.", counts.sent),
            ("kv_events_dropped", "KV-event batches dropped because the queue to the sending "
             "thread was full (each model that lost one then gets AllBlocksCleared).",
             counts.dropped),
            ("kv_event_batches_replayed", "KV-event batches sent again to replay requests.",
             counts.replayed),
            ("kv_event_snapshots", "KV-event snapshots answered in full.", counts.snapshots),
        ):
            yield CounterMetricFamily(f"pagedkv:{name}", text, value=value)


# Per-tenant gauges: (metric name, help, the TenantFigures field).
_TENANT_GAUGES = (
    ("tenant_sessions", "Open sessions of the tenant.", "sessions"),
    ("tenant_max_sessions", "The tenant's cap on open sessions (0 = none).", "max_sessions"),
    ("tenant_blocks_held", "Distinct blocks the tenant's sequences reference.", "blocks_held"),
    ("tenant_block_table_entries",
     "Block-table entries over the tenant's sessions (what max_blocks bounds).",
     "block_table_entries"),
    ("tenant_max_blocks", "The tenant's cap on block-table entries (0 = none).", "max_blocks"),
)


def _tenant_families(figures: list[TenantFigures]) -> Iterator[Metric]:
    """One gauge family per figure, one sample per tenant (label `tenant`)."""
    for name, text, attribute in _TENANT_GAUGES:
        family = GaugeMetricFamily(f"pagedkv:{name}", text, labels=["tenant"])
        for tenant in figures:
            family.add_metric([tenant.name], getattr(tenant, attribute))
        yield family


def _model_families(figures: list[ModelFigures]) -> Iterator[Metric]:
    """Per-model gauges (label `model_name`, as vLLM names the model on its series) and pages
    per format (label `format`)."""
    used = GaugeMetricFamily("pagedkv:model_used_blocks", "Distinct blocks the model's "
                             "sessions hold (blocks of its format).", labels=["model_name"])
    cached = GaugeMetricFamily("pagedkv:model_cached_blocks", "Committed cached blocks the "
                               "model left in its format's prefix cache.", labels=["model_name"])
    memory = GaugeMetricFamily("pagedkv:model_memory_bytes", "The model's memory: used and "
                               "cached blocks, in bytes (what max_memory caps).",
                               labels=["model_name"])
    pages = GaugeMetricFamily("pagedkv:format_pages", "Pages a format (one K/V geometry, "
                              "shared by the models of that geometry) holds.", labels=["format"])
    formats: dict[str, int] = {}
    for figure in figures:
        name, fmt = figure.model.name, figure.model.format
        used.add_metric([name], figure.used_blocks)
        cached.add_metric([name], figure.cached_blocks)
        memory.add_metric([name], (figure.used_blocks + figure.cached_blocks)
                          * fmt.bytes_per_block)
        formats[fmt.shape.label] = figure.format_pages
    for label, count in formats.items():
        pages.add_metric([label], count)
    yield from (used, cached, memory, pages)


class RpcMetrics:
    """Per-method RPC latency and outcome counts, fed by the gRPC interceptor."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._latency = prometheus_client.Histogram(
            "pagedkv:rpc_duration_seconds", "Time from RPC start to its answer.",
            ["service", "method"], registry=registry, buckets=RPC_LATENCY_BUCKETS_S,
        )
        self._calls = prometheus_client.Counter(
            "pagedkv:rpc_requests", "Finished RPCs by status code.",
            ["service", "method", "code"], registry=registry,
        )

        # A stream's messages (KVPool.StepStream), each an answered call of its own kind.
        self._message_latency = prometheus_client.Histogram(
            "pagedkv:stream_message_duration_seconds",
            "Time from a stream message's parse to its answer.",
            ["service", "method"], registry=registry, buckets=RPC_LATENCY_BUCKETS_S,
        )
        self._messages = prometheus_client.Counter(
            "pagedkv:stream_messages", "Answered messages of request streams, by the status "
            "code each answer carries.", ["service", "method", "code"], registry=registry,
        )

    def observe(self, service: str, method: str, code: str, seconds: float) -> None:
        self._latency.labels(service, method).observe(seconds)
        self._calls.labels(service, method, code).inc()

    def observe_message(self, service: str, method: str, code: str, seconds: float) -> None:
        self._message_latency.labels(service, method).observe(seconds)
        self._messages.labels(service, method, code).inc()


@dataclass
class Readiness:
    """What /readyz reports; the server flips these as it starts and stops."""

    # The pool memory and the block pool exist.
    pool_allocated: bool = False
    # Every gRPC listener is bound and the server started.
    listeners_up: bool = False
    # SIGTERM arrived: no new work should be routed here.
    draining: bool = False

    def reason_not_ready(self) -> str | None:
        if self.draining:
            return "draining"
        if not self.pool_allocated:
            return "pool not allocated"
        if not self.listeners_up:
            return "listeners not up"
        return None
