"""GetStats and /metrics at a million block-table entries: kept figures vs a recount.

One session holds PARENTS x FORKS sequences sharing TABLE_BLOCKS blocks each (forks), so the
pool holds a million table entries over few blocks, as in issue 17's probe. Both run on the
daemon's event loop, so what they cost is what every other client waits:

    figures_table_entries          entries held
    get_stats_ms                   the caller's session figures (PoolService.stats_of), as kept
    get_stats_recount_ms           the same figure recounted from the tables (before issue 17)
    metrics_ms                     one /metrics scrape body (prometheus generate_latest over the
                                   daemon's collector), as kept
    metrics_recount_ms             the same scrape with every figure recounted from the tables
    get_stats_speedup, metrics_speedup   recount / kept

Medians of REPEATS calls. Usage: python benchmarks/bench_figures.py
"""

import asyncio
import statistics
import time
from collections.abc import Callable

import prometheus_client
from prometheus_client.registry import CollectorRegistry

from pagedkv.daemon.core import BlockPool, PoolStats
from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.edge.metrics import PoolCollector
from pagedkv.daemon.service.fence import RunnerProcesses
from pagedkv.daemon.service.models import ModelFigures
from pagedkv.daemon.service.operations import Allocate, Fork
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.tenants import TenantFigures

BLOCK_SIZE = 16
TABLE_BLOCKS = 10_000
PARENTS = 1
FORKS = 100
REPEATS = 9


class Recounted:
    """The collector's figures recounted from every table entry, as before issue 17."""

    def __init__(self, service: PoolService) -> None:
        self._service = service

    def pool_stats(self) -> PoolStats:
        return self._service.pool._recount_stats()

    @property
    def num_sessions(self) -> int:
        return self._service.num_sessions

    @property
    def lease_expiries_total(self) -> int:
        return self._service.lease_expiries_total

    def tenant_figures(self) -> list[TenantFigures]:
        service = self._service
        usage = service._usage
        return usage.figures(service.tenants, lambda name: service.figures.recount_held(
            usage.sessions.get(name, ())))

    def model_figures(self) -> list[ModelFigures]:
        return self._service.model_figures()

    @property
    def page_moves_total(self) -> int:
        return self._service.page_moves_total

    @property
    def host_tier(self) -> HostTier | None:
        return self._service.host_tier

    @property
    def runner_processes(self) -> RunnerProcesses:
        return self._service.runner_processes


async def loaded_service() -> tuple[PoolService, str]:
    service = PoolService(BlockPool(TABLE_BLOCKS * PARENTS + 64, BLOCK_SIZE), None,
                          pool_id="figures")
    sid = service.open_session("bench").session_id
    for parent in range(PARENTS):
        await service.allocate(sid, Allocate(parent, TABLE_BLOCKS * BLOCK_SIZE - 1))
        for child in range(FORKS - 1):
            await service.fork(sid, Fork(parent, PARENTS + parent * FORKS + child))
    return service, sid


def median_ms(call: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def scrape(collector: PoolCollector) -> Callable[[], bytes]:
    registry = CollectorRegistry()
    registry.register(collector)
    return lambda: prometheus_client.generate_latest(registry)


def main() -> None:
    service, sid = asyncio.run(loaded_service())
    session = service.sessions.get(sid)
    entries = service.stats_of(sid).block_table_entries
    kept = median_ms(lambda: service.stats_of(sid))
    recount = median_ms(lambda: service.figures.recount_held([session]))
    metrics = median_ms(scrape(PoolCollector(service)))
    metrics_recount = median_ms(scrape(PoolCollector(Recounted(service))))
    print(f"figures_table_entries: {entries} entries")
    print(f"get_stats_ms: {kept:.3f} ms")
    print(f"get_stats_recount_ms: {recount:.3f} ms")
    print(f"metrics_ms: {metrics:.3f} ms")
    print(f"metrics_recount_ms: {metrics_recount:.3f} ms")
    print(f"get_stats_speedup: {recount / kept:.0f} ratio")
    print(f"metrics_speedup: {metrics_recount / metrics:.0f} ratio")


if __name__ == "__main__":
    main()
