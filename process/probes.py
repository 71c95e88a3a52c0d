"""HTTP probes of a pagedkv process: /metrics (Prometheus text), /healthz and /readyz.

The daemon and the runner each serve one on their --metrics-listen address, from the event loop
(no thread), so a scrape reads the process's figures as they are. Given a token, /metrics
answers only `Authorization: Bearer TOKEN` (401 otherwise, as the HTTP server's API keys do):
the daemon's names its tenants. The probes stay open: they say only up or ready, and the
kubelet calls them with no credentials.
"""

import hmac
from collections.abc import Callable

import prometheus_client
from aiohttp import web
from prometheus_client.registry import CollectorRegistry


def metrics_app(registry: CollectorRegistry, reason_not_ready: Callable[[], str | None],
                token: str | None = None) -> web.Application:
    """The HTTP app: /metrics in Prometheus text format (only for `Authorization: Bearer
    token` when `token` is given), /healthz and /readyz probes; `reason_not_ready()` says why
    the process should get no traffic, or None."""

    async def metrics(request: web.Request) -> web.Response:
        if token is not None and not _bearer_is(request, token):
            return web.Response(status=401, text="a valid token is required: Authorization: "
                                "Bearer TOKEN (metrics_token_file)\n",
                                headers={"WWW-Authenticate": "Bearer"})
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


def _bearer_is(request: web.Request, token: str) -> bool:
    """Whether the request's Authorization header is "Bearer `token`" (compared in constant
    time)."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app` on host:port; `await runner.cleanup()` stops it."""
    # No access log: a scrape every few seconds would bury the RPC logs.
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
