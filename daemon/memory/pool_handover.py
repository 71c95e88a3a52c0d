"""The pool memory across a daemon restart (upgrade or crash), through systemd's file
descriptor store (`pagedkv.process.fd_store`).

    handover = PoolHandover.from_environment()      # what the last daemon stored, taken once
    cleanup_stale_files(shm_dir, keep=handover.files())
    arena = handover.adopt(layout, shm_dir, mode, group) or KVMemory.create(...)
    handover.offer(arena, layout)                   # for the next daemon, before READY=1

A CPU pool is a file in /dev/shm. At start, once allocated, the daemon stores a descriptor of it
under the name `pagedkv-pool.<pool id>.<layout>` and leaves the file in place when it exits, so
the memory outlives the process whether it stops or crashes. The next daemon receives the
descriptor and adopts the file (renamed as its own, `KVMemory.adopt`) only when the layout it
would allocate is the stored one: pages, page bytes, and its own format's dtype, layers, KV
heads, head_dim and block size. Anything else is released: its stored descriptors removed
(FDSTOREREMOVE), its file unlinked, one log line saying why, and the daemon starts cold.

The host tier's memory (daemon/memory/host_memory.py: a file like the pool's, never mapped by
a runner) is handed over the same way by a second `PoolHandover` under its own name prefix
(`HOST_FD_PREFIX`), with the slots as its pages.

Outside a unit with `FileDescriptorStoreMax=` ($FDSTORE unset) nothing is stored: the file is
removed at exit as before, unless restore = auto and a runner keeps its descriptor to hand
back (pool_keepers.py: the passed descriptors then come from it, and go through the same
adoption). A CUDA pool is stored when it is a VMM allocation (restore = auto: kv_memory.py
`create(vmm=True)`): its exported descriptor is stored under the same name, and a daemon on CUDA
adopts a passed one of its layout with `KVMemory.adopt_vmm`; a cudaMalloc pool (restore =
never) dies with its process and is not stored.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pagedkv.daemon.memory.kv_memory import KVMemory, pool_file_name
from pagedkv.memory.cuda_vmm import CudaVmmError
from pagedkv.memory.device_memory import pool_device
from pagedkv.memory.pool_files import hold
from pagedkv.process.fd_store import listened_fds, remove_fds, store_enabled, store_fds
from pagedkv.process.log_setup import get_logger

log = get_logger(__name__)

# Every stored pool descriptor's name starts with this; the host tier's with the other.
FD_NAME_PREFIX = "pagedkv-pool"
HOST_FD_PREFIX = "pagedkv-host"


def _fd_name_pattern(prefix: str) -> re.Pattern[str]:
    """A stored name under `prefix`: group 1 the pool id, group 2 the layout."""
    return re.compile(rf"{re.escape(prefix)}\.([0-9a-f]+)\.(.+)")


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """What a pool's bytes mean: a daemon adopts a stored pool only when its layout is this."""

    # Pages in the arena, and bytes in each.
    num_pages: int
    page_bytes: int
    # The daemon's own format: canonical KV dtype, and the shape of its blocks.
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def text(self) -> str:
        """e.g. "64x16384.float16.L2H2D64B16": a stored descriptor's name carries it."""
        return (f"{self.num_pages}x{self.page_bytes}.{self.dtype}.L{self.num_layers}"
                f"H{self.num_kv_heads}D{self.head_dim}B{self.block_size}")

    def fd_name(self, pool_id: str, prefix: str = FD_NAME_PREFIX) -> str:
        return f"{prefix}.{pool_id}.{self.text()}"


