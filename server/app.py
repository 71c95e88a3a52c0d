"""The aiohttp application of `pagedkv serve`: OpenAI's routes over one `Backend`.

    POST /v1/completions        completions.py
    POST /v1/chat/completions   chat_completions.py
    GET  /v1/models             the served model (created: the server's start)
    POST /tokenize, /detokenize the served model's tokenizer, in vLLM's shapes (tokenizing.py)
    GET  /health                200 while the daemon, runner and engine serve; else 503, why
    GET, POST /ping             the same answer as /health, under vLLM's (SageMaker's) name
    GET  /version               {"version": pagedkv's version}
    GET  /metrics               Prometheus text (metrics.py)

Middlewares, outermost first: the access log (one structlog line per request, named by its
X-Request-Id: access_log.py), errors (every
refusal in OpenAI's JSON shape: errors.py), API keys (`Authorization: Bearer KEY` on /v1/
routes when keys are configured; /health and /metrics stay open to probes, as vLLM's do), and
a bound on the requests one client address has in progress (429), so one peer cannot take every
place in the queue.
Bodies are bounded by `client_max_size` (413), JSON must be an object (400); `model` may be
left out, as vLLM allows: it defaults to the served model's name. The app runs with
handler cancellation on: a client that disconnects cancels its handler, whose request streams
close and abort their requests.
"""

import hmac
import importlib.metadata
import json
from collections.abc import Awaitable, Callable
from typing import Any

import prometheus_client
from aiohttp import web
from aiohttp.typedefs import Middleware

from pagedkv.process.log_setup import get_logger
from pagedkv.server.access_log import ACCESS, access_log, echo_request_id
from pagedkv.server.backend import RETRY_AFTER_S, Backend
from pagedkv.server.chat_completions import create_chat_completion
from pagedkv.server.completions import create_completion
from pagedkv.server.errors import ApiError
from pagedkv.server.key_engines import API_KEY, ApiKey
from pagedkv.server.protocol import Limits
from pagedkv.server.tokenizing import detokenize, tokenize

log = get_logger("pagedkv.server")
# A request body larger than this is refused (413) before it is read whole.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# Most requests one client address may have in progress at once (0: no bound).
DEFAULT_MAX_PER_PEER = 64
BACKEND: web.AppKey[Backend] = web.AppKey("backend", Backend)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Endpoint = Callable[[web.Request, Backend, dict[str, Any], Limits],
                    Awaitable[web.StreamResponse]]


def build_app(backend: Backend, *, api_keys: tuple[ApiKey, ...] = (),
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_per_peer: int = DEFAULT_MAX_PER_PEER) -> web.Application:
    app = web.Application(client_max_size=max_request_bytes,
                          middlewares=[access_log, _errors, _api_keys(api_keys),
                                       _peer_bound(max_per_peer)])
    app[BACKEND] = backend
    app.on_response_prepare.append(echo_request_id)
    app.add_routes([web.post("/v1/completions", _endpoint(create_completion)),
                    web.post("/v1/chat/completions", _endpoint(create_chat_completion)),
                    web.post("/tokenize", _endpoint(tokenize)),
                    web.post("/detokenize", _endpoint(detokenize)),
                    web.get("/v1/models", _models), web.get("/health", _health),
                    web.get("/ping", _health), web.post("/ping", _health),
                    web.get("/version", _version), web.get("/metrics", _metrics)])
    return app


def _endpoint(create: Endpoint) -> Handler:
    """A POST route: its JSON object body and the request limits, then `create`."""

    async def handle(request: web.Request) -> web.StreamResponse:
        backend = request.app[BACKEND]
        try:
            body = await request.json()
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested deep
            raise ApiError(400, f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        if body.get("model") is None:  # vLLM's default: the one model served
            body["model"] = backend.config.model_name
        limits = Limits(backend.config.max_logprobs, backend.config.max_choices,
                        backend.engine.max_model_len, backend.config.auto_tool_parser)
        return await create(request, backend, body, limits)

    return handle


async def _models(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    root = backend.config.model_name
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": backend.started, "owned_by": "pagedkv",
        "root": root, "max_model_len": backend.engine.max_model_len}
        for name in backend.config.model_names]})


async def _health(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    reason = backend.unhealthy()
    if reason is None:
        return web.Response(text="ok\n")
    return web.Response(status=503, text=f"unhealthy: {reason}\n")


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": importlib.metadata.version("pagedkv")})


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[BACKEND].metrics
    await metrics.refresh()
    return web.Response(body=prometheus_client.generate_latest(metrics.registry),
                        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal as OpenAI's error body; a bug as a 500 in the same shape, logged."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _refusal(request, exc)
    except web.HTTPException as exc:  # aiohttp's own: 404 route, 405, 413 body too large
        if exc.status < 400:
            raise
        return _refusal(request, ApiError(exc.status, exc.reason if exc.status != 413
                                          else exc.text or ""))
    except (ConnectionResetError, OSError):  # the client went away mid-answer
        raise
    except Exception as exc:
        log.exception("http_request_failed", path=request.path)
        return _refusal(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def _refusal(request: web.Request, error: ApiError) -> web.Response:
    """`error` as OpenAI's error body; its message goes in the request's access log line."""
    request[ACCESS].error = error.message
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def _api_keys(keys: tuple[ApiKey, ...]) -> Middleware:
    """Require one of `keys` as a bearer token on /v1/ routes (none configured: open), and
    leave the key matched in request[API_KEY] (its cache group and fair share)."""
    encoded = [key.secret.encode() for key in keys]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if encoded and request.path.startswith("/v1/"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            # Compared in constant time, against every key (no early exit on a match).
            matches = [hmac.compare_digest(token.strip().encode(), key) for key in encoded]
            if scheme.lower() != "bearer" or not any(matches):
                raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                               headers={"WWW-Authenticate": "Bearer"})
            request[API_KEY] = keys[matches.index(True)]
        return await handler(request)

    return check


def _peer_bound(limit: int) -> Middleware:
    """Refuse a /v1/ request (429) from an address that has `limit` in progress already."""
    in_progress: dict[str, int] = {}

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        peer = request.remote or ""
        if not limit or not request.path.startswith("/v1/"):
            return await handler(request)
        if in_progress.get(peer, 0) >= limit:
            raise ApiError(429, f"{limit} requests from this address are in progress (the "
                                "server's bound per client address): retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        in_progress[peer] = in_progress.get(peer, 0) + 1
        try:
            return await handler(request)
        finally:  # the table holds only addresses with a request in progress
            in_progress[peer] -= 1
            if not in_progress[peer]:
                del in_progress[peer]

    return check
