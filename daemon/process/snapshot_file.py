"""The snapshot file a stopping daemon leaves for the next one: versioned, checked, atomic.

Layout: MAGIC, the SHA-256 of the body, then the body: msgpack of {"version", "identity",
"state"}. msgpack, not pickle: reading a snapshot builds plain data and never runs code. The
identity names the pool the state describes (geometry, block count, page size, dtype,
allocator, prefix hash): the next daemon restores the state only onto the same pool memory,
and a snapshot of another version or identity is refused with the differences named, never
half-applied (`set_aside` moves it out of the way first).

Written atomically: a temporary file in the same folder, fsynced, then renamed over the path,
so a reader sees the old snapshot or the whole new one. Mode 0600: it holds token ids.
"""

import hashlib
import os
from pathlib import Path
from typing import Any

import msgpack

# The format's version: bumped whenever the state's layout changes.
SNAPSHOT_VERSION = 3  # 2: the KV events' seq; 3: models, formats, pages, host memory
MAGIC = b"PKVSNAP\n"
_DIGEST = 32  # SHA-256 bytes after MAGIC


class SnapshotRefused(Exception):
    """A snapshot that must not be restored; the message says why."""


def write_snapshot(path: Path, identity: dict[str, Any], state: dict[str, Any]) -> None:
    """Write the snapshot of `state` for a pool of `identity` at `path`, atomically, 0600."""
    body = msgpack.packb({"version": SNAPSHOT_VERSION, "identity": identity, "state": state},
                         use_bin_type=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(MAGIC + hashlib.sha256(body).digest() + body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def read_snapshot(path: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The state kept at `path` for a pool of `identity`. SnapshotRefused: not a snapshot, a
    wrong checksum, another version, or another identity (every difference named)."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise SnapshotRefused(f"{path} is not a pagedkv snapshot")
    digest, body = data[len(MAGIC):len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise SnapshotRefused(f"{path}: checksum mismatch (truncated or corrupted)")
    try:
        snapshot = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData) as exc:
        raise SnapshotRefused(f"{path}: unreadable body ({exc})") from exc
    if not isinstance(snapshot, dict) or snapshot.get("version") != SNAPSHOT_VERSION:
        version = snapshot.get("version") if isinstance(snapshot, dict) else None
        raise SnapshotRefused(f"{path}: snapshot version {version!r}, this daemon reads "
                              f"version {SNAPSHOT_VERSION}")
    differs = identity_differences(snapshot.get("identity"), identity)
    if differs:
        raise SnapshotRefused(f"{path}: snapshot of another pool: {differs}")
    state: dict[str, Any] = snapshot["state"]
    return state


def identity_differences(kept: object, current: dict[str, Any]) -> str:
    """'' when `kept` is `current`, else each differing field as `name kept != current`."""
    if not isinstance(kept, dict):
        return "no identity"
    names = sorted(set(kept) | set(current))
    return ", ".join(f"{name} {kept.get(name)!r} != {current.get(name)!r}" for name in names
                     if _plain(kept.get(name)) != _plain(current.get(name)))


def set_aside(path: Path) -> Path:
    """Rename a refused snapshot beside itself (`<name>.refused`), so it is never applied, yet
    kept for a person to look at; returns the new path."""
    aside = path.with_name(path.name + ".refused")
    os.replace(path, aside)
    return aside


def _plain(value: object) -> object:
    """Tuples as lists: what a value becomes once written and read back."""
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
