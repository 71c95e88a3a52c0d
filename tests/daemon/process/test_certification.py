"""Who may certify K/V (commit blocks) and who may map the pool.

A client that commits blocks nobody computed would make every tenant sharing the salt read
whatever memory held: under a salt other tenants list, only a runner (the runner socket) or a
tenant that `certifies` the salt may commit. The pool memory's handle maps every tenant's K/V,
so only runners get it, and the pool file is the daemon's user's (and its runner group's) alone.
In-process daemons serve the production `grpc_server`; the file modes are a real pagedkvd's.

Tenants: alice certifies "shared"; bob lists "shared" too but does not certify it, and alone
lists "solo". The attack: bob allocates R under "shared" and commits without computing.
"""

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pagedkv.client import (
    Allocate,
    Commit,
    NotFound,
    PermissionDenied,
    PoolClient,
    Session,
    Step,
)
from pagedkv.daemon.service.tenants import Tenant, Tenants, bearer_of
from pagedkv.model_runner.process.cli import EXIT_BAD_CONFIG
from pagedkv.process.launch import START_TIMEOUT_S, start_runner
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import Daemon, running_daemon
from pagedkvd_process import pagedkvd, short_tmp_dir

R = list(range(200, 208))  # two full blocks of 4 tokens
TENANTS = Tenants([
    Tenant("alice", bearer_of("alice-token"), salts=frozenset({b"shared"}),
           certifies=frozenset({b"shared"})),
    Tenant("bob", bearer_of("bob-token"), salts=frozenset({b"shared", b"solo"})),
])


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=32, block_size=4, tcp=True, with_memory=True,
                              tenants=TENANTS) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def alice(daemon: Daemon) -> AsyncIterator[PoolClient]:
    assert daemon.tcp_target is not None
    async with await PoolClient.connect(daemon.tcp_target, auth_token="alice-token") as client:
        yield client


@pytest.fixture
async def bob(daemon: Daemon) -> AsyncIterator[PoolClient]:
    assert daemon.tcp_target is not None
    async with await PoolClient.connect(daemon.tcp_target, auth_token="bob-token") as client:
        yield client


async def cached_tokens(client: PoolClient, prompt: list[int]) -> int:
    """What a fresh session of `client` under "shared" finds cached of `prompt`."""
    async with await client.open_session("victim", cache_salt="shared") as victim:
        return (await victim.allocate(1, token_ids=prompt)).num_cached_tokens


