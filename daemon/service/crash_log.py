"""The crash log: every change of the service's state, written as it is applied, so that a
daemon killed by SIGKILL comes back with what its last applied calls left (`log_replay.py`).

A logical redo log. Each state-changing call appends one record under the pool lock, once its
change is applied and before the lock is released, so records are in the order changes were
applied: the call's inputs (its kind and arguments, as the service method takes them), the
caller (tenant, runner or not, and a runner's process as pid and start time) and the time the
call ran by (`SessionRegistry.now()`), which is all a replay through the same service code
needs to reach the same state. A refused call changed nothing but its session's lease: it
writes a KeepAlive's record. Memory work (copies, zeroing, host-tier copies) writes a tiny
record as it starts and another once it is done: work not known done at a crash leaves bytes
unknown (a copy's destination, a freed block not yet zeroed), and the replay refuses the log
(the daemon starts cold) rather than trust them.

The file lives in the pool's shm folder (`pagedkv-log.<pool id>`, 0600, the daemon's own),
beside the pool file, `max_bytes` long (allocated when it starts: that much tmpfs memory) and
mapped shared: tmpfs pages outlive the process
that wrote them, and a record is in them once copied into the mapping (no system call per
record), so SIGKILL loses nothing written; a power loss loses the pool memory too. Records are
framed (length, CRC-32, msgpack) after one another; the zeros past the last end the log, and so
does a torn frame.

Bounded: the log starts with a base, the service's image (`service_image.py`) when logging
began, and once it would pass `max_bytes` a new file starting with an image of the state now
replaces it (written aside, then renamed, so a crash in between keeps the old one whole). The
checkpoint is taken under the lock, between two calls (its cost: a restart snapshot's, once
per `max_bytes` of records). Its file is not allocated there: once the log is SPARE_AT full, a
thread allocates the next one aside (`<log>.spare`; allocating `max_bytes` of tmpfs takes ~40
ms for the default 64 MiB, which every client would wait for), and the checkpoint writes its
image into it; one not ready yet is left for the next, and that checkpoint allocates its own.
The file it replaces is closed by a thread too (its last descriptor frees its tmpfs, ~10 ms).
A state the image cannot keep, a tmpfs too full for the file, or a record that cannot be
written stops the log: its file (and a spare) is removed, said once, and a crash then starts
cold. Files of a log aside (`.new`, `.spare`) are removed with its pool's stale log.
"""

import asyncio
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack

from pagedkv.daemon.service.operations import (
    Allocate,
    Append,
    Commit,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
)
from pagedkv.daemon.service.tenants import current_caller
from pagedkv.process.log_setup import get_logger

log = get_logger(__name__)

# One record: [kind, time, caller, *arguments]; caller None (the daemon's own code) or
# [tenant, runner, [pid, start] or None].
Record = list[Any]
# A frame's header: the payload's length and CRC-32, little-endian.
_HEADER = struct.Struct("<II")
# The kinds of memory work's records: started, done.
WORK, DONE = "work", "done"
# The kind of a KV-events record: [SEQ, the seq of the next batch, an AllBlocksCleared owed]
# (`CrashLog.numbered`).
SEQ = "seq"
# 1 / the share of the log kept for memory work's records (written outside the lock, where no
# checkpoint is taken): calls' records start a checkpoint before they reach it.
_MARKER_SHARE = 8


class NotLogged(Exception):
    """A state the log's base cannot keep (the message says why): the log stops."""


# A crash log's file name before its pool id.
LOG_PREFIX = "pagedkv-log."
# After a log's name: its next file, written aside (the checkpoint's) or allocated ahead.
ASIDE_SUFFIX, SPARE_SUFFIX = ".new", ".spare"
# How full the log is when a thread starts allocating its next file.
SPARE_AT = 0.75


def log_path(shm_dir: Path, pool_id: str) -> Path:
    """The crash log of pool `pool_id`, beside its pool file."""
    return shm_dir / f"{LOG_PREFIX}{pool_id}"


