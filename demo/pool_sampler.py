"""The pool over time as an operator sees it: the daemon's /metrics, sampled while a run lasts.

A client's GetStats shows only its own session; blocks used by every session, and the distinct
blocks behind all the block-table entries (sharing across sessions included), are pool-wide
figures on /metrics (daemon/edge/metrics.py). The demo's clients all connect as one user
through the unix socket, so they are one tenant's, and that tenant's gauges cover every one of them.
"""

import threading
import time
import urllib.request
from dataclasses import dataclass
from types import TracebackType
from typing import Self

# Seconds between two scrapes: fine enough for runs of seconds, while each scrape (the daemon
# renders every figure) stays a small part of the daemon's time.
PERIOD_S = 0.1


class ScrapeFailed(RuntimeError):
    """/metrics did not answer during the run (the daemon is gone)."""


@dataclass(frozen=True, slots=True)
class PoolSample:
    """One scrape of the pool."""

    # time.monotonic() when the answer arrived.
    time_s: float
    num_blocks: int
    # Blocks referenced by a live sequence (contiguous: reserved by one), and the fraction of
    # their token slots filled (1 - internal fragmentation).
    used_blocks: int
    filled: float
    num_sequences: int
    # Over every session: block-table entries, and the distinct blocks they name.
    block_table_entries: int
    blocks_held: int


def scrape(address: str, timeout: float = 5.0) -> dict[str, float]:
    """Every sample of http://`address`/metrics (host:port), by its name with labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as answer:
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def sample(address: str) -> PoolSample:
    """The pool now, from one scrape."""
    samples = scrape(address)

    def tenants_total(name: str) -> int:
        return int(sum(v for k, v in samples.items() if k.startswith(f"pagedkv:{name}{{")))

    return PoolSample(time.monotonic(), int(samples["pagedkv:num_blocks"]),
                      int(samples["pagedkv:used_blocks"]),
                      samples.get("pagedkv:kv_cache_slot_fill_ratio", 0.0),
                      int(samples["pagedkv:num_sequences"]),
                      tenants_total("tenant_block_table_entries"),
                      tenants_total("tenant_blocks_held"))


class PoolSampler:
    """Samples the pool every PERIOD_S on a thread, from `with` to its end."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.samples: list[PoolSample] = []
        # What stopped the thread early (a failed scrape), reported at the end.
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-sampler", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.samples.append(sample(self.address))
                self._stop.wait(PERIOD_S)
        except Exception as error:  # no answer, or not the daemon's figures: the run fails
            self._error = error

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None and exc is None:
            raise ScrapeFailed(f"reading {self.address}/metrics failed: {self._error}")
