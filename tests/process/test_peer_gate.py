"""Unix callers mapped to tenants by uid, through the peer-credential gate.

Daemons here serve a real unix socket through the production `grpc_server` (in-process) or are
a real `pagedkvd` process; the clients whose uid matters are separate processes, so the uid
the gate reads (SO_PEERCRED) is the kernel's record of another process. Mapping a second uid
needs a client that can change its uid, i.e. tests running as root; without root that test is
skipped, not passed. The tests of the gate's caps (one uid against the others) run as any
user: `own_process_is` makes the gate read another uid for the connections this test process
makes, while child processes keep their real uid.
"""

import asyncio
import contextlib
import io
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.client import (
    DaemonUnavailable,
    PoolClient,
    PoolExhausted,
    Session,
    TlsOptions,
    Unauthenticated,
)
from pagedkv.daemon.edge import peer_gate
from pagedkv.daemon.edge.addresses import parse_listen
from pagedkv.daemon.edge.peer_gate import GRPC_SOCKET_NAME, PeerGate, gate_folder
from pagedkv.daemon.edge.tls import load_server_tls
from pagedkv.daemon.process.server import grpc_server
from pagedkv.daemon.service.fence import PeerCredentials
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.tenants import Tenant, Tenants, bearer_of
from pagedkv.process.grpc_server import StartupError

from daemon_harness import Daemon, running_daemon
from log_capture import events
from pagedkvd_process import free_tcp_port, pagedkvd, short_tmp_dir, tenant_samples
from tls_certs import make_tls_files

UID = os.getuid()
# A uid that is not ours, for tenants our clients must not map to (and, as root, to become).
OTHER_UID = 65534 if UID != 65534 else 65533
# Root may change uid: a client process then becomes OTHER_UID (or THIRD_UID, listed nowhere).
THIRD_UID = 65532
AS_ROOT = pytest.mark.skipif(UID != 0, reason="becoming another uid needs root; the mapping "
                                              "of a second uid is NOT tested in this run")
LEASE_MS = 500

# A client process: become `uid` (if not ours), open a session, allocate 2 blocks and try a
# second session; print what happened as one JSON line, then hold the session until stdin ends.
# A client the gate refuses waits out its connect timeout (the gate closes each connection as
# it arrives; grpc tries again): 2 s, not the 5 s it was, which no accepted client comes near.
CLIENT = """
import asyncio, json, os, sys
import concurrent.futures.thread  # run_in_executor's, imported before setuid
from pagedkv.client import PagedKVError, PoolClient

async def main(target, uid):
    if uid != os.getuid():
        os.setuid(uid)  # after the imports: the new uid may not read the code
    outcome = {"uid": os.getuid()}
    try:
        client = await PoolClient.connect(target, timeout=2)
    except PagedKVError as exc:  # the gate closed the connection
        print(json.dumps({**outcome, "error": type(exc).__name__}), flush=True)
        return
    async with client:
        try:
            session = await client.open_session("child")
            await session.allocate(1, 8)
            outcome["opened"] = True
            await client.open_session("second")
        except PagedKVError as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(outcome), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


class Child:
    """A client process running CLIENT; it holds its session until `close`."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def outcome(self) -> dict[str, object]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout=60)
        assert line, "the client process ended without an outcome"
        result: dict[str, object] = json.loads(line)
        return result

    async def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert await asyncio.wait_for(self.process.wait(), timeout=30) == 0


