"""Tenants: tokens name tenants, each with limits over all its sessions and its cache salts.

In-process daemons (production `grpc_server`, plaintext TCP for brevity; TLS is
tests/daemon/process/test_tls.py's) with three tenants: alice (2 sessions, 4 blocks, salt
"shared" only, which she certifies), bob (any salt, in his own namespace) and carol (salt
"shared" too); unix callers are the default tenant. Then the [tenants.NAME] settings, and a real
pagedkvd configured with them. Who may commit and who gets the pool memory is
tests/daemon/process/test_certification.py's.
"""

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pagedkv.client import (
    NotFound,
    PermissionDenied,
    PoolClient,
    PoolExhausted,
    SessionNotFound,
    Step,
    StepResult,
    Unauthenticated,
)
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.process.settings_sources import load_toml
from pagedkv.daemon.service.tenants import Tenant, Tenants, bearer_of

from daemon_harness import Daemon, running_daemon
from pagedkvd_process import free_tcp_port, pagedkvd, tenant_samples

PROMPT = list(range(100, 108))  # two full blocks of 4 tokens
TENANTS = Tenants([
    Tenant("alice", bearer_of("alice-token"), max_blocks=4, max_sessions=2,
           salts=frozenset({b"shared"}), certifies=frozenset({b"shared"})),
    Tenant("bob", bearer_of("bob-token")),
    Tenant("carol", bearer_of("carol-token"), salts=frozenset({b"shared"})),
])


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=32, block_size=4, tcp=True,
                              tenants=TENANTS) as running:
        yield running


async def connect(daemon: Daemon, tenant: str | None) -> PoolClient:
    """A client of `tenant` over TCP (its token), or over the unix socket for None."""
    if tenant is None:
        return await PoolClient.connect(daemon.unix_target)
    assert daemon.tcp_target is not None
    return await PoolClient.connect(daemon.tcp_target, auth_token=f"{tenant}-token")


def tenant_figure(daemon: Daemon, name: str, tenant: str) -> float | None:
    return daemon.registry.get_sample_value(f"pagedkv:{name}", {"tenant": tenant})


async def test_a_tenants_limits_hold_over_all_its_sessions(daemon: Daemon) -> None:
    async with await connect(daemon, "alice") as alice:
        first = await alice.open_session("a1")
        second = await alice.open_session("a2")
        with pytest.raises(PoolExhausted, match="max_sessions"):
            await alice.open_session("a3")
        await first.allocate(1, 8)  # 2 blocks
        await second.allocate(1, 5)  # 2 more: the tenant's 4
        before = daemon.pool.stats()
        with pytest.raises(PoolExhausted, match=r"tenant alice .* max_blocks=4"):
            await second.append(1, 4)  # a third block for the second session
        with pytest.raises(PoolExhausted, match="max_blocks=4"):
            await first.fork(1, 2)  # two more entries
        assert daemon.pool.stats() == before  # refused calls changed nothing
        assert tenant_figure(daemon, "tenant_block_table_entries", "alice") == 4
        assert tenant_figure(daemon, "tenant_blocks_held", "alice") == 4
        assert tenant_figure(daemon, "tenant_sessions", "alice") == 2
        await first.free(1)  # room again, for alice's other session too
        await second.append(1, 4)
        await first.close()
        await alice.open_session("a3")  # a session slot is free again
        # Other tenants are not limited by alice's limits.
        async with await connect(daemon, "bob") as bob:
            sessions = [await bob.open_session(f"b{i}") for i in range(3)]
            await sessions[0].allocate(1, 40)
            assert tenant_figure(daemon, "tenant_blocks_held", "bob") == 10
    daemon.service.check_invariants()


async def test_salts_are_the_tenants_to_use(daemon: Daemon) -> None:
    async with await connect(daemon, "alice") as alice, \
            await connect(daemon, "bob") as bob, await connect(daemon, "carol") as carol:
        with pytest.raises(PermissionDenied, match="may not use cache salt b'other'"):
            await alice.open_session("a", cache_salt="other")
        writer = await alice.open_session("a", cache_salt="shared")
        await writer.allocate(1, token_ids=PROMPT)
        await writer.commit([1])  # alice certifies "shared"
        # carol lists the same salt: she shares alice's committed prefix.
        shared = await carol.open_session("c", cache_salt="shared")
        assert (await shared.allocate(1, token_ids=PROMPT)).num_cached_tokens == 8
        # bob may use any salt, but only inside his own namespace: no hit on alice's.
        own = await bob.open_session("b", cache_salt="shared")
        assert (await own.allocate(1, token_ids=PROMPT)).num_cached_tokens == 0
        await own.commit([1])
        again = await bob.open_session("b2", cache_salt="shared")
        assert (await again.allocate(1, token_ids=PROMPT)).num_cached_tokens == 8


