"""`pagedkv serve`: the OpenAI-compatible HTTP server.

    pagedkv serve /models/qwen2.5-0.5b --port 8000      # or --model /models/qwen2.5-0.5b
    pagedkv serve tiny-llama                    # a preset: token-id prompts only
    pagedkv serve /models/m --max-model-len 4096 --served-model-name m --served-model-name m-v1 \
        --chat-template chatml.jinja
    pagedkv serve --model /models/m --daemon unix:///run/pagedkv/pagedkvd.sock \
        --runner unix:///run/pagedkv-runner/pagedkv-runner.sock --api-key-file /etc/pagedkv/keys

It starts a daemon planned for the model and a runner next to it, as the `LLM` does (or uses
running ones), opens one engine on them and serves HTTP (app.py). The engine's flags are
`LLMConfig`'s, shared with `pagedkv generate` and `LLM(...)` (vLLM's names); the model may come
first, as `vllm serve MODEL`. Every --served-model-name is accepted as a request's `model` and
listed by /v1/models; the first names the server (its metrics label, its log). The keys clients
must send are --api-key's, --api-key-file's and $PAGEDKV_API_KEY's (vLLM's VLLM_API_KEY). The
daemon and the runner it started are supervised (llm/supervisor.py, server/recovery.py): a
runner that dies is started again and the engine resends each sequence's history, so the
streams go on with the tokens they would have had; a daemon that dies takes every sequence with
it, so the requests in flight get a retryable 503, and once it is started again a new engine
opens on it. While either is down, new requests and /health get 503 with the reason. The port
is bound first, before any child starts or any model loads, so a port in use fails the start at
once; an unreachable --daemon or --runner fails it in one line naming the target. systemd
readiness (READY=1) is sent once the port serves. SIGHUP upgrades the daemon it started (a new
install is picked up): the next daemon starts in standby and takes over the pool, the sessions
and the sockets once the current one has stopped (llm/supervisor.py `upgrade`); streams pause
for the hand-over only. With a --daemon of its own, SIGHUP is ignored (logged). SIGTERM drains:
new requests get 503, running ones finish (up to --drain-timeout-s), then the engine, the
runner and the daemon stop. Exit codes: 0, 2 for a bad flag or model, 1 when the port is in use
(it may be freed: systemd retries), when the services failed to start or cannot be reached, or
are not restarted any more (a bad setting, too many deaths within a minute: systemd then
restarts the whole unit).
"""

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.fair_queue import Line
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.client.pool.client import DEFAULT_RETRY
from pagedkv.client.pool.errors import PagedKVError
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.llm import tokenizer_for
from pagedkv.llm.model_ref import resolve_model
from pagedkv.llm.services import ChildLogs, Services, start_services
from pagedkv.llm.supervisor import Supervisor
from pagedkv.process import log_setup
from pagedkv.process.launch import NoNotification
from pagedkv.process.lifecycle import stop_on_signals
from pagedkv.process.notify import notify
from pagedkv.server.app import DEFAULT_MAX_PER_PEER, DEFAULT_MAX_REQUEST_BYTES, build_app
from pagedkv.server.backend import Backend, ServeConfig
from pagedkv.server.chat_template import load_chat_template, use_chat_template
from pagedkv.server.connections import ConnectionGuard, ConnectionLimits
from pagedkv.server.key_engines import ApiKey, KeyEngines, parse_keys
from pagedkv.server.listener import (
    GuardedSite,
    add_flags,
    connection_limits,
    http_runner,
    listen,
    raise_fd_limit,
)
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.recovery import OUTAGE_RETRY, EngineKeeper, ServicesFailed
from pagedkv.server.tools.parsers import PARSERS
from pagedkv.vocab.geometry import model_name

