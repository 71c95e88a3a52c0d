"""The snapshot file: written atomically 0600, read back exactly, refused across versions,
identities and corruption with the difference named, and set aside when refused."""

import hashlib
import stat
from pathlib import Path

import msgpack
import pytest

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.core.pool_image import pool_image, restore_image
from pagedkv.daemon.process import snapshot_file
from pagedkv.daemon.process.snapshot_file import (
    MAGIC,
    SnapshotRefused,
    read_snapshot,
    set_aside,
    write_snapshot,
)

IDENTITY = {"num_blocks": 8, "block_size": 4, "blocks_per_page": 1, "dtype": "float16",
            "allocator": "paged", "prefix_hash": "sha256"}


def a_pool() -> BlockPool:
    pool = BlockPool(8, 4)
    pool.allocate(("s", 1), 6, [1, 2, 3, 4, 5, 6])
    pool.commit([("s", 1)])
    return pool


def test_a_pool_comes_back_exactly(tmp_path: Path) -> None:
    path = tmp_path / "snapshot"
    pool = a_pool()
    write_snapshot(path, IDENTITY, {"pool": pool_image(pool)})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot"]  # no temporary left
    again = BlockPool(8, 4)
    restore_image(again, read_snapshot(path, dict(IDENTITY))["pool"])
    again.check_invariants()
    assert again.block_table(("s", 1)) == pool.block_table(("s", 1))
    assert again.stats() == pool.stats()
    assert again.allocate("t", 4, [1, 2, 3, 4]).num_cached_tokens == 4  # the prefix cache


def test_another_version_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "snapshot"
    current = snapshot_file.SNAPSHOT_VERSION
    monkeypatch.setattr(snapshot_file, "SNAPSHOT_VERSION", current + 1)  # a later daemon's
    write_snapshot(path, IDENTITY, {})
    monkeypatch.undo()
    with pytest.raises(SnapshotRefused, match=f"snapshot version {current + 1}, this daemon "
                       f"reads version {current}"):
        read_snapshot(path, IDENTITY)


@pytest.mark.parametrize(("name", "value", "named"), [
    ("num_blocks", 16, "num_blocks 8 != 16"),
    ("block_size", 16, "block_size 4 != 16"),
    ("dtype", "bfloat16", "dtype 'float16' != 'bfloat16'"),
])
def test_another_pool_is_refused_naming_what_differs(tmp_path: Path, name: str, value: object,
                                                     named: str) -> None:
    path = tmp_path / "snapshot"
    write_snapshot(path, IDENTITY, {})
    with pytest.raises(SnapshotRefused, match=named):
        read_snapshot(path, {**IDENTITY, name: value})


def test_corruption_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "snapshot"
    write_snapshot(path, IDENTITY, {"x": 1})
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotRefused, match="checksum mismatch"):
        read_snapshot(path, IDENTITY)
    path.write_bytes(b"junk")
    with pytest.raises(SnapshotRefused, match="not a pagedkv snapshot"):
        read_snapshot(path, IDENTITY)


def test_a_body_with_code_is_plain_data(tmp_path: Path) -> None:
    """msgpack's extension types are never turned into objects: an ext comes back inert."""
    body = msgpack.packb({"version": snapshot_file.SNAPSHOT_VERSION, "identity": IDENTITY,
                          "state": msgpack.ExtType(1, b"os.system")}, use_bin_type=True)
    path = tmp_path / "snapshot"
    path.write_bytes(MAGIC + hashlib.sha256(body).digest() + body)
    assert isinstance(read_snapshot(path, IDENTITY), msgpack.ExtType)


def test_set_aside_keeps_it_out_of_the_way(tmp_path: Path) -> None:
    path = tmp_path / "snapshot"
    write_snapshot(path, IDENTITY, {})
    aside = set_aside(path)
    assert not path.exists() and aside.name == "snapshot.refused"
