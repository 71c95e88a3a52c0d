"""The daemon's one logging setup: JSON for journald, console for people, stdlib records too."""

import contextlib
import io
import json
import logging

import grpc
import pytest

from pagedkv.process.log_setup import configure, get_logger, resolve_format

pytestmark = pytest.mark.usefixtures("restore_root_logger")


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_level_logger_time_and_bound_fields() -> None:
    out = io.StringIO()
    configure("info", "json", out)
    get_logger("pagedkv.test").info("rpc", session="s-1", code="OK")
    logging.getLogger("grpc._server").warning("from %s", "stdlib")
    first, second = lines(out)
    assert first["event"] == "rpc" and first["session"] == "s-1" and first["code"] == "OK"
    assert first["level"] == "info" and first["logger"] == "pagedkv.test"
    assert str(first["timestamp"]).endswith("Z")
    assert (second["event"], second["level"]) == ("from stdlib", "warning")
    assert second["logger"] == "grpc._server"


def test_level_filters_both_structlog_and_stdlib() -> None:
    out = io.StringIO()
    configure("warning", "json", out)
    get_logger("a").info("dropped")
    logging.getLogger("b").info("dropped too")
    get_logger("a").error("kept")
    assert [line["event"] for line in lines(out)] == ["kept"]


async def test_debug_level_leaves_out_grpcs_line_per_call() -> None:
    """gRPC's cython layer logs "Loaded running loop" at debug for every call: at debug level
    those lines drowned the daemon's own; its warnings still pass."""
    out = io.StringIO()
    configure("debug", "json", out)
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with contextlib.suppress(grpc.aio.AioRpcError):  # no such method: UNIMPLEMENTED
            await channel.unary_unary("/x.Y/Z")(b"", timeout=5)
    await server.stop(0)
    get_logger("pagedkv.test").debug("mine")
    logging.getLogger("grpc._cython.cygrpc").warning("a grpc warning")
    events = [str(line["event"]) for line in lines(out)]
    assert not any("Loaded running loop" in event for event in events)
    assert "mine" in events and "a grpc warning" in events


def test_json_tracebacks_are_data_without_frame_locals() -> None:
    out = io.StringIO()
    configure("info", "json", out)
    secret = "token-that-must-not-leak"  # a local of the failing frame
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("a").exception("failed")
    (line,) = lines(out)
    exception = line["exception"]
    assert isinstance(exception, list) and exception[0]["exc_type"] == "RuntimeError"
    assert secret not in out.getvalue()


def test_console_format_is_one_readable_line() -> None:
    out = io.StringIO()
    configure("debug", "console", out)
    get_logger("a").debug("hello", blocks=3)
    text = out.getvalue()
    assert "hello" in text and "blocks=3" in text and not text.startswith("{")


def test_auto_format_is_json_off_a_terminal() -> None:
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("console", io.StringIO()) == "console"


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure("loud", "json", io.StringIO())