PROG = "pagedkv serve"
EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
# Requests one API key may have running, and waiting, by default: a key flooding the server
# leaves the rest of the batch to the others, and queues no more than this.
DEFAULT_MAX_RUNNING_PER_KEY = 64
DEFAULT_MAX_WAITING_PER_KEY = 64
# A key clients must send, beside --api-key's (vLLM's VLLM_API_KEY).
API_KEY_ENV = "PAGEDKV_API_KEY"
# How often a drain looks whether the running requests are done.
DRAIN_POLL_S = 0.05
# After the drain, how long aiohttp's shutdown lets handlers end before it cancels them (its
# default, 60 s, would let streams run on past --drain-timeout-s and systemd's TimeoutStopSec).
SHUTDOWN_GRACE_S = 1.0
log = log_setup.get_logger("pagedkv.server")


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog=PROG, description="Serve a model over OpenAI's HTTP API "
                                  "(starts a daemon and a runner unless --daemon names a running "
                                  "one: its runner is --runner, else the runner that registered "
                                  "--served-model-name).")
    LLMConfig.add_cli_args(cli, positional_model=True)
    cli.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                     help="a name clients send as `model` (repeatable; the first is reported; "
                          "default: the model as given)")
    cli.add_argument("--chat-template", metavar="TEMPLATE", help="the chat endpoint's Jinja "
                     "template, or a file holding it (default: the tokenizer's)")
    cli.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    cli.add_argument("--port", type=int, default=8000, help="default 8000")
    cli.add_argument("--api-key", action="append", default=[], help="a key clients must send "
                     "as `Authorization: Bearer KEY` (repeatable; default: none needed); "
                     "'KEY GROUP' puts it in a cache group, whose keys share a prefix cache "
                     "(else each key has its own); $PAGEDKV_API_KEY adds one")
    cli.add_argument("--api-key-file", help="keys, one per line, `KEY` or `KEY GROUP` "
                                            "(# comments)")
    cli.add_argument("--max-running-per-key", type=int, default=DEFAULT_MAX_RUNNING_PER_KEY,
                     help="requests one API key may have running before its others wait "
                          f"(default {DEFAULT_MAX_RUNNING_PER_KEY}; 0: no cap)")
    cli.add_argument("--max-waiting-per-key", type=int, default=DEFAULT_MAX_WAITING_PER_KEY,
                     help="requests one API key may have waiting before more get 429 "
                          f"(default {DEFAULT_MAX_WAITING_PER_KEY}; 0: no cap)")
    cli.add_argument("--max-waiting-requests", type=int, default=256, help="requests waiting "
                     "for room beyond which new ones get 429 (default 256; 0: no bound)")
    cli.add_argument("--max-requests-per-peer", type=int, default=DEFAULT_MAX_PER_PEER,
                     help="requests one client address may have in progress before more get "
                          f"429 (default {DEFAULT_MAX_PER_PEER}; 0: no bound)")
    cli.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                     help=f"largest request body (default {DEFAULT_MAX_REQUEST_BYTES})")
    cli.add_argument("--max-choices", type=int, default=64,
                     help="most prompts x n one request computes (default 64)")
    add_flags(cli)
    cli.add_argument("--drain-timeout-s", type=float, default=30.0, help="how long SIGTERM "
                     "lets running requests finish (default 30)")
    cli.add_argument("--enable-auto-tool-choice", action="store_true", help="honour "
                     'tool_choice "auto": the model calls tools when it chooses to (with '
                     "--tool-call-parser)")
    cli.add_argument("--tool-call-parser", choices=sorted(PARSERS), help="the format the "
                     'model writes tool calls in, read for tool_choice "auto"')
    cli.add_argument("--log-level", default="info", help="default info")
    cli.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))
    return cli


def engine_config(args: argparse.Namespace) -> LLMConfig:
    """The engine's settings; with --daemon and no --runner, the runner used is the one that
    registered the first served name, else the name a runner gives the model by default."""
    model = LLMConfig.cli_model(args)
    if model is None:
        raise ValueError("give the model: pagedkv serve MODEL (or --model MODEL)")
    registered = None
    if getattr(args, "daemon", None) is not None and getattr(args, "runner", None) is None:
        registered = (args.served_model_name or [model_name(model)])[0]
    return LLMConfig.from_cli_args(args, model_name=registered)