async def test_tcp_callers_see_only_their_tenants_sessions(daemon: Daemon) -> None:
    async with await connect(daemon, "alice") as alice, \
            await connect(daemon, "bob") as bob, await connect(daemon, None) as local:
        mine = await alice.open_session("a")
        await mine.allocate(1, 4)
        stolen = bob.attach(mine.session_id, mine.block_size)
        with pytest.raises(NotFound, match="unknown session"):  # as if it did not exist
            await stolen.allocate(2, 4)
        with pytest.raises(NotFound):
            await stolen.keep_alive()
        with pytest.raises(NotFound):  # a public unix caller is a tenant's client too
            await local.attach(mine.session_id, mine.block_size).allocate(2, 4)
        # In a StepMany, alice's entry fails alone, as that Step would; bob's own is applied.
        his = await bob.open_session("b")
        await his.allocate(1, 4)
        answers = await bob.step_many([(stolen, Step([1])), (his, Step([1]))])
        assert isinstance(answers[0], SessionNotFound) and "unknown session" in str(answers[0])
        assert isinstance(answers[1], StepResult) and answers[1].num_tokens == [5]
        assert (await mine.block_tables([1]))[0].num_tokens == 4
        # A runner (the runner socket) acts with any session it is given.
        async with await PoolClient.connect(daemon.runners_target) as runner:
            reply = await runner.attach(mine.session_id, mine.block_size).allocate(2, 4)
        assert len(reply.block_ids) == 1
        assert tenant_figure(daemon, "tenant_block_table_entries", "alice") == 2  # alice's
        # Unix callers open sessions as the default tenant.
        await local.open_session("local")
        assert tenant_figure(daemon, "tenant_sessions", "default") == 1
    async with grpc.aio.insecure_channel(str(daemon.tcp_target)) as channel, \
            PoolClient(channel, auth_token="someone-else") as stranger:
        with pytest.raises(Unauthenticated):
            await stranger.open_session("x")


# ------------------------------------------------------------------------------ settings

def token(folder: Path, name: str, mode: int = 0o600) -> Path:
    path = folder / f"{name}.token"
    path.write_text(f"{name}-token\n")
    path.chmod(mode)
    return path


def toml_config(folder: Path, text: str, **settings: object) -> DaemonConfig:
    path = folder / "pagedkv.toml"
    path.write_text(text)
    return DaemonConfig(**{**load_toml(path), **settings})


def test_tenant_tables_build_the_tenants(tmp_path: Path) -> None:
    config = toml_config(tmp_path, f"""
listen = ["unix:///tmp/x.sock", "127.0.0.1:7001"]
insecure_tcp = true
unix_tenant = "ops"
[tenants.alice]
token_file = "{token(tmp_path, 'alice')}"
max_blocks = 64
max_sessions = 2
salts = ["shared"]
[tenants.ops]
""")
    tenants = config.build_tenants()
    alice = tenants.by_name["alice"]
    assert (alice.max_blocks, alice.max_sessions, alice.salts) == (64, 2, frozenset({b"shared"}))
    assert tenants.for_bearer(b"Bearer alice-token") is alice
    assert tenants.unix.name == "ops" and tenants.unix.bearer is None
    assert sorted(tenants.by_name) == ["alice", "default", "ops"]


def test_only_salts_marked_public_are_public(tmp_path: Path) -> None:
    """Listing a salt, even by one tenant alone, does not make it public; a salt every tenant
    listing it marks in public_salts is."""
    tenants = toml_config(tmp_path, """
[tenants.a]
salts = ["mine", "docs"]
public_salts = ["docs"]
[tenants.b]
salts = ["docs"]
public_salts = ["docs"]
""").build_tenants()
    assert tenants.public_salts == frozenset({b"docs"})
    assert tenants.by_name["a"].public_salts == frozenset({b"docs"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.a]\nuids = 1000\n", r"tenants.a.uids: expected a non-empty list of uids"),
        ("[tenants.a]\nuids = []\n", r"tenants.a.uids: expected a non-empty list of uids"),
        ("[tenants.a]\nuids = [true]\n", r"tenants.a.uids: expected a non-empty list of uids"),
        ("[tenants.a]\nuids = [-1]\n", r"tenants.a.uids: -1 is not a uid \(0..4294967294\)"),
        ("[tenants.a]\nuids = [7, 7]\n", r"tenants.a.uids: a uid is listed twice"),
        ("[tenants.a]\nuids = [7]\n[tenants.b]\nuids = [8, 7]\n",
         "uid 7 is in the uids of tenants a and b: a unix caller has one tenant"),
        ('unmapped_uids = "allow"\n', "unmapped_uids: expected one of refuse, unix_tenant"),
        ("[tenants.a]\nmax_blocks = -1\n", r"tenants.a.max_blocks: expected an integer >= 0"),
        ("[tenants.a]\nmax_sessions = true\n", "expected an integer"),
        ("[tenants.a]\nsalts = \"s\"\n", "expected a list of non-empty strings"),
        ("[tenants.a]\nquota = 1\n", "unknown key.*quota"),
        ("[tenants.a]\nsalts = [\"s\"]\ncertifies = \"s\"\n",
         r"tenants.a.certifies: expected a list of salts"),
        ("[tenants.a]\nsalts = [\"s\"]\ncertifies = [\"t\"]\n",
         r"tenants.a.certifies: 't' is not in tenants.a.salts"),
        ("[tenants.a]\ncertifies = [\"t\"]\n", r"'t' is not in tenants.a.salts"),
        ("[tenants.a]\nsalts = [\"s\"]\npublic_salts = [\"t\"]\n",
         r"tenants.a.public_salts: 't' is not in tenants.a.salts"),
        ("[tenants.a]\nsalts = [\"s\"]\npublic_salts = [\"s\"]\n[tenants.b]\nsalts = [\"s\"]\n",
         r"tenants.a.public_salts: 's' is also in tenants.b.salts, which does not mark it "
         r"public"),
        ("[tenants.\"a b\"]\n", "a tenant name is 1 to 64 letters"),
        ('unix_tenant = "nobody"\n', "unix_tenant: no tenant named 'nobody'"),
        ("tenants = 3\n", "expected .tenants.NAME. tables"),
    ],
)
def test_bad_tenant_settings_are_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        toml_config(tmp_path, text)


