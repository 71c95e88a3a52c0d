"""The prefix cache's hash choice (`prefix_hash`): sha256 (default) or xxh3_128.

Both hash the same bytes into the same chain, so a pool keyed with either shares exactly the
same blocks; different content gets different keys and the salt still separates namespaces.
xxh3_128 is refused at config time where several tenants share the daemon, unless the operator
allows it; the core imports xxhash only when that hash is chosen; the daemon builds its pool
with the configured hash.
"""

import asyncio
import subprocess
import sys
import tempfile
from hashlib import sha256
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash

from pagedkv.daemon.core import BlockPool, NoFit, PrefixHash, SeqUpdate
from pagedkv.daemon.core.content_keys import ContentKeys
from pagedkv.daemon.process import server
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_config import parse

HASHES: tuple[PrefixHash, ...] = ("sha256", "xxh3_128")
BLOCK_SIZE = 4


def ok(result: object) -> SeqUpdate:
    assert isinstance(result, SeqUpdate), result
    return result


def replay(pool: BlockPool) -> list[object]:
    """A seeded mix of prompts behind shared prefixes, decodes with ids, commits, forks,
    copy-on-write and frees on a pool small enough to evict: every answer, in order."""
    rng = np.random.default_rng(5)
    prefixes = [rng.integers(0, 50, n, dtype=np.int64) for n in (0, 4, 9, 16)]
    seen: list[object] = []
    live: list[int] = []
    for seq in range(60):
        prompt = np.concatenate([prefixes[seq % 4], rng.integers(0, 50, int(rng.integers(1, 9)),
                                                                 dtype=np.int64)])
        result = pool.allocate(seq, len(prompt), prompt, salt=b"s" if seq % 5 else b"")
        seen.append(result)
        if isinstance(result, NoFit):
            continue
        live.append(seq)
        pool.commit([seq])
        if seq % 7 == 0:
            seen.append(pool.fork(seq, 1000 + seq))
            seen.append(pool.copy_on_write(1000 + seq, 0))
            seen.append(pool.free(1000 + seq))
        for _ in range(3):
            step = pool.append_batch(live, 1, rng.integers(0, 50, (len(live), 1)))
            seen.append(step if isinstance(step, NoFit) else
                        (step.slot_mapping.tolist(), step.copies))
            pool.commit(live)
        if len(live) > 4:
            seen.append(pool.free(live.pop(0)))
        seen.append(pool.stats())
        pool.check_invariants()
    return seen


def test_both_hashes_share_exactly_the_same_blocks() -> None:
    pools = {algo: BlockPool(24, BLOCK_SIZE, prefix_hash=algo) for algo in HASHES}
    answers = {algo: replay(pool) for algo, pool in pools.items()}
    assert answers["sha256"] == answers["xxh3_128"]  # same tables, hits, slots, copies, stats
    stats = pools["sha256"].stats()
    assert stats.prefix_cache_hits > 0 and stats.cached_blocks > 0  # the cache was exercised
    assert any(isinstance(a, SeqUpdate) and a.num_cached_tokens for a in answers["sha256"])
    # The same blocks are cached, under keys of each hash.
    keys = {algo: pool.cached_keys() for algo, pool in pools.items()}
    assert keys["sha256"].keys() == keys["xxh3_128"].keys()
    assert {len(key) for key in keys["sha256"].values()} == {32}
    assert {len(key) for key in keys["xxh3_128"].values()} == {16}


@pytest.mark.parametrize("algo", HASHES)
def test_different_content_gets_different_keys(algo: PrefixHash) -> None:
    keys = ContentKeys(algo)
    tokens = np.arange(12, dtype=np.int64).reshape(3, BLOCK_SIZE)
    changed = tokens.copy()
    changed[1, 2] += 1  # one token of the middle block
    root = keys.root(b"")
    same, other = keys.chain(root, tokens), keys.chain(root, changed)
    assert same[0] == other[0]
    assert same[1] != other[1] and same[2] != other[2]  # the chain carries the change on
    assert len(set(same)) == 3
    # The one-block form agrees with the chain.
    assert [keys.block(parent, block.tobytes())
            for parent, block in zip([root, *same[:2]], tokens, strict=True)] == same


def test_the_keys_are_the_named_hash_of_the_chain() -> None:
    tokens = np.arange(BLOCK_SIZE, dtype=np.int64)
    data = tokens.tobytes()
    # sha256: byte for byte the keys the daemon has always made.
    root = sha256(b"pagedkv-root:salt").digest()
    assert ContentKeys("sha256").chain(ContentKeys("sha256").root(b"salt"), tokens[None]) == \
        [sha256(root + data).digest()]
    fast = ContentKeys("xxh3_128")
    root = xxhash.xxh3_128_digest(b"pagedkv-root:salt")
    assert fast.chain(fast.root(b"salt"), tokens[None]) == [xxhash.xxh3_128_digest(root + data)]


@pytest.mark.parametrize("algo", HASHES)
def test_the_salt_separates_namespaces_under_both_hashes(algo: PrefixHash) -> None:
    pool = BlockPool(16, BLOCK_SIZE, prefix_hash=algo)
    prompt = np.arange(9, dtype=np.int64)
    assert ok(pool.allocate("a", 9, prompt, salt=b"x")).num_cached_tokens == 0
    pool.commit(["a"])
    assert ok(pool.allocate("other", 9, prompt, salt=b"y")).num_cached_tokens == 0
    assert ok(pool.allocate("none", 9, prompt)).num_cached_tokens == 0
    hit = ok(pool.allocate("same", 9, prompt, salt=b"x"))
    assert hit.num_cached_tokens == 8 and hit.block_table[:2] == pool.block_table("a")[:2]