def served_names(args: argparse.Namespace, config: LLMConfig) -> tuple[str, ...]:
    """The names clients may send as `model`: every --served-model-name, else the model as
    given; ValueError for a name given twice."""
    names = tuple(args.served_model_name) or (str(config.model),)
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--served-model-name {twice[0]!r} is given twice")
    return names


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The parser of tool_choice "auto", or None; ValueError for one flag without the other
    (vLLM's rule: neither does anything alone)."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    return str(args.tool_call_parser) if args.enable_auto_tool_choice else None


def api_keys(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    """The keys of --api-key, --api-key-file and $API_KEY_ENV (when set and not empty), each
    `KEY` or `KEY GROUP` (key_engines.py; ValueError: an unreadable or empty file, a bad line,
    a key given twice)."""
    keys = list(args.api_key)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    if args.api_key_file is not None:
        lines = Path(args.api_key_file).read_text().splitlines()
        from_file = [line.strip() for line in lines if line.strip()
                     and not line.lstrip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
        keys += from_file
    if any(not key or key != key.strip() for key in keys):
        raise ValueError("an API key is empty or has spaces around it")
    return parse_keys(keys)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        keys = api_keys(args)
        tool_parser = auto_tool_parser(args)
        limits = connection_limits(args, raise_fd_limit())
        config = engine_config(args)
        names = served_names(args, config)
        assert config.model is not None, "engine_config refuses a command line without a model"
        model = resolve_model(config.model)
        model.check_max_model_len(config.max_model_len)
        tokenizer, no_tokenizer = tokenizer_for(config, model)
        if args.chat_template is not None:
            use_chat_template(tokenizer, load_chat_template(args.chat_template), no_tokenizer)
        if min(args.max_waiting_requests, args.max_requests_per_peer, args.port,
               args.max_running_per_key, args.max_waiting_per_key) < 0 \
                or args.max_choices < 1 or args.max_request_bytes < 1:
            raise ValueError("--max-waiting-requests, --max-requests-per-peer, --port, "
                             "--max-running-per-key and --max-waiting-per-key must be >= 0, "
                             "--max-choices and --max-request-bytes >= 1")
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    log_setup.configure(args.log_level, args.log_format)
    serve_config = ServeConfig(names[0], args.max_waiting_requests, args.max_choices,
                               other_names=names[1:], auto_tool_parser=tool_parser)
    try:
        with contextlib.ExitStack() as resources:
            sockets = [resources.enter_context(sock) for sock in listen(args.host, args.port)]
            if config.daemon is None:
                # The children log as the server does, into its stderr: one stream.
                services = start_services(config, model, resources, supervise=True,
                                          logs=ChildLogs(args.log_level, args.log_format))
            else:
                # No --runner: Engine.connect finds the runner serving config.model_name.
                services = Services(config.daemon, config.runner or "")
            asyncio.run(_serve(args, sockets, config, services, keys, limits,
                               serve_config.model_name,
                               lambda engine, metrics: Backend(engine, tokenizer, no_tokenizer,
                                                               serve_config, metrics)))
    except (NoNotification, OSError, ServicesFailed) as exc:
        print(f"{PROG}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


@contextlib.contextmanager
def _upgrade_on_sighup(daemon: Supervisor | None) -> Iterator[None]:
    """SIGHUP: a planned upgrade of the daemon serve started (Supervisor.upgrade); logged and
    ignored without one, or while one runs."""
    def upgrade() -> None:
        if daemon is None or not daemon.upgrade():
            log.warning("SIGHUP ignored: no daemon of this server's own to upgrade, or an "
                        "upgrade or the stop is under way")
            return
        log.warning("SIGHUP: upgrading the daemon", pid=daemon.pid)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, upgrade)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


async def _serve(args: argparse.Namespace, sockets: list[socket.socket], config: LLMConfig,
                 services: Services, keys: tuple[ApiKey, ...], limits: ConnectionLimits,
                 model_name: str,
                 backend_for: Callable[[Engine, ServerMetrics], Backend]) -> None:
    """Serve on `sockets` (bound by `listen`) until SIGTERM or SIGINT, then drain; the
    metrics are labelled with the served `model_name`."""
    with stop_on_signals() as stop, _upgrade_on_sighup(services.daemon_supervisor):
        # Our own daemon restores its sessions after a restart: daemon calls wait out the gap.
        pool_retry = OUTAGE_RETRY if services.daemon_supervisor is not None else DEFAULT_RETRY

        async def connect(salt: bytes = b"", waiting: Line | None = None) -> Engine:
            # Whoever runs the runner (our supervisor, or the operator's unit) restarts it: a
            # step left unanswered waits for the new one.
            return await Engine.connect(services.daemon_target, services.runner_target or None,
                                        model=config.model_name or "",
                                        config=config.scheduler(), client_name="pagedkv-serve",
                                        runner_restart_wait_s=RESTART_WAIT_S, cache_salt=salt,
                                        waiting=waiting, pool_retry=pool_retry)

        metrics = ServerMetrics(model_name, cache_figures=not keys)
        try:
            engine = await connect()
        except (PagedKVError, ValueError) as exc:  # no daemon or runner answers at the
            # target given; no runner serves the model; max_model_len past the model's
            raise ServicesFailed(f"cannot open an engine: {exc}") from None
        backend = backend_for(engine, metrics)
        metrics.watch(lambda: backend.engine, _restarts(services.runner_supervisor),
                      _restarts(services.daemon_supervisor))
        if keys:  # each cache group its own engine, every key its share (key_engines.py)
            backend.key_engines = KeyEngines(connect, args.max_running_per_key,
                                             args.max_waiting_per_key)
            metrics.watch_keys(backend.key_engines)
        keeper = EngineKeeper(backend, connect, services.daemon_supervisor,
                              services.runner_supervisor)
        app_runner = http_runner(build_app(backend, api_keys=keys,
                                           max_request_bytes=args.max_request_bytes,
                                           max_per_peer=args.max_requests_per_peer),
                                 limits, SHUTDOWN_GRACE_S)
        await app_runner.setup()
        try:
            site = GuardedSite(app_runner, sockets, ConnectionGuard(limits))
            await site.start()
            log.info("serving", url=f"{site.name}/v1",
                     model=backend.config.model_name)
            notify("READY=1")
            failed = await keeper.watch_until(stop)
            if failed is not None:
                raise ServicesFailed(failed)
            notify("STOPPING=1")
            await _drain(backend, args.drain_timeout_s)
        finally:
            await app_runner.cleanup()
            if backend.key_engines is not None:
                await backend.key_engines.close()
            await keeper.close()


def _restarts(supervisor: Supervisor | None) -> Callable[[], int]:
    """The restarts of a child the server supervises (none of a running one's)."""
    return lambda: supervisor.restarts if supervisor is not None else 0


async def _drain(backend: Backend, timeout_s: float) -> None:
    """Refuse new requests; let the running ones finish, up to `timeout_s`."""
    backend.draining = True
    log.info("draining", running=backend.active, timeout_s=timeout_s)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            while backend.active:
                await asyncio.sleep(DRAIN_POLL_S)
