"""The KV pool's memory: one arena of num_pages pages of page_bytes, allocated once at start,
shared with co-located runners, and viewed by every model format.

`KVMemory` owns the bytes; `view(...)` reinterprets the whole arena in one format's dtype and
block-major shape (`format_memory.FormatMemory`): page p is blocks [p * k, (p + 1) * k) of every
format whose bytes_per_block is page_bytes / k (kvpool.proto, "Models and pages"). A page is
page_bytes at offset p * page_bytes whatever the format, so `zero_pages` clears a page before
another format uses it. A one-model daemon's arena has page_bytes = its bytes_per_block: its
view's blocks are the pages (`KVPoolMemory`).

Two backings, chosen by the device:
- CPU: a file in /dev/shm (tmpfs) sized exactly and reserved up front with posix_fallocate, so
  a too-small /dev/shm fails at start instead of with SIGBUS later; mapped with
  `torch.from_file(shared=True)`. Whoever may open the file reads and writes every tenant's
  K/V: it is the daemon's user's alone (0o600), or its runner group's too (0o660), never
  every user's. Its name carries the owner's pid so that a restarted daemon
  can remove what a crashed one left (`cleanup_stale_files`). Under systemd's file descriptor
  store the file outlives its daemon: the next one adopts it, bytes and all (`adopt`;
  `pool_handover.py` says when), and the stored descriptor's shared lock (`hold`) keeps any
  other daemon's cleanup, on the same /dev/shm, away from it meanwhile.
- CUDA: one device allocation of the arena's bytes, plus its CUDA IPC handle (`reduce_tensor`)
  pickled once into bytes; every format's handle carries that same payload with its own shape
  and dtype, and a runner reinterprets the allocation it opens (`pagedkv.memory.attach`). The
  daemon keeps the allocation alive for as long as runners may be attached.
- CUDA kept across restarts (`create(..., vmm=True)`, restore = auto): a VMM allocation
  (memory/cuda_vmm.py) exported as a POSIX descriptor (`memory_fd`), which the daemon serves to
  its runners over its memory socket (memory_server.py; handles of kind "cuda_vmm" name the
  pool id as the memory's id) and stores for the next daemon, which adopts it (`adopt_vmm`).
  The memory lives while any descriptor, handle or mapping of it does.

A runner in another process maps a view with `pagedkv.memory.attach.attach_pool(handle)`.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
from collections.abc import Collection
from pathlib import Path
from types import TracebackType

import numpy.typing as npt
import torch
from torch.multiprocessing.reductions import reduce_tensor

from pagedkv.daemon.memory.format_memory import FormatMemory, checked_index
from pagedkv.daemon.memory.shm_holders import reserve_failure
from pagedkv.memory import PoolMemoryHandle, pool_shape
from pagedkv.memory.cuda_vmm import VmmArena
from pagedkv.memory.device_memory import pool_device
from pagedkv.memory.dtypes import torch_dtype
from pagedkv.memory.pool_files import held
from pagedkv.vocab.geometry import ModelGeometry, canonical_dtype


class KVMemory:
    """Owns the arena; create with `KVMemory.create`, release with `close`."""

    def __init__(self, pages: torch.Tensor, kind: str, shm_path: str, ipc_payload: bytes,
                 pool_id: str, adopted_from: str = "", memory_fd: int = -1) -> None:
        # The arena as [num_pages, page_bytes] uint8; None once closed.
        self._pages: torch.Tensor | None = pages
        # What every view's handle shares: "shm", "cuda_ipc" or "cuda_vmm", the file, the IPC
        # payload.
        self._kind, self._shm_path, self._ipc_payload = kind, shm_path, ipc_payload
        # Pages, and bytes in each: page p is bytes [p * page_bytes, (p + 1) * page_bytes).
        self.num_pages, self.page_bytes = pages.shape
        # Random id of this pool instance; also part of the shm file name.
        self.pool_id = pool_id
        # Views handed out, released when the arena closes.
        self._views: list[FormatMemory] = []
        # The pool id of the daemon whose memory this is ("" when allocated here): its bytes
        # are that pool's (`adopt`).
        self.adopted_from = adopted_from
        # Whether close() leaves the shm file for the next daemon (its descriptor is in the
        # service manager's store: `keep_file`).
        self._keep_file = False
        # A "cuda_vmm" arena's exported descriptor (this object's: closed by close); -1 else.
        self.memory_fd = memory_fd

    @classmethod
    def create(cls, num_pages: int, page_bytes: int, device: str = "cpu",
               shm_dir: str = "/dev/shm", name_prefix: str = "pagedkv", mode: int = 0o600,
               group: int | None = None, vmm: bool = False) -> KVMemory:
        """Allocate a zeroed arena; `mode` is the shm file's (0o660 to share with `group`, the
        runners' gid: the file's group is the daemon's own without it). `vmm`: on CUDA, a VMM
        allocation that can outlive this process (a CPU arena's file always can)."""
        if num_pages <= 0 or page_bytes <= 0:
            raise ValueError(f"num_pages and page_bytes must be positive, got {num_pages} "
                             f"and {page_bytes}")
        _check_mode(mode)
        pool_id = secrets.token_hex(8)
        target = pool_device(device)
        if target.type == "cpu":
            path = Path(shm_dir) / f"{name_prefix}-{os.getpid()}-{pool_id}.kv"
            pages = _create_shm(path, num_pages * page_bytes, mode, group)
            return cls(pages.view(num_pages, page_bytes), "shm", str(path), b"", pool_id)
        if vmm:
            return _vmm_memory(VmmArena.create(num_pages * page_bytes, _index(target)), num_pages,
                               page_bytes, pool_id, zero=True)
        # Zeroed, not empty: the caching allocator may hand back another tensor's data.
        arena = torch.zeros(num_pages * page_bytes, dtype=torch.uint8, device=target)
        # torch leaves reduce_tensor unannotated; it returns (rebuild function, args).
        payload = pickle.dumps(reduce_tensor(arena))  # type: ignore[no-untyped-call]
        return cls(arena.view(num_pages, page_bytes), "cuda_ipc", "", payload, pool_id)

    @classmethod
    def adopt(cls, fd: int, num_pages: int, page_bytes: int, shm_dir: str = "/dev/shm",
              name_prefix: str = "pagedkv", mode: int = 0o600,
              group: int | None = None) -> KVMemory:
        """The arena of a previous daemon from a descriptor of its shm file (passed by the
        service manager), its bytes kept: the file is renamed as this daemon's (its pid, a new
        pool id) and given `mode` and `group`. ValueError, nothing changed, when the file is
        no longer in `shm_dir` under a previous daemon's name or is not num_pages * page_bytes
        long. The caller still owns `fd`."""
        _check_mode(mode)
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name.endswith(" (deleted)"):
            raise ValueError(f"the passed pool file {path.name.removesuffix(' (deleted)')} was "
                             "removed")
        match = pool_file_name(path.name, name_prefix)
        if path.parent != Path(shm_dir) or match is None:
            raise ValueError(f"the passed pool file {path} is not a pool file in {shm_dir}")
        described, passed = os.fstat(fd), path.stat()  # the path may name another file now
        if (described.st_dev, described.st_ino) != (passed.st_dev, passed.st_ino):
            raise ValueError(f"the passed pool file is no longer at {path}")
        if described.st_size != num_pages * page_bytes:
            raise ValueError(f"the passed pool file {path} holds {described.st_size} bytes, "
                             f"{num_pages} pages of {page_bytes} need {num_pages * page_bytes}")
        _set_access(fd, path, mode, group)
        pool_id = secrets.token_hex(8)
        target = Path(shm_dir) / f"{name_prefix}-{os.getpid()}-{pool_id}.kv"
        path.rename(target)
        pages = torch.from_file(str(target), shared=True, size=num_pages * page_bytes,
                                dtype=torch.uint8)
        return cls(pages.view(num_pages, page_bytes), "shm", str(target), b"", pool_id,
                   adopted_from=match.group(2))

    @classmethod
    def adopt_vmm(cls, fd: int, num_pages: int, page_bytes: int, device: str,
                  previous_pool_id: str) -> KVMemory:
        """The VMM arena of a previous daemon (pool `previous_pool_id`) from its exported
        descriptor `fd` (the caller still owns it), its bytes kept. CudaVmmError when `fd` is
        not a VMM allocation of that size on `device`."""
        arena = VmmArena.import_fd(fd, num_pages * page_bytes, _index(pool_device(device)))
        return _vmm_memory(arena, num_pages, page_bytes, secrets.token_hex(8), zero=False,
                           adopted_from=previous_pool_id)

    def keep_file(self) -> None:
        """Leave the shm file in place on close: its descriptor is in the service manager's
        store, and the next daemon adopts it (`adopt`) or removes it as stale."""
        self._keep_file = True

    @property
    def shm_path(self) -> str:
        """The CPU arena's file; "" on CUDA."""
        return self._shm_path

    @property
    def pages(self) -> torch.Tensor:
        """The arena as [num_pages, page_bytes] uint8."""
        if self._pages is None:
            raise ValueError(f"pool memory {self.pool_id} is closed")
        return self._pages

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def view(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str | torch.dtype,
             block_size: int) -> FormatMemory:
        """The arena as one format's blocks: [num_pages * blocks_per_page, num_layers, 2,
        block_size, num_kv_heads, head_dim] of `dtype`; ValueError, nothing made, when the
        format's bytes_per_block does not divide page_bytes."""
        name = canonical_dtype(str(dtype))
        element = torch_dtype(name)
        if min(num_layers, num_kv_heads, head_dim, block_size) <= 0:
            raise ValueError(f"a format's num_layers, num_kv_heads, head_dim and block_size must "
                             f"be positive, got {num_layers}, {num_kv_heads}, {head_dim} and "
                             f"{block_size}")
        bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * element.itemsize
        if self.page_bytes % bytes_per_block:
            raise ValueError(f"a block of {bytes_per_block} bytes ({num_layers} layers, "
                             f"{num_kv_heads} KV heads, head_dim {head_dim}, {name}, block_size "
                             f"{block_size}) does not divide the page of {self.page_bytes} bytes")
        blocks_per_page = self.page_bytes // bytes_per_block
        shape = pool_shape(num_layers=num_layers, num_blocks=self.num_pages * blocks_per_page,
                           block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        kv = self.pages.view(-1).view(element).view(shape)
        handle = PoolMemoryHandle(self._kind, self._shm_path, shape, name, kv.get_device(),
                                  self._ipc_payload,
                                  self.pool_id if self._kind == "cuda_vmm" else "")
        view = FormatMemory(kv, handle, blocks_per_page)
        self._views.append(view)
        return view

    def zero_pages(self, pages: npt.ArrayLike) -> None:
        """Fill the given pages with zeros (page_bytes at page * page_bytes, every format's
        blocks there); ids are checked before anything is written."""
        index = checked_index(pages, self.num_pages, "page")
        if index.numel():
            self.pages.index_fill_(0, index.to(self.pages.device), 0)

    def synchronize(self) -> None:
        """Wait until every write issued so far (zero_pages, any view's copies) is in memory."""
        if self.pages.is_cuda:
            torch.cuda.synchronize(self.pages.device)

    def close(self) -> None:
        """Drop the arena and its views and unlink the shm file; idempotent.

        The memory itself is freed once no process maps it any more (attached runners keep
        their mapping); CUDA memory returns to torch's caching allocator.
        """
        self._pages = None
        for view in self._views:
            view.release()
        if self.memory_fd >= 0:  # the store and the runners hold their own copies
            os.close(self.memory_fd)
            self.memory_fd = -1
        if self._shm_path and not self._keep_file:
            Path(self._shm_path).unlink(missing_ok=True)

    def __enter__(self) -> KVMemory:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class KVPoolMemory(FormatMemory):
    """A one-model pool: an arena whose pages are the model's blocks (page_bytes = its
    bytes_per_block, what a daemon without `page_size` allocates), seen as its one view.
    Closing it closes the arena."""

    def __init__(self, arena: KVMemory, view: FormatMemory) -> None:
        super().__init__(view.kv, view.handle(), view.blocks_per_page)
        # The arena under the view (more views, zero_pages).
        self.arena = arena

    @classmethod
    def create(cls, geometry: ModelGeometry, num_blocks: int, block_size: int,
               dtype: str | torch.dtype, device: str = "cpu", shm_dir: str = "/dev/shm",
               name_prefix: str = "pagedkv", mode: int = 0o600,
               group: int | None = None) -> KVPoolMemory:
        """Allocate a zeroed pool of `num_blocks` blocks of `geometry` in `dtype`."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} "
                             f"and {block_size}")
        name = canonical_dtype(str(dtype))
        page_bytes = geometry.bytes_per_block(block_size, torch_dtype(name).itemsize)
        arena = KVMemory.create(num_blocks, page_bytes, device, shm_dir, name_prefix, mode, group)
        view = arena.view(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, name,
                          block_size)
        return cls(arena, view)

    @property
    def pool_id(self) -> str:
        return self.arena.pool_id

    def close(self) -> None:
        """Close the arena (see KVMemory.close) and drop this view."""
        self.arena.close()
        self.release()

    def __enter__(self) -> KVPoolMemory:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _vmm_memory(arena: VmmArena, num_pages: int, page_bytes: int, pool_id: str, *, zero: bool,
                adopted_from: str = "") -> KVMemory:
    """A KVMemory over `arena`'s mapping (freed once no view of it is left), with a descriptor
    exported for the runners and the next daemon."""
    try:
        fd = arena.export_fd()
        pages = arena.owned_tensor().view(num_pages, page_bytes)
    except BaseException:
        arena.close()
        raise
    if zero:  # cuMemCreate's contents are undefined: another process's old K/V, maybe
        pages.zero_()
    return KVMemory(pages, "cuda_vmm", "", b"", pool_id, adopted_from, memory_fd=fd)


def _index(device: torch.device) -> int:
    """The CUDA device's index (the current one when `device` names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _create_shm(path: Path, nbytes: int, mode: int, group: int | None) -> torch.Tensor:
    """Create the shm file exclusively (the owner's alone until it has its group), reserve its
    pages, and map it as `nbytes` uint8."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        _set_access(fd, path, mode, group)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise OSError(exc.errno, reserve_failure(path, nbytes, exc)) from exc
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _check_mode(mode: int) -> None:
    """ValueError unless `mode` is permission bits that keep other users out."""
    if mode & ~0o777:
        raise ValueError(f"mode must be permission bits only, got {oct(mode)}")
    if mode & 0o007:  # any local user could read and write every tenant's K/V
        raise ValueError(f"mode {oct(mode)} gives every user access to the pool")


def _set_access(fd: int, path: Path, mode: int, group: int | None) -> None:
    """Give the pool file `group` (when set) and then `mode`."""
    if group is not None:
        try:
            os.fchown(fd, -1, group)
        except OSError as exc:
            raise PermissionError(exc.errno, f"cannot give the pool file {path} to group "
                                             f"{group} (runner_group): {exc.strerror}; the "
                                             "daemon's user must be a member") from exc
    os.fchmod(fd, mode)  # the umask may have cleared bits that `mode` asks for


def cleanup_stale_files(shm_dir: str = "/dev/shm", name_prefix: str = "pagedkv",
                        keep: Collection[Path] = ()) -> list[Path]:
    """Remove pool files whose owner pid is dead (left by a crash), except those in `keep` (a
    previous daemon's, passed for adoption) and those a descriptor store holds (`held`: another
    daemon's pool kept for its next start, which this one must not take away from it); returns
    what was removed.

    A dead daemon's pid reused by an unrelated process keeps its file until a later cleanup:
    a leak at worst, whereas a live daemon's pool is never deleted.
    """
    removed = []
    for path in Path(shm_dir).iterdir():
        match = pool_file_name(path.name, name_prefix)
        if match and path not in keep and not _pid_alive(int(match.group(1))) \
                and not held(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def pool_file_name(name: str, name_prefix: str = "pagedkv") -> re.Match[str] | None:
    """A pool file's name parsed: group 1 its owner's pid, group 2 its pool id; None for any
    other name."""
    return re.fullmatch(rf"{re.escape(name_prefix)}-(\d+)-([0-9a-f]+)\.kv", name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    return True