def frame(record: Any) -> bytes:
    payload: bytes = msgpack.packb(record, use_bin_type=True)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_log(path: Path) -> Iterator[Any]:
    """The records of the log at `path`, its base first; zeros, or a torn or corrupt frame,
    end it. Read through a mapping: the zeros past the records are never copied."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as data:
        yield from _records(data)


def _records(data: mmap.mmap) -> Iterator[Any]:
    at = 0
    while at + _HEADER.size <= len(data):
        size, crc = _HEADER.unpack_from(data, at)
        payload = data[at + _HEADER.size:at + _HEADER.size + size]
        if not size or len(payload) < size or zlib.crc32(payload) != crc:
            return
        yield msgpack.unpackb(payload, raw=False, strict_map_key=False)
        at += _HEADER.size + size


@dataclass
class CrashLog:
    """The log of one service's changes (see the module docstring)."""

    # The log file (`log_path`).
    path: Path
    # Its bound in bytes: past it, a checkpoint starts a new file.
    max_bytes: int
    # The service's image now and the time it is of (`service_image` with calls in flight);
    # NotLogged: a state it cannot keep.
    image: Callable[[], tuple[Any, float]]
    # The open file's descriptor, -1 once the log stopped, and its mapping.
    fd: int = -1
    view: mmap.mmap | None = None
    # Bytes of records in the file (the rest is zeros).
    size: int = 0
    # Number of the last memory work started (its records name it).
    number: int = 0
    # Memory work started and not known done, by number.
    working: set[int] = field(default_factory=set)
    # Runner processes' (pid, start time), read once per process (a /proc read).
    identities: dict[Any, list[int] | None] = field(default_factory=dict)
    # Each session's last Step's seq ids since the base: a Step naming the same ones (a decode
    # loop) writes None instead (`same_seq_ids` reads it back). Bounded by the sessions.
    step_seq_ids: dict[str, list[int]] = field(default_factory=dict)
    # The KV events' seq of the next batch, and whether a dropped batch owes subscribers an
    # AllBlocksCleared, as the sink last told (`numbered`): the base and SEQ records keep them.
    event_seq: int = 0
    events_owed: bool = False
    # The next file, being allocated by a thread (`make_spare`) or ready for the next
    # checkpoint; None: none asked for since the last one took it.
    spare: Future[tuple[int, mmap.mmap]] | None = None

    def start(self) -> None:
        """Begin (or begin again) with a base of the state now."""
        image, now = self.image()
        self.identities.clear()  # bounded: only processes seen since the last base
        self.step_seq_ids.clear()
        base = frame({"base": image, "time": now, "working": sorted(self.working),
                      "event_seq": self.event_seq, "events_owed": self.events_owed})
        if len(base) > self.max_bytes // 2:  # else checkpoints would follow one another
            raise NotLogged(f"the state's image takes {len(base)} bytes, over half of "
                            f"crash_log_bytes={self.max_bytes}: raise crash_log_bytes")
        spare = self._take_spare()
        aside = self._beside(SPARE_SUFFIX if spare is not None else ASIDE_SUFFIX)
        fd, view = spare if spare is not None else allocated(aside, self.max_bytes)
        view[:len(base)] = base
        os.replace(aside, self.path)
        replaced = (self.fd, self.view)
        self.fd, self.view, self.size = fd, view, len(base)
        if replaced[0] >= 0:  # its last descriptor frees the file's tmpfs: ~10 ms for 64 MiB
            threading.Thread(target=_closed, args=replaced, name="pagedkv-crash-log-close",
                             daemon=True).start()

    def _beside(self, suffix: str) -> Path:
        return self.path.with_name(self.path.name + suffix)

    def make_spare(self) -> None:
        """Allocate the next file aside in a thread, for the next checkpoint."""
        spare: Future[tuple[int, mmap.mmap]] = Future()
        path, size = self._beside(SPARE_SUFFIX), self.max_bytes

        def make() -> None:
            try:
                spare.set_result(allocated(path, size))
            except OSError as exc:
                spare.set_exception(exc)

        self.spare = spare
        threading.Thread(target=make, name="pagedkv-crash-log-spare", daemon=True).start()

    def _take_spare(self) -> tuple[int, mmap.mmap] | None:
        """The spare file if it is ready (one still being made is left for the next
        checkpoint); None: the checkpoint allocates its own (a spare that failed: a full
        tmpfs, which that allocation meets too, and says so)."""
        spare = self.spare
        if spare is None or not spare.done():
            return None
        self.spare = None
        return None if spare.exception() is not None else spare.result()

    def _drop_spare(self) -> None:
        """Remove the spare file, now or once its thread is done."""
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.add_done_callback(lambda made: _discard(made, self._beside(SPARE_SUFFIX)))

    def write(self, record: Record, now: float) -> None:
        """Append one applied call's record (under the lock)."""
        if self.fd < 0:
            return
        try:
            same_seq_ids(self.step_seq_ids, record, writing=True)
            data = frame([record[0], now, self._caller(), *record[1:]])
            if self.size + len(data) > self.max_bytes - self.max_bytes // _MARKER_SHARE:
                self.start()  # its base holds this call's change: no record after it
            else:
                self._append(data)
                if self.spare is None and self.size > SPARE_AT * self.max_bytes:
                    self.make_spare()
        except (OSError, NotLogged, TypeError, ValueError) as exc:  # a full tmpfs, a bad field
            self.stop(f"writing the crash log failed: {exc}")

    def started(self, work: "asyncio.Future[None]") -> None:
        """Memory work started (under the lock, after its call's record): its record now, and
        its done record once it completed (a failed one never is: fail-stop)."""
        self.number += 1
        number = self.number
        self.working.add(number)
        self._marker(WORK, number)
        work.add_done_callback(lambda done: None if done.cancelled() or done.exception()
                               else self._done(number))

    def numbered(self, next_seq: int, owed: bool) -> None:
        """The KV-event sink numbered a batch (or dropped one): its record now, before the
        sending thread may publish it. A restored daemon goes on from the last one, and owes an
        AllBlocksCleared when one follows the last call's record (that call's change is lost)."""
        self.event_seq, self.events_owed = next_seq, owed
        self._marker(SEQ, next_seq, owed)

    def _done(self, number: int) -> None:
        self.working.discard(number)
        self._marker(DONE, number)

    def _marker(self, *record: Any) -> None:
        """A record outside the calls' ones (memory work's, KV events')."""
        if self.fd < 0:
            return
        try:
            self._append(frame(list(record)))
        except OSError as exc:
            self.stop(f"writing the crash log failed: {exc}")

    def _append(self, data: bytes) -> None:
        end = self.size + len(data)
        if self.view is None or end > self.max_bytes:
            raise OSError(f"the crash log is full ({self.max_bytes} bytes)")
        self.view[self.size:end] = data
        self.size = end

    def _close(self) -> None:
        _closed(self.fd, self.view)
        self.fd, self.view = -1, None

    def stop(self, reason: str = "") -> None:
        """Stop logging and remove the file: a clean stop (its snapshot wins), or a state the
        log cannot keep (`reason`, logged: a crash then starts cold)."""
        if self.fd < 0:
            return
        self._close()
        self.path.unlink(missing_ok=True)
        self._drop_spare()
        if reason:
            log.warning("crash log stopped: a crash now starts cold", reason=reason)

    def _caller(self) -> list[Any] | None:
        caller = current_caller()
        if caller is None:
            return None
        process = caller.process
        if process is not None and process not in self.identities:
            identity = process.identity()
            self.identities[process] = None if identity is None else list(identity)
        return [caller.tenant.name, caller.runner,
                None if process is None else self.identities[process]]