def test_uids_map_unix_callers_and_unmapped_ones_follow_the_setting(tmp_path: Path) -> None:
    text = ('unix_tenant = "ops"\n[tenants.ops]\n[tenants.alice]\nuids = [1000, 1001]\n'
            '[tenants.bob]\nuids = [0]\n')
    tenants = toml_config(tmp_path, text).build_tenants()
    assert tenants.maps_uids
    assert [tenants.for_uid(uid).name for uid in (1000, 1001, 0)] == ["alice", "alice", "bob"]
    assert tenants.for_uid(1002) is None  # refused by default
    lenient = toml_config(tmp_path, text, unmapped_uids="unix_tenant").build_tenants()
    assert lenient.for_uid(1002) is lenient.by_name["ops"]
    assert not toml_config(tmp_path, "[tenants.ops]\n").build_tenants().maps_uids
    # The gate names each connection beside the socket: a path too long for that is refused.
    long_socket = f"unix:///{'s' * 75}/d.sock"
    with pytest.raises(ConfigError, match=r"listen: .* the peer-credential gate names each "
                                          r"connection in .*d.sock.gate .* bytes over the 107"):
        toml_config(tmp_path, text, listen=(long_socket,))
    assert toml_config(tmp_path, "", listen=(long_socket,))  # without uids, no gate: fine


def test_tokens_are_distinct_readable_and_not_given_twice(tmp_path: Path) -> None:
    alice = token(tmp_path, "alice")
    with pytest.raises(ConfigError, match="tenants alice and bob have the same token"):
        toml_config(tmp_path, f'[tenants.alice]\ntoken_file = "{alice}"\n'
                              f'[tenants.bob]\ntoken_file = "{alice}"\n')
    with pytest.raises(ConfigError, match=r"tenants.bob.token_file: .* readable by every user"):
        toml_config(tmp_path, f'[tenants.bob]\ntoken_file = "{token(tmp_path, "bob", 0o644)}"\n')
    with pytest.raises(ConfigError, match="auth_token_file is the default tenant's token"):
        toml_config(tmp_path, f'auth_token_file = "{alice}"\n[tenants.default]\nmax_blocks = 1\n')
    # A tenant's token is enough for a TCP listener; no token at all is not.
    config = toml_config(tmp_path, f'listen = ["127.0.0.1:7001"]\ninsecure_tcp = true\n'
                                   f'[tenants.alice]\ntoken_file = "{alice}"\n')
    assert config.build_tenants().any_token
    with pytest.raises(ConfigError, match=r"a TCP listener needs auth_token_file .* or a tenant"):
        toml_config(tmp_path, 'listen = ["127.0.0.1:7001"]\ninsecure_tcp = true\n[tenants.a]\n')


async def test_a_real_daemon_serves_its_configured_tenants(tmp_path: Path) -> None:
    tcp_target, metrics = f"127.0.0.1:{free_tcp_port()}", f"127.0.0.1:{free_tcp_port()}"
    config = tmp_path / "pagedkv.toml"
    config.write_text(f'insecure_tcp = true\n[tenants.alice]\ntoken_file = '
                      f'"{token(tmp_path, "alice")}"\nmax_sessions = 1\n')
    with pagedkvd("--config", str(config), "--listen", tcp_target,
                  "--metrics-listen", metrics) as running:
        async with await PoolClient.connect(tcp_target, auth_token="alice-token") as alice:
            await alice.open_session("only")
            with pytest.raises(PoolExhausted, match="tenant alice has 1 sessions open"):
                await alice.open_session("second")
            samples = tenant_samples(metrics)
            assert samples[("pagedkv:tenant_sessions", "alice")] == 1
            assert samples[("pagedkv:tenant_max_sessions", "alice")] == 1
            assert samples[("pagedkv:tenant_sessions", "default")] == 0
        assert running.stop() == 0