class PoolHandover:
    """The pool descriptors passed to this daemon, until adopted or released."""

    def __init__(self, passed: dict[str, list[int]], prefix: str = FD_NAME_PREFIX) -> None:
        # The stored names this handover owns (the pool's, or the host tier's).
        self._prefix = prefix
        self._pattern = _fd_name_pattern(prefix)
        # Stored descriptors by name; descriptors under other names are not ours.
        self._passed = {name: fds for name, fds in passed.items()
                        if self._pattern.fullmatch(name)}
        # The adopted pool's stored name: removed from the store once the arena is stored
        # under its new name (`offer`), so a crash in between loses nothing.
        self._superseded: str | None = None

    @classmethod
    def from_environment(cls) -> PoolHandover:
        """What the service manager passed ($LISTEN_FDS ...), taken from the environment."""
        return cls(listened_fds())

    def files(self) -> list[Path]:
        """The files of the passed descriptors: not stale while they may be adopted."""
        return [_file_of(fd) for fds in self._passed.values() for fd in fds]

    def adopt(self, layout: PoolLayout, shm_dir: str, mode: int, group: int | None,
              device: str = "cpu") -> KVMemory | None:
        """The stored arena if one has `layout` (its bytes kept), a file on the CPU, a VMM
        allocation on a CUDA `device`; None otherwise. Every other passed pool is released,
        with a log line saying why."""
        adopted: KVMemory | None = None
        for name, fds in self._passed.items():
            if adopted is None:
                adopted, reason = _try_adopt(self._pattern.fullmatch(name), fds, layout,
                                             _Target(shm_dir, mode, group, device))
                if adopted is not None:
                    for fd in fds:
                        os.close(fd)
                    self._superseded = name
                    continue
            else:
                reason = "this daemon adopted another stored pool"
            log.warning("stored pool memory released, starting cold", fd_name=name,
                        reason=reason)
            _release(name, fds, keep=adopted.shm_path if adopted is not None else "")
        self._passed.clear()
        return adopted

    def offer(self, arena: KVMemory, layout: PoolLayout) -> bool:
        """Store a descriptor of `arena`'s file (or VMM allocation) for the next daemon and
        keep the file at exit (then drop the adopted pool's old name from the store); False
        (nothing stored) outside a descriptor store or for a CUDA IPC arena."""
        stored = _store(arena, layout.fd_name(arena.pool_id, self._prefix))
        if self._superseded is not None:
            remove_fds(self._superseded)
            self._superseded = None
        return stored


def _store(arena: KVMemory, fd_name: str) -> bool:
    """`offer`'s storing."""
    if not store_enabled():
        return False
    if arena.memory_fd >= 0:  # a VMM allocation: its exported descriptor keeps it
        return store_fds(fd_name, [arena.memory_fd])
    if not arena.shm_path:
        log.warning("pool memory on CUDA is not kept across restarts without restore = auto "
                    "(a VMM allocation): the next daemon starts cold")
        return False
    fd = os.open(arena.shm_path, os.O_RDWR | os.O_CLOEXEC)
    try:
        hold(fd)  # another daemon's start leaves the file while the store keeps it
        stored = store_fds(fd_name, [fd])
    finally:
        os.close(fd)
    if stored:
        arena.keep_file()
    return stored


@dataclass(frozen=True, slots=True)
class _Target:
    """Where an adopted arena goes."""

    # A CPU arena's folder, and the mode and group its file is given.
    shm_dir: str
    mode: int
    group: int | None
    # The daemon's device: "cpu" adopts a file, a CUDA device a VMM allocation.
    device: str


def _try_adopt(match: re.Match[str] | None, fds: list[int], layout: PoolLayout,
               target: _Target) -> tuple[KVMemory | None, str]:
    """The arena stored under the name `match` parsed when it has `layout`, or None and why
    not."""
    assert match is not None, "only our names are kept"
    previous, stored_layout = match.groups()
    if stored_layout != layout.text() or len(fds) != 1:
        return None, (f"it is {stored_layout} ({len(fds)} descriptors), this daemon allocates "
                      f"{layout.text()}")
    try:
        if pool_device(target.device).type == "cuda":
            arena = KVMemory.adopt_vmm(fds[0], layout.num_pages, layout.page_bytes,
                                       target.device, previous)
        else:
            arena = KVMemory.adopt(fds[0], layout.num_pages, layout.page_bytes, target.shm_dir,
                                   mode=target.mode, group=target.group)
    except (ValueError, CudaVmmError) as exc:  # another kind of memory, or a driver refusal
        return None, str(exc)
    log.info("pool memory adopted", previous_pool_id=previous, pool_id=arena.pool_id,
             layout=stored_layout)
    return arena, ""


def _file_of(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


def _release(name: str, fds: list[int], keep: str) -> None:
    """Drop the service manager's copies of `name` and ours, and unlink their pool file unless
    it is `keep` (the adopted one: two names of one file are left by a crash in `offer`)."""
    for fd in fds:
        path = _file_of(fd)
        if pool_file_name(path.name) and str(path) != keep:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), path.stat()):  # not a new file of that name
                    path.unlink()
        os.close(fd)
    remove_fds(name)