def test_a_sha256_daemon_needs_no_xxhash() -> None:
    # xxhash made unimportable: the default pool works, and xxh3_128 says what is missing.
    code = ("import sys; sys.modules['xxhash'] = None\n"
            "from pagedkv.daemon.process.server import serve\n"
            "from pagedkv.daemon.core import BlockPool\n"
            "pool = BlockPool(8, 4); pool.allocate(1, 8, list(range(8))); pool.commit([1])\n"
            "try:\n    BlockPool(8, 4, prefix_hash='xxh3_128')\n"
            "except ImportError as exc:\n    print('refused:', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.startswith("refused:") and "xxhash" in done.stdout


# ---------------------------------------------------------------- the setting, and its refusal

def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pagedkv.toml"
    path.write_text(text)
    return str(path)


def test_the_hash_is_chosen_by_toml_or_flag(tmp_path: Path) -> None:
    assert parse([]).prefix_hash == "sha256"
    assert parse(["--prefix-hash", "xxh3_128"]).prefix_hash == "xxh3_128"
    toml = write(tmp_path, 'prefix_hash = "xxh3_128"\n')
    assert parse(["--config", toml]).prefix_hash == "xxh3_128"
    assert parse(["--config", toml, "--prefix-hash", "sha256"]).prefix_hash == "sha256"
    with pytest.raises(ConfigError, match="prefix_hash must be one of sha256, xxh3_128, got 'md5'"):
        parse(["--config", write(tmp_path, 'prefix_hash = "md5"\n')])


@pytest.mark.parametrize("tables", [
    # alice over TCP, and unix callers as the default tenant.
    '[tenants.alice]\ntoken_file = "{token}"\n',
    # Two tenants listing one global salt (unix callers as a).
    'unix_tenant = "a"\n[tenants.a]\nsalts = ["s"]\n[tenants.b]\nsalts = ["s"]\n',
])
def test_xxh3_is_refused_where_several_tenants_share_the_daemon(
        tmp_path: Path, token_file: Path, tables: str) -> None:
    toml = write(tmp_path, 'prefix_hash = "xxh3_128"\n' + tables.format(token=token_file))
    with pytest.raises(ConfigError, match=r'prefix_hash = "xxh3_128" with tenants .*'
                                          r"allow_fast_hash_with_tenants = true"):
        parse(["--config", toml])
    assert parse(["--config", toml, "--prefix-hash", "sha256"]).prefix_hash == "sha256"
    allowed = parse(["--config", toml, "--allow-fast-hash-with-tenants"])
    assert allowed.prefix_hash == "xxh3_128" and allowed.allow_fast_hash_with_tenants
    toml = write(tmp_path, 'prefix_hash = "xxh3_128"\nallow_fast_hash_with_tenants = true\n'
                 + tables.format(token=token_file))
    assert parse(["--config", toml]).prefix_hash == "xxh3_128"


def test_xxh3_is_allowed_for_one_tenant(tmp_path: Path, token_file: Path) -> None:
    # The shortcut token, and a tenant that is also the unix callers' one: one tenant each.
    assert parse(["--prefix-hash", "xxh3_128", "--auth-token-file",
                  str(token_file)]).prefix_hash == "xxh3_128"
    toml = write(tmp_path, f'prefix_hash = "xxh3_128"\nunix_tenant = "alice"\n'
                 f'[tenants.alice]\ntoken_file = "{token_file}"\nsalts = ["s"]\n')
    assert parse(["--config", toml]).prefix_hash == "xxh3_128"


async def test_the_daemon_keys_its_pool_with_the_configured_hash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # serve() as pagedkvd runs it, over gRPC: a committed block of the pool it built is cached
    # under a 16-byte XXH3-128 key (a SHA-256 key has 32).
    built: list[BlockPool] = []

    def keep(*args: Any, **kwargs: Any) -> BlockPool:
        built.append(own_pool(*args, **kwargs))
        return built[-1]

    own_pool = server.own_pool
    monkeypatch.setattr(server, "own_pool", keep)
    with tempfile.TemporaryDirectory(prefix="pkvh-") as folder:
        stop = asyncio.Event()
        config = DaemonConfig(listen=(f"unix://{folder}/d.sock",), shm_dir=Path(folder),
                              num_blocks=8, prefix_hash="xxh3_128")
        task = asyncio.create_task(server.serve(config, stop))
        async with grpc.aio.insecure_channel(f"unix://{folder}/d.sock") as channel:
            stub = kvpool_pb2_grpc.KVPoolStub(channel)
            session = (await stub.OpenSession(pb.OpenSessionRequest(client_name="h"),
                                              wait_for_ready=True, timeout=30)).session_id
            await stub.Allocate(pb.AllocateRequest(session_id=session, seq_id=1, num_tokens=16,
                                                   token_ids=range(16)), timeout=30)
            await stub.Commit(pb.CommitRequest(session_id=session, seq_ids=[1]), timeout=30)
            await stub.Free(pb.FreeRequest(session_id=session, seq_id=1), timeout=30)
            assert [len(key) for key in built[0].cached_keys().values()] == [16]
        stop.set()
        await asyncio.wait_for(task, 30)