async def test_a_tenant_that_does_not_certify_a_shared_salt_may_not_commit(
        daemon: Daemon, alice: PoolClient, bob: PoolClient) -> None:
    forger = await bob.open_session("forger", cache_salt="shared")
    await forger.allocate(1, token_ids=R)  # two pending blocks; no runner computed them
    before = daemon.pool.stats()
    assert before.pending_blocks == 2
    with pytest.raises(PermissionDenied, match=r"tenant bob may not commit K/V under cache salt "
                                               r"b'shared'.*tenants.bob.certifies"):
        await forger.commit([1])
    with pytest.raises(PermissionDenied, match=r"tenants\.bob\.certifies"):
        await forger.batch([Allocate(2, token_ids=R), Commit([1])])  # refused whole
    with pytest.raises(PermissionDenied, match=r"tenants\.bob\.certifies"):
        await forger.step([1], [7], commit=True)  # nor appends: the step is refused whole
    (entry,) = await bob.step_many([(forger, Step([1], [7], commit=True))])
    assert isinstance(entry, PermissionDenied) and "tenants.bob.certifies" in str(entry)
    # The cause is in the trailing metadata, as every refusal's.
    async with grpc.aio.insecure_channel(str(daemon.tcp_target)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kvpool_pb2_grpc.KVPoolStub(channel).Commit(
                pb.CommitRequest(session_id=forger.session_id, seq_ids=[1]),
                metadata=(("authorization", "Bearer bob-token"),))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert dict(refused.value.trailing_metadata() or ())["pagedkv-error"] == "PermissionDenied"
    assert daemon.pool.stats() == before  # nothing changed: still pending, still 8 tokens
    assert (await forger.block_tables([1]))[0].num_tokens == 8
    assert await cached_tokens(alice, R) == 0  # the victim is served no forged K/V


async def test_commits_that_mislead_no_other_tenant_are_allowed(bob: PoolClient) -> None:
    for salt in ("solo", ""):  # a salt only bob lists; a private session
        async with await bob.open_session("own", cache_salt=salt) as own:
            await own.allocate(1, token_ids=R)
            assert await own.commit([1]) == 2


async def test_a_certifier_and_a_runner_may_commit_under_a_shared_salt(
        daemon: Daemon, alice: PoolClient, bob: PoolClient) -> None:
    certifier = await alice.open_session("certifier", cache_salt="shared")
    await certifier.allocate(1, token_ids=R)
    assert await certifier.commit([1]) == 2
    assert await cached_tokens(bob, R) == 8
    # A runner computed bob's blocks: it certifies them for him (it acts for any session).
    other = [token + 100 for token in R]
    client = await bob.open_session("client", cache_salt="shared")
    await client.allocate(1, token_ids=other)
    async with await PoolClient.connect(daemon.runners_target) as runner:
        committed = await runner.attach(client.session_id, client.block_size).commit([1])
    assert committed == 2
    assert await cached_tokens(alice, other) == 8


async def test_only_runners_get_the_pool_memory(daemon: Daemon, alice: PoolClient) -> None:
    assert daemon.memory is not None
    async with await PoolClient.connect(daemon.unix_target) as public:
        for client in (public, alice):
            info = await client.pool_info()
            assert info.memory.kind == "" and not info.memory.shm_path
            assert info.num_blocks == 32 and info.dtype == "float32"  # the geometry is public
    async with await PoolClient.connect(daemon.runners_target) as runner:
        info = await runner.pool_info()
    assert (info.memory.kind, info.memory.shm_path) == ("shm", daemon.memory.handle().shm_path)
    runner_socket = Path(daemon.runners_target.removeprefix("unix://"))
    assert stat.S_IMODE(runner_socket.stat().st_mode) == 0o600  # the daemon's user alone


async def test_a_uid_mapped_tenant_names_only_its_own_sessions() -> None:
    tenants = Tenants([Tenant("local", uids=frozenset({os.getuid()})),
                       Tenant("bob", bearer_of("bob-token"))])
    async with running_daemon(tcp=True, tenants=tenants) as daemon:
        assert daemon.tcp_target is not None
        async with await PoolClient.connect(daemon.tcp_target, auth_token="bob-token") as bob, \
                await PoolClient.connect(daemon.unix_target) as local:
            his: Session = await bob.open_session("his")
            await his.allocate(1, 4)
            with pytest.raises(NotFound, match="unknown session"):
                await local.attach(his.session_id, his.block_size).allocate(2, 4)
            async with await PoolClient.connect(daemon.runners_target) as runner:
                reply = await runner.attach(his.session_id, his.block_size).allocate(2, 4)
            assert len(reply.block_ids) == 1
        daemon.service.check_invariants()


async def test_the_pool_file_and_runner_socket_are_the_runner_groups_alone() -> None:
    # Not the daemon's own group when run as root (who may give files to any group).
    group = 65534 if os.getuid() == 0 else os.getgid()
    # socket_mode 600: the daemon's group may not be the public socket's too (refused).
    with pagedkvd("--runner-group", str(group), "--socket-mode", "600") as daemon:
        (pool_file,) = daemon.pool_files()
        runner_socket = Path(daemon.runners_target.removeprefix("unix://"))
        for path in (pool_file, runner_socket):
            info = path.stat()
            assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o660, group), path
        async with await PoolClient.connect(daemon.runners_target) as runner:
            assert (await runner.pool_info()).memory.shm_path == str(pool_file)
        assert daemon.stop() == 0


def test_a_runner_on_the_public_socket_refuses_to_start() -> None:
    """An old unit's `--daemon .../pagedkvd.sock`: the runner says where to connect instead."""
    with pagedkvd() as daemon, short_tmp_dir() as folder, \
            start_runner(daemon.unix_target, folder, "--random-init", "tiny") as runner:
        assert runner.wait_for_exit(START_TIMEOUT_S) == EXIT_BAD_CONFIG, runner.stderr()
        assert "gave no pool memory: connect the runner to the daemon's runner socket" in \
            runner.stderr()