def same_seq_ids(last: dict[str, list[int]], record: Record, *, writing: bool) -> None:
    """A Step's seq ids written as None when they are its session's last Step's, and read back
    as those; a session's close or expiry forgets its ids. `record` as the service made it
    (`writing`), or as read back (its time and caller after its kind)."""
    at = 1 if writing else 3  # where the session id is
    kind, session_id = record[0], record[at]
    if kind in ("close", "expire"):
        last.pop(session_id, None)
    elif kind == "step":
        seq_ids = record[at + 1]
        if seq_ids is None:
            record[at + 1] = last[session_id]
        elif writing and last.get(session_id) == seq_ids:
            record[at + 1] = None
        else:
            last[session_id] = seq_ids


def op_record(op: Operation) -> Record:
    """An op as plain data: its class's name, then its fields in order."""
    return [type(op).__name__, *(plain(getattr(op, f.name)) for f in fields(op))]


def record_op(record: Record) -> Operation:
    """The op `op_record` made `record` of."""
    return _OPS[record[0]](*record[1:])


def plain(value: Any) -> Any:
    """A field as msgpack takes it: numbers as they are, sequences as lists of ints (a list
    as it is: it is packed before the call returns)."""
    if isinstance(value, (int, str, bool, bytes, list)):
        return value
    if hasattr(value, "tolist"):
        return value.tolist()  # numpy: one call, not a loop
    return list(value)  # a range, a tuple, protobuf's repeated field: ints already


# The ops a record may name, by class name.
_OPS: dict[str, type[Operation]] = {cls.__name__: cls for cls in (
    Allocate, Append, Fork, CopyOnWrite, Commit, Free)}


def allocated(path: Path, size: int) -> tuple[int, mmap.mmap]:
    """A new file of `size` zero bytes at `path` (0600), allocated now (a full tmpfs refuses
    here, ENOSPC, never as a SIGBUS on a write into the mapping), and its mapping."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return fd, mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise


def _discard(made: "Future[tuple[int, mmap.mmap]]", path: Path) -> None:
    """A spare file no checkpoint will take: unmapped, closed, removed."""
    if made.exception() is None:
        _closed(*made.result())
        path.unlink(missing_ok=True)


def _closed(fd: int, view: mmap.mmap | None) -> None:
    """Unmap and close a log file's descriptor (none: -1)."""
    if view is not None:
        view.close()
    if fd >= 0:
        os.close(fd)
