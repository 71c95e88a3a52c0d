"""HTTP probes of a pagedkv process: /metrics (Prometheus text), /healthz and /readyz.

The daemon and the runner each serve one on their --metrics-listen address, from the event loop
(no thread), so a scrape reads the process's figures as they are.
"""

from collections.abc import Callable

import prometheus_client
from aiohttp import web
from prometheus_client.registry import CollectorRegistry


def metrics_app(registry: CollectorRegistry,
                reason_not_ready: Callable[[], str | None]) -> web.Application:
    """The HTTP app: /metrics in Prometheus text format, /healthz and /readyz probes;
    `reason_not_ready()` says why the process should get no traffic, or None."""

    async def metrics(_: web.Request) -> web.Response:
        body = prometheus_client.generate_latest(registry)
        content_type = prometheus_client.CONTENT_TYPE_LATEST
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(_: web.Request) -> web.Response:
        # The process answers, so its event loop runs: that is all liveness means here.
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        reason = reason_not_ready()
        if reason is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {reason}\n")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz),
                    web.get("/readyz", readyz)])
    return app


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app` on host:port; `await runner.cleanup()` stops it."""
    # No access log: a scrape every few seconds would bury the RPC logs.
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
