"""The pool-wide figures of a daemon, read from its /metrics as an operator would: GetStats
shows a client only the pool's capacity and its own session (ops/OPERATIONS.md)."""

import urllib.request

from pagedkv.proto import kvpool_pb2 as pb

# PoolStats field <- metric name on /metrics.
_METRICS = {
    "num_blocks": "pagedkv:num_blocks", "free_blocks": "pagedkv:free_blocks",
    "used_blocks": "pagedkv:used_blocks", "cached_blocks": "pagedkv:cached_blocks",
    "pending_blocks": "pagedkv:pending_blocks", "num_sequences": "pagedkv:num_sequences",
    "num_sessions": "pagedkv:num_sessions",
    "prefix_cache_queries": "pagedkv:prefix_cache_queries_total",
    "prefix_cache_hits": "pagedkv:prefix_cache_hits_total",
}


def pool_figures(metrics: str, timeout: float = 10.0) -> pb.PoolStats:
    """Scrape http://`metrics`/metrics (host:port) into a PoolStats with the fields above."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=timeout) as answer:
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            samples[name] = value
    stats = pb.PoolStats()
    for field, metric in _METRICS.items():
        setattr(stats, field, int(float(samples[metric])))
    return stats