# An HTTP/2 client's preface and an empty SETTINGS frame: a connection that makes no call.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def idle_connection(path: Path) -> socket.socket:
    """A connection that sends the HTTP/2 preface and then nothing, as an idle gRPC channel."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    await asyncio.to_thread(sock.connect, str(path))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed already
        sock.sendall(HTTP2_PREFACE)
    return sock


def receive(sock: socket.socket, size: int) -> bytes:
    """What `sock` receives, b"" once the gate closed it (aborted, with our bytes unread, the
    kernel reports a reset)."""
    try:
        return sock.recv(size)
    except ConnectionResetError:
        return b""


async def answered(sock: socket.socket) -> bool:
    """Whether gRPC answered the preface (its SETTINGS frame: admitted) rather than the gate
    closing the connection (refused)."""
    return await asyncio.to_thread(receive, sock, 9) != b""


async def read_to_end(sock: socket.socket) -> None:
    """Read until the gate closes the connection (TimeoutError after the socket's timeout)."""
    while await asyncio.to_thread(receive, sock, 4096):
        pass


@pytest.fixture
def own_process_is(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Make the gate read `uid` for connections made by this test process (SO_PEERCRED's pid is
    ours); other processes keep their real uid. One uid's connections against another's,
    without root."""
    real = peer_gate.socket_credentials

    def set_uid(uid: int) -> None:
        def read(sock: socket.socket) -> PeerCredentials:
            credentials = real(sock)
            if credentials.pid != os.getpid():
                return credentials
            return PeerCredentials(pid=credentials.pid, uid=uid)
        monkeypatch.setattr(peer_gate, "socket_credentials", read)
    return set_uid


async def start_child(target: str, uid: int = UID) -> Child:
    return Child(await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, target, str(uid),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE))


def tenants(*, unmapped_uids: str = "refuse", mine: bool = True) -> Tenants:
    """"me" lists our uid (unless `mine` is False), "other" OTHER_UID, "tcp" has a token."""
    return Tenants([
        Tenant("me", max_blocks=4, max_sessions=1, uids=frozenset({UID} if mine else ())),
        Tenant("other", max_sessions=1, uids=frozenset({OTHER_UID})),
        Tenant("tcp", bearer_of("tcp-token")),
    ], unmapped_uids=unmapped_uids)


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=32, block_size=4, tenants=tenants()) as running:
        yield running


async def own_connection(target: str) -> PoolClient:
    """A client with a connection of its own (grpc shares one between a process's channels
    to the same target unless told otherwise)."""
    channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    await asyncio.wait_for(channel.channel_ready(), 30)
    return PoolClient(channel)


def figure(daemon: Daemon, name: str, tenant: str) -> float | None:
    return daemon.registry.get_sample_value(f"pagedkv:{name}", {"tenant": tenant})


def socket_path(daemon: Daemon) -> Path:
    return Path(daemon.unix_target.removeprefix("unix://"))


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `condition()` is true (the gate's thread closes connections on its own)."""
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")




# ------------------------------------------------------------------------------ mapping

async def test_a_unix_caller_process_is_the_tenant_listing_its_uid(daemon: Daemon) -> None:
    child = await start_child(daemon.unix_target)
    try:
        outcome = await child.outcome()
        # Its tenant's limits hold: max_sessions = 1 refuses the second session.
        assert outcome == {"uid": UID, "opened": True, "error": "PoolExhausted: "
                           "RESOURCE_EXHAUSTED: tenant me has 1 sessions open, its "
                           "max_sessions; close one first"}
        assert figure(daemon, "tenant_sessions", "me") == 1
        assert figure(daemon, "tenant_block_table_entries", "me") == 2
        assert figure(daemon, "tenant_sessions", "default") == 0
        assert daemon.gate is not None and daemon.gate.open_connections == 1
    finally:
        await child.close()
    assert figure(daemon, "tenant_sessions", "me") == 0  # closed with its client
    # This process has the same uid: the same tenant, whose max_blocks = 4 holds too.
    async with await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session("here")
        await session.allocate(1, 16)
        with pytest.raises(PoolExhausted, match=r"tenant me .* max_blocks=4"):
            await session.append(1)
    daemon.service.check_invariants()


async def test_a_uid_no_tenant_lists_is_refused_at_accept(log_lines: io.StringIO) -> None:
    async with running_daemon(tenants=tenants(mine=False)) as daemon:
        assert daemon.gate is not None
        child = await start_child(daemon.unix_target)
        try:
            assert await child.outcome() == {"uid": UID, "error": "DaemonUnavailable"}
        finally:
            await child.close()
        with await idle_connection(socket_path(daemon)) as sock:
            assert not await answered(sock)  # closed as it arrived: it holds no connection
        # Not even a health check: such a caller could make no other call.
        async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert daemon.gate.open_connections == 0
        assert figure(daemon, "tenant_sessions", "default") == 0
        [line, *_] = events(log_lines, "unix_connections_refused")
        assert (line["limit"], line["unmapped_uids"], line["uid"]) == ("unmapped_uids",
                                                                       "refuse", UID)


async def test_a_uid_no_tenant_lists_is_the_unix_tenant_when_so_configured() -> None:
    async with running_daemon(tenants=tenants(unmapped_uids="unix_tenant", mine=False)) as daemon:
        child = await start_child(daemon.unix_target)
        try:
            # The unix tenant, "default": no limits, so the second session opens too.
            assert await child.outcome() == {"uid": UID, "opened": True}
            assert figure(daemon, "tenant_sessions", "default") == 2
            assert figure(daemon, "tenant_sessions", "me") == 0
        finally:
            await child.close()
        async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@AS_ROOT
async def test_another_uid_is_mapped_to_its_own_tenant() -> None:
    async with running_daemon(num_blocks=32, block_size=4, tenants=tenants()) as daemon:
        # Other users reach the socket through its group (root's, kept by the children).
        socket_path(daemon).parent.chmod(0o750)
        mine, other, stranger = [await start_child(daemon.unix_target, uid)
                                 for uid in (UID, OTHER_UID, THIRD_UID)]
        try:
            assert (await mine.outcome())["error"] == (
                "PoolExhausted: RESOURCE_EXHAUSTED: tenant me has 1 sessions open, its "
                "max_sessions; close one first")
            assert (await other.outcome()) == {
                "uid": OTHER_UID, "opened": True, "error": "PoolExhausted: RESOURCE_EXHAUSTED: "
                "tenant other has 1 sessions open, its max_sessions; close one first"}
            # Listed nowhere: the gate closes its connections as they arrive.
            assert await stranger.outcome() == {"uid": THIRD_UID, "error": "DaemonUnavailable"}
            assert figure(daemon, "tenant_sessions", "me") == 1
            assert figure(daemon, "tenant_sessions", "other") == 1
            assert figure(daemon, "tenant_block_table_entries", "other") == 2
        finally:
            for child in (mine, other, stranger):
                await child.close()


async def test_a_real_daemon_maps_uids_from_its_config() -> None:
    with short_tmp_dir() as folder:
        metrics = f"127.0.0.1:{free_tcp_port()}"
        config = folder / "pagedkv.toml"
        config.write_text(f"[tenants.me]\nuids = [{UID}]\nmax_sessions = 1\n"
                          f"[tenants.other]\nuids = [{OTHER_UID}]\n")
        with pagedkvd("--config", str(config), "--metrics-listen", metrics,
                      workdir=folder) as running:
            child = await start_child(running.unix_target)
            try:
                assert (await child.outcome())["error"] == (
                    "PoolExhausted: RESOURCE_EXHAUSTED: tenant me has 1 sessions open, its "
                    "max_sessions; close one first")
                samples = tenant_samples(metrics)
                assert samples[("pagedkv:tenant_sessions", "me")] == 1
                assert samples[("pagedkv:tenant_sessions", "default")] == 0
                assert sorted(p.name for p in gate_folder(folder / "pagedkvd.sock").iterdir()) \
                    == [GRPC_SOCKET_NAME]
            finally:
                await child.close()
            assert running.stop() == 0
        # The gate's folder and the socket go with the daemon.
        assert not (folder / "pagedkvd.sock").exists()
        assert not gate_folder(folder / "pagedkvd.sock").exists()


# ------------------------------------------------------------------------------ the gate

async def test_connections_over_the_limit_are_closed_and_named_in_the_log(
    log_lines: io.StringIO,
) -> None:
    async with running_daemon(tenants=tenants(), limits=Limits(max_unix_connections=2)) as daemon:
        assert daemon.gate is not None
        path = str(socket_path(daemon))
        async with await own_connection(daemon.unix_target) as first, \
                await own_connection(daemon.unix_target) as second:
            await first.open_session("one")
            await second.stats()
            assert daemon.gate.open_connections == 2
            with socket.socket(socket.AF_UNIX) as third:
                third.settimeout(10)
                third.connect(path)  # the kernel accepts; the gate closes it at once
                assert await asyncio.to_thread(third.recv, 1) == b""
            with pytest.raises(DaemonUnavailable):
                async with await PoolClient.connect(daemon.unix_target, timeout=1) as late:
                    await late.stats()
            [line] = events(log_lines, "unix_connections_refused")
            assert (line["limit"], line["max_unix_connections"]) == ("max_unix_connections", 2)
        await eventually(lambda: daemon.gate is not None and daemon.gate.open_connections == 0)
        async with await PoolClient.connect(daemon.unix_target) as again:  # room again
            assert (await again.stats()).num_blocks == 16


async def test_an_unmapped_uid_holding_idle_connections_locks_no_tenant_out(
    own_process_is: Callable[[int], None], log_lines: io.StringIO,
) -> None:
    """The probe: a uid no tenant lists opens the cap's worth of idle HTTP/2 connections; the
    tenant listing another uid must still be served."""
    own_process_is(THIRD_UID)  # listed nowhere
    async with running_daemon(tenants=tenants(), limits=Limits(max_unix_connections=4)) as daemon:
        assert daemon.gate is not None
        hostile = [await idle_connection(socket_path(daemon)) for _ in range(4)]
        try:
            child = await start_child(daemon.unix_target)  # our real uid: tenant "me"
            try:
                assert (await child.outcome()).get("opened") is True
            finally:
                await child.close()
            assert [await answered(sock) for sock in hostile] == [False] * 4
        finally:
            for sock in hostile:
                sock.close()
        assert daemon.gate.open_connections == 0
        lines = events(log_lines, "unix_connections_refused")
        assert {(line["limit"], line["uid"]) for line in lines} == {("unmapped_uids", THIRD_UID)}


async def test_one_uid_holds_at_most_its_share_of_the_connections(
    own_process_is: Callable[[int], None], log_lines: io.StringIO,
) -> None:
    """A mapped uid (tenant "other") fills its share with idle gRPC connections and tries for
    more; another tenant's uid still connects."""
    own_process_is(OTHER_UID)
    limits = Limits(max_unix_connections=4, max_unix_connections_per_uid=2)
    async with running_daemon(tenants=tenants(), limits=limits) as daemon:
        assert daemon.gate is not None
        held = [await own_connection(daemon.unix_target) for _ in range(2)]
        try:
            await held[0].stats()
            more = [await idle_connection(socket_path(daemon)) for _ in range(2)]
            assert [await answered(sock) for sock in more] == [False, False]
            assert daemon.gate.open_by_uid == {OTHER_UID: 2}
            child = await start_child(daemon.unix_target)
            try:
                assert (await child.outcome()).get("opened") is True
                assert daemon.gate.open_by_uid == {OTHER_UID: 2, UID: 1}
            finally:
                await child.close()
            [line, *_] = events(log_lines, "unix_connections_refused")
            assert (line["limit"], line["max_unix_connections_per_uid"], line["uid"]) == (
                "max_unix_connections_per_uid", 2, OTHER_UID)
        finally:
            for client in held:
                await client.close()
        await eventually(lambda: daemon.gate is not None and not daemon.gate.open_by_uid)


async def test_an_idle_connection_is_closed_and_its_client_reconnects() -> None:
    # Long enough that a loaded machine answers a call or a preface well within it.
    limits = Limits(max_unix_connection_idle_ms=1000)
    async with running_daemon(tenants=tenants(), limits=limits) as daemon:
        assert daemon.gate is not None
        async with await own_connection(daemon.unix_target) as client:
            await client.stats()
            with await idle_connection(socket_path(daemon)) as sock:
                assert await answered(sock)
                await read_to_end(sock)  # no byte either way: closed by the gate
            await eventually(lambda: daemon.gate is not None and daemon.gate.open_connections == 0)
            # The gate closes bytes, not HTTP/2 (no GOAWAY): a call racing the close fails
            # UNAVAILABLE. Once gRPC has seen the close, the next call connects anew.
            await eventually(lambda: client._channel.get_state() != grpc.ChannelConnectivity.READY)
            assert (await client.stats()).num_blocks == 16  # on a new connection


async def test_peer_names_go_at_once_and_the_gate_folder_with_the_daemon() -> None:
    async with running_daemon(tenants=tenants()) as daemon:
        folder = gate_folder(socket_path(daemon))
        assert folder.stat().st_mode & 0o777 == 0o700
        clients = [await own_connection(daemon.unix_target) for _ in range(8)]
        for client in clients:
            await client.stats()
        assert daemon.gate is not None and daemon.gate.open_connections == 8
        # Each connection's name was removed once connected: only gRPC's socket is there.
        assert [p.name for p in folder.iterdir()] == [GRPC_SOCKET_NAME]
        for client in clients:
            await client.close()
        await eventually(lambda: daemon.gate is not None and daemon.gate.open_connections == 0)
        assert [p.name for p in folder.iterdir()] == [GRPC_SOCKET_NAME]
    assert not folder.exists() and not socket_path(daemon).exists()


async def test_a_stale_gate_folder_is_replaced_and_anything_else_refused(
    daemon: Daemon,
) -> None:
    """A second server for the daemon's service, on a socket whose gate folder exists."""
    with short_tmp_dir() as directory:
        listen = [parse_listen(f"unix://{directory / 'd.sock'}")]
        folder = gate_folder(directory / "d.sock")
        folder.mkdir()
        (folder / "peer-0-1").write_text("left by a crashed daemon")
        async with grpc_server(daemon.service, listen, rpc_metrics=None):
            assert [p.name for p in folder.iterdir()] == [GRPC_SOCKET_NAME]
        assert not folder.exists()
        folder.write_text("not a folder")
        with pytest.raises(StartupError, match="exists and is not a folder of this user"):
            async with grpc_server(daemon.service, listen, rpc_metrics=None):
                pass


async def test_many_concurrent_clients_each_their_own_connection(daemon: Daemon) -> None:
    assert daemon.gate is not None
    many = 48
    clients = await asyncio.gather(*(own_connection(daemon.unix_target) for _ in range(many)))
    try:
        answers = await asyncio.gather(*(client.stats() for client in clients for _ in range(5)))
        assert len(answers) == many * 5
        assert daemon.gate.open_connections == many
        # Each caller is "me" (max_sessions = 1): exactly one of many racing opens wins.
        # (Only the outcomes' types are kept: a grpc error holds its call, and the call its
        # connection, open.)
        outcomes = [type(result) for result in await asyncio.gather(
            *(client.open_session(f"c{i}") for i, client in enumerate(clients)),
            return_exceptions=True)]
        assert sorted(outcomes, key=lambda kind: kind is PoolExhausted) == \
            [Session] + [PoolExhausted] * (many - 1)
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    await eventually(lambda: daemon.gate is not None and daemon.gate.open_connections == 0)
    daemon.service.check_invariants()


async def test_the_gate_names_the_uid_copies_exactly_and_holds_back_a_fast_writer() -> None:
    """The gate alone, in front of a plain server: the name it connects from, every byte both
    ways, and backpressure: while the caller reads nothing, the server cannot send much."""
    total = 8 << 20
    blob = os.urandom(total)
    sent = 0
    peers: list[str] = []
    echoed = asyncio.Event()

    async def blaster(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        peers.append(writer.get_extra_info("peername"))
        assert await reader.readexactly(5) == b"hello"
        echoed.set()
        for start in range(0, total, 1 << 16):
            writer.write(blob[start:start + (1 << 16)])
            await writer.drain()  # waits while the gate does not read
            sent = start + (1 << 16)
        writer.close()

    gate = PeerGate(Limits(max_unix_connections=4), tenants())
    with short_tmp_dir() as directory:
        public = directory / "g.sock"
        internal = gate.add(public, 0o600).removeprefix("unix://")
        server = await asyncio.start_unix_server(blaster, internal)
        await gate.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(public))
            writer.write(b"hello")
            await asyncio.wait_for(echoed.wait(), 10)
            await asyncio.sleep(0.5)  # the caller reads nothing meanwhile
            assert sent < total // 4, "the gate buffered what its caller did not read"
            assert await asyncio.wait_for(reader.readexactly(total), 60) == blob
            assert await reader.read() == b""  # the server's close reaches the caller
            writer.close()
            assert peers == [f"{gate_folder(public)}/peer-{UID}-{os.getpid()}-0"]
        finally:
            server.close()
            await gate.stop()
        assert not public.exists() and not gate_folder(public).exists()


async def test_megabytes_pass_through_a_real_call() -> None:
    """A request and an answer over the gate's 64 KiB buffers, through gRPC, intact."""
    big = Tenants([Tenant("big", uids=frozenset({UID}))])
    async with running_daemon(num_blocks=2048, block_size=16, tenants=big) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session("big")
        tokens = list(range(2048 * 16))  # a request of about 90 KB
        first = await session.allocate(0, token_ids=tokens)
        for seq_id in range(1, 256):
            await session.fork(0, seq_id)
        tables = await session.block_tables(list(range(256)))  # an answer of about 1 MB
        assert [table.block_ids for table in tables] == [first.block_ids] * 256
        assert first.slot_mapping == list(range(2048 * 16))
        await session.close()


# A client that steps until killed; and a peer that sends half an HTTP/2 preface and waits.
STEPPER = """
import asyncio, sys
from pagedkv.client import PoolClient

async def main(target, lease_ms):
    client = await PoolClient.connect(target)
    session = await client.open_session("doomed", lease_ttl_ms=lease_ms)
    await session.allocate(1, 4)
    print("READY", flush=True)
    while True:
        await session.append(1)
        await session.free(1)
        await session.allocate(1, 4)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""
HALF_PREFACE = """
import socket, sys, time
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.sendall(b"PRI * HTTP/2.0\\r\\n")
print("READY", flush=True)
time.sleep(600)
"""


async def test_a_client_killed_mid_call_leaves_nothing_open(daemon: Daemon) -> None:
    assert daemon.gate is not None
    processes = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, target, str(LEASE_MS), stdout=asyncio.subprocess.PIPE)
        for script, target in ((STEPPER, daemon.unix_target),
                               (HALF_PREFACE, str(socket_path(daemon))))]
    try:
        for process in processes:
            assert process.stdout is not None
            assert await asyncio.wait_for(process.stdout.readline(), 60) == b"READY\n"
        await asyncio.sleep(0.2)  # mid-call: it sends call after call
        assert daemon.gate.open_connections == 2
    finally:
        for process in processes:
            os.kill(process.pid, signal.SIGKILL)
            await process.wait()
    await eventually(lambda: daemon.gate is not None and daemon.gate.open_connections == 0)
    await eventually(lambda: daemon.service.num_sessions == 0)  # its lease ran out
    daemon.service.check_invariants()
    assert daemon.pool.stats().used_blocks == 0
    async with await PoolClient.connect(daemon.unix_target) as client:  # still serving
        await client.open_session("after")


async def test_grpc_socket_reached_around_the_gate_is_refused(daemon: Daemon) -> None:
    # Only the daemon's own user can do this (the folder is 0o700); it still gets no tenant.
    inner = gate_folder(socket_path(daemon)) / GRPC_SOCKET_NAME
    async with await PoolClient.connect(f"unix://{inner}") as client:
        with pytest.raises(Unauthenticated, match="identified by uid"):
            await client.open_session("around")


# ------------------------------------------------------------------------------ TCP, TLS

async def test_tcp_callers_are_still_told_by_token_with_tls(tmp_path: Path) -> None:
    files = make_tls_files(tmp_path)
    tls = load_server_tls(files.server_cert, files.server_key, None)
    async with running_daemon(tenants=tenants(), tcp=True, tls=tls) as daemon:
        assert daemon.tcp_target is not None and daemon.gate is not None
        options = TlsOptions(ca_file=files.ca)
        async with await PoolClient.connect(daemon.tcp_target, auth_token="tcp-token",
                                            tls=options) as tcp, \
                await PoolClient.connect(daemon.unix_target) as local:
            await tcp.open_session("a")
            await tcp.open_session("b")  # "tcp" has no session cap, unlike our uid's "me"
            await local.open_session("by-uid")
            assert figure(daemon, "tenant_sessions", "tcp") == 2
            assert figure(daemon, "tenant_sessions", "me") == 1
            assert daemon.gate.open_connections == 1  # the unix client's; TCP passes no gate
        async with await PoolClient.connect(daemon.tcp_target, tls=options) as tokenless:
            with pytest.raises(Unauthenticated, match="Bearer"):
                await tokenless.open_session("x")


async def test_without_uids_the_public_socket_has_no_gate() -> None:
    """Only the runner socket passes the gate then (its callers' pids: fence.py)."""
    async with running_daemon(tenants=Tenants([Tenant("me")], unix_tenant="me")) as daemon:
        assert daemon.gate is not None and not daemon.gate.folders()
        assert not gate_folder(socket_path(daemon)).exists()
        async with await PoolClient.connect(daemon.unix_target) as client:
            await client.open_session("plain")
            assert figure(daemon, "tenant_sessions", "me") == 1

