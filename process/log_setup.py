"""One logging setup for every pagedkv process (daemon, runner): structlog events and stdlib
records, one renderer.

A person at a terminal gets colored console lines; journald gets one JSON object per line
(`journalctl -u pagedkvd -o cat | jq`). Records from libraries that use stdlib logging (grpc,
aiohttp) pass through the same processors, so every line has the same shape.
"""

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Literal, TextIO

import structlog

LogFormat = Literal["json", "console", "auto"]
LOG_FORMATS: tuple[LogFormat, ...] = ("json", "console", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# At most one log line per this many seconds about each kind of event a hostile peer can repeat
# at will (requests that do not parse, calls without a valid token, refused connections).
HOSTILE_LOG_INTERVAL_S = 10.0
# The logger of gRPC's cython layer, held at info or above (`configure`).
GRPC_CYTHON_LOGGER = "grpc._cython.cygrpc"


def resolve_format(fmt: LogFormat, stream: TextIO) -> Literal["json", "console"]:
    """"auto" means console on a terminal and JSON anywhere else (journald, a file, a pipe)."""
    if fmt == "auto":
        return "console" if stream.isatty() else "json"
    return fmt


def _shared_processors() -> list[Any]:
    """Processors run on structlog events and on stdlib records alike, before rendering."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def configure(level: str = "info", fmt: LogFormat = "auto", stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to `stream` (stderr) at `level` in format `fmt`.

    Safe to call again (tests, a second `serve`): the root handler is replaced, not added.
    """
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(LOG_LEVELS)}")
    out = sys.stderr if stream is None else stream
    final: list[Any]
    if resolve_format(fmt, out) == "json":
        # Tracebacks as data, without frame locals: they could hold the auth token.
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        final = [tracebacks, structlog.processors.JSONRenderer()]
    else:
        final = [structlog.dev.ConsoleRenderer(colors=out.isatty())]

    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_shared_processors(),
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    # gRPC's cython layer logs a debug line per call ("Loaded running loop"): at debug level it
    # drowned the process's own lines (77 of the daemon's 116). Its warnings and errors stay.
    logging.getLogger(GRPC_CYTHON_LOGGER).setLevel(max(logging.INFO, root.level))

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_shared_processors(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger named like a stdlib one (the module's __name__)."""
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger


class RateLimitedLog:
    """Says when to log an event that may repeat at any rate: the first time, then at most
    once per interval, with how many happened since the last line."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        # Shortest time between two lines.
        self.interval_s = interval_s
        self._clock = clock
        # Events since the last line, and when that line was written (None: never).
        self._count = 0
        self._last: float | None = None

    def event(self) -> int | None:
        """Count one event; returns how many to report if a line is due now, else None."""
        self._count += 1
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return None
        count, self._count, self._last = self._count, 0, now
        return count
