"""Bounded under hostile input: every cap refuses with the right status and a message naming it,
and a refused call changes nothing. Real in-process daemons (the production gRPC server), raw
stubs (schedulers in other languages see exactly this).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.server import serve
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.process.settings_sources import add_serve_arguments, config_from_args
from pagedkv.daemon.service.answer_size import (
    ENTRY_CAUSE_BYTES,
    STEP_MANY_ENTRY,
    STEP_MANY_FIXED,
    varint_bytes,
)
from pagedkv.daemon.service.limits import LIMITS, Limits, clip
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc
from pagedkv.proto.limits import DEFAULT_ANSWER_BYTES, MAX_MESSAGE_BYTES, MESSAGE_SIZE_OPTIONS
from pagedkv.vocab.causes import MESSAGE_BYTES, cut_message

from daemon_harness import Daemon, running_daemon

if TYPE_CHECKING:
    from pagedkv.proto.kvpool_pb2_grpc import KVPoolAsyncStub as Stub

Code = grpc.StatusCode


@asynccontextmanager
async def daemon_and_stub(**options: Any) -> AsyncIterator[tuple[Daemon, Stub]]:
    async with running_daemon(**options) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target, options=MESSAGE_SIZE_OPTIONS) as channel:
        yield daemon, kvpool_pb2_grpc.KVPoolStub(channel)
        daemon.service.check_invariants()


def state(daemon: Daemon) -> tuple[object, ...]:
    """Everything a refused call must leave as it was: pool figures, tables, sessions' books."""
    service = daemon.service
    tables = {(s.number, q): (service.pool.block_table(s.key(q)), service.pool.num_tokens(s.key(q)))
              for s in service.sessions for q in s.seq_ids}
    books = {s.number: (sorted(s.seq_ids), s.table_entries, s.max_blocks)
             for s in service.sessions}
    return service.pool_stats(), tables, books


async def refused(daemon: Daemon, code: grpc.StatusCode, call: Any, match: str,
                  cause: str = "") -> str:
    """Await `call`: it fails with `code`, a message naming `match` (and `cause` in the
    metadata), and changes nothing. Returns the message."""
    before = state(daemon)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    error = failure.value
    assert error.code() == code, error.details()
    assert match in (error.details() or ""), error.details()
    if cause:
        assert dict(error.trailing_metadata() or ()).get("pagedkv-error") == cause
    assert state(daemon) == before
    daemon.service.check_invariants()
    return error.details() or ""


async def open_session(stub: Stub, **fields: Any) -> pb.OpenSessionResponse:
    return await stub.OpenSession(pb.OpenSessionRequest(client_name="t", **fields))


# ------------------------------------------------------------- finding 1: amplification

async def test_repeated_seq_ids_are_refused_before_any_work() -> None:
    """The issue's attack: 65,536 repeats of one long sequence in a 65 KB request once built a
    394 MB answer. Now a repeated id is INVALID_ARGUMENT, in Step and Commit as well."""
    async with daemon_and_stub(num_blocks=4096, block_size=16) as (daemon, stub):
        sid = (await open_session(stub)).session_id
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=2000 * 16))
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=2, num_tokens=1))
        await refused(daemon, Code.INVALID_ARGUMENT, stub.GetBlockTables(
            pb.GetBlockTablesRequest(session_id=sid, seq_ids=[1] * 65_536)),
            "seq id 1 appears more than once")
        await refused(daemon, Code.INVALID_ARGUMENT, stub.Step(
            pb.StepRequest(session_id=sid, seq_ids=[2, 1, 2])), "seq id 2 appears more than once")
        await refused(daemon, Code.INVALID_ARGUMENT, stub.Commit(
            pb.CommitRequest(session_id=sid, seq_ids=[1, 1])), "more than once")


async def test_every_growing_answer_is_bounded_before_it_is_built() -> None:
    """With max_answer_bytes = 4096 on a pool of 1024 blocks of 4 (2-byte block ids and slots):
    each RPC whose answer grows with the request or the state is refused with
    RESOURCE_EXHAUSTED naming the limit, and nothing changes; just under it, it is served."""
    limits = Limits(max_answer_bytes=4096)
    async with daemon_and_stub(num_blocks=1024, block_size=4, limits=limits) as (daemon, stub):
        sid = (await open_session(stub)).session_id
        too_large = "the limit is max_answer_bytes=4096"

        async def exhausted(call: Any) -> None:
            await refused(daemon, Code.RESOURCE_EXHAUSTED, call, too_large, "AnswerTooLarge")

        # Allocate: 2,000 slots and 500 block ids, about 5,000 bytes.
        await exhausted(stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1,
                                                         num_tokens=2000)))
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=1000))
        # Append: the whole table comes back (625 entries after) and 1,500 new slots.
        await exhausted(stub.Append(pb.AppendRequest(session_id=sid, seq_id=1, num_tokens=1500)))
        # Fork and CopyOnWrite answer with the table: 250 entries fit.
        for child in range(2, 9):
            await stub.Fork(pb.ForkRequest(session_id=sid, parent_seq_id=1, child_seq_id=child))
        await stub.CopyOnWrite(pb.CopyOnWriteRequest(session_id=sid, seq_id=8, logical_block=0))
        # GetBlockTables of 8 tables of 250 entries: about 4,300 bytes; 7 fit.
        await exhausted(stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid,
                                                                     seq_ids=range(1, 9))))
        tables = await stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid,
                                                                    seq_ids=range(1, 8)))
        assert [len(t.block_ids) for t in tables.tables] == [250] * 7
        # Batch: the sum of its results; the eighth fork passes the limit, and the forks
        # before it are undone with it.
        forks = [pb.BatchOp(fork=pb.ForkRequest(parent_seq_id=1, child_seq_id=c))
                 for c in range(10, 18)]
        await exhausted(stub.Batch(pb.BatchRequest(session_id=sid, ops=forks)))
        # Step: 8 sequences x 200 tokens: 1,600 slots and up to 408 changed entries.
        await exhausted(stub.Step(pb.StepRequest(session_id=sid, seq_ids=range(1, 9),
                                                 num_tokens=200)))
        step = await stub.Step(pb.StepRequest(session_id=sid, seq_ids=range(1, 9),
                                              num_tokens=100))
        assert list(step.num_tokens) == [1100] * 8


async def test_a_batch_cannot_amplify_its_answer_with_default_limits() -> None:
    """A 100-byte Batch of (Allocate 400,000 tokens, Free) pairs asked for an answer of many
    megabytes: the default max_answer_bytes (under 4 MiB, what stock clients accept) refuses it
    at the op that would pass it, before that op's work, and the ops before are undone."""
    async with daemon_and_stub(num_blocks=1 << 16, block_size=16) as (daemon, stub):
        sid = (await open_session(stub)).session_id
        ops = []
        for seq_id in range(1, 9):
            ops += [pb.BatchOp(allocate=pb.AllocateRequest(seq_id=seq_id, num_tokens=400_000)),
                    pb.BatchOp(free=pb.FreeRequest(seq_id=seq_id))]
        message = await refused(daemon, Code.RESOURCE_EXHAUSTED, stub.Batch(
            pb.BatchRequest(session_id=sid, ops=ops)),
            f"the limit is max_answer_bytes={DEFAULT_ANSWER_BYTES}", "AnswerTooLarge")
        assert message.startswith("op 6 (allocate)")  # the fourth allocate
        assert daemon.pool.stats().used_blocks == 0


# ------------------------------------------------- finding 3: sessions, names and ids

async def test_session_caps_names_and_ids() -> None:
    limits = Limits(max_sessions=2, max_seqs_per_session=2, max_blocks_per_session=8)
    async with daemon_and_stub(limits=limits) as (daemon, stub):
        await refused(daemon, Code.INVALID_ARGUMENT, stub.OpenSession(pb.OpenSessionRequest(
            client_name="n" * (7 << 20))), "client_name of 7340032 bytes; the limit is "
            "max_client_name_bytes=128")
        await refused(daemon, Code.INVALID_ARGUMENT, stub.OpenSession(pb.OpenSessionRequest(
            cache_salt=b"s" * 257)), "cache_salt of 257 bytes; the limit is "
            "max_cache_salt_bytes=256")
        first = await open_session(stub)  # asks for no quota: gets the daemon's cap
        second = await open_session(stub, max_blocks=100)  # asks for more: clamped
        assert (first.max_blocks, second.max_blocks) == (8, 8)
        await refused(daemon, Code.RESOURCE_EXHAUSTED, open_session(stub),
                      "2 sessions are open; the limit is max_sessions=2", "LimitExceeded")
        await stub.CloseSession(pb.CloseSessionRequest(session_id=second.session_id))
        third = await open_session(stub, max_blocks=3)  # room again; less than the cap is kept
        assert third.max_blocks == 3

        sid = first.session_id
        for seq_id in (1, 2):
            await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=seq_id, num_tokens=4))
        await refused(daemon, Code.RESOURCE_EXHAUSTED, stub.Allocate(pb.AllocateRequest(
            session_id=sid, seq_id=3, num_tokens=1)),
            "holds 2 sequences; the limit is max_seqs_per_session=2", "LimitExceeded")
        await refused(daemon, Code.RESOURCE_EXHAUSTED, stub.Fork(pb.ForkRequest(
            session_id=sid, parent_seq_id=1, child_seq_id=3)), "max_seqs_per_session=2")
        await refused(daemon, Code.RESOURCE_EXHAUSTED, stub.Append(pb.AppendRequest(
            session_id=sid, seq_id=1, num_tokens=4 * 7)), "of max_blocks=8 left", "PoolExhausted")


async def test_session_ids_are_bounded_and_never_echoed() -> None:
    """A 100 KB session id once came back whole in the NOT_FOUND message (RESOURCE_EXHAUSTED:
    metadata too large). Now a long id is refused by its length, and an unknown one is named by
    its number only: the secret part of an id, a credential, is never echoed."""
    async with daemon_and_stub() as (daemon, stub):
        mine = (await open_session(stub)).session_id
        await refused(daemon, Code.INVALID_ARGUMENT, stub.KeepAlive(pb.KeepAliveRequest(
            session_id="x" * 100_000)), "session_id of 100000 bytes; the limit is "
            "max_session_id_bytes=128")
        forged = mine[:-16] + "0123456789abcdef"
        message = await refused(daemon, Code.NOT_FOUND, stub.KeepAlive(pb.KeepAliveRequest(
            session_id=forged)), "unknown session #1", "SessionNotFound")
        assert "0123456789abcdef" not in message and daemon.service.pool_id not in message
        await refused(daemon, Code.NOT_FOUND, stub.Allocate(pb.AllocateRequest(
            session_id="y" * 128, seq_id=1)), "unknown session:", "SessionNotFound")


def test_clip_marks_what_it_cut() -> None:
    assert clip("abc") == "abc"
    assert clip("x" * 100, 10) == "x" * 10 + "...[90 more chars]"


# ---------------------------------------------------------------------- settings

def test_limits_come_from_toml_and_flags_within_their_ranges(tmp_path: Path) -> None:
    toml = tmp_path / "d.toml"
    toml.write_text('max_sessions = 7\nmax_answer_bytes = 65536\n'
                    f'listen = "unix://{tmp_path}/d.sock"\n')
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--config", str(toml), "--max-sessions", "9",
                              "--max-client-name-bytes", "32"])
    limits = config_from_args(args).limits()
    assert (limits.max_sessions, limits.max_answer_bytes, limits.max_client_name_bytes,
            limits.max_tokens) == (9, 65536, 32, Limits().max_tokens)
    for name, spec in LIMITS.items():
        for bad in (spec.minimum - 1, spec.maximum + 1):
            with pytest.raises(ConfigError, match=f"{name} must be an integer in "
                                                  f"{spec.minimum}..{spec.maximum}"):
                DaemonConfig(listen=(f"unix://{tmp_path}/d.sock",), **{name: bad})
    assert LIMITS["max_answer_bytes"].maximum == MAX_MESSAGE_BYTES


async def test_serve_applies_the_configured_limits() -> None:
    """The settings reach the service that serve() (pagedkvd's main) builds."""
    folder = Path(tempfile.mkdtemp(prefix="pkvl-"))  # short: unix socket paths are limited
    config = DaemonConfig(listen=(f"unix://{folder}/d.sock",), shm_dir=folder, num_blocks=1024,
                          max_sessions=1, max_answer_bytes=4096)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    try:
        async with grpc.aio.insecure_channel(f"unix://{folder}/d.sock") as channel:
            stub = kvpool_pb2_grpc.KVPoolStub(channel)
            reply = await stub.OpenSession(pb.OpenSessionRequest(), wait_for_ready=True,
                                           timeout=30)
            with pytest.raises(grpc.aio.AioRpcError, match="max_sessions=1"):
                await open_session(stub)
            with pytest.raises(grpc.aio.AioRpcError, match="max_answer_bytes=4096"):
                await stub.Allocate(pb.AllocateRequest(session_id=reply.session_id, seq_id=1,
                                                       num_tokens=2000))
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        shutil.rmtree(folder, ignore_errors=True)


def test_the_operators_guide_documents_every_limit() -> None:
    text = (Path(__file__).parents[3] / "ops" / "OPERATIONS.md").read_text()
    defaults = Limits()
    for name, spec in LIMITS.items():
        row = (f"| `{name}` / `--{name.replace('_', '-')}` | {getattr(defaults, name)} | "
               f"{spec.minimum}..{spec.maximum} |")
        assert row in text, f"ops/OPERATIONS.md has no row {row}"


def test_a_step_many_envelope_bounds_its_encoding() -> None:
    """What StepMany charges per entry before applying any covers the largest failed entry (a
    cause of ENTRY_CAUSE_BYTES, a message cut to MESSAGE_BYTES of 2-byte characters) and
    a successful entry's wrapping (its Step's packed fields are charged as it is applied)."""
    failed = pb.StepManyResult(code=16, cause="C" * ENTRY_CAUSE_BYTES,
                               message=cut_message("é" * 300))
    applied = pb.StepManyResult(step=pb.StepResponse(free_blocks=2**32 - 1))
    assert len(failed.message.encode()) == MESSAGE_BYTES
    for result in (failed, applied):  # in a repeated field: tag, length, then the message
        assert 1 + varint_bytes(result.ByteSize()) + result.ByteSize() <= STEP_MANY_ENTRY
    answer = pb.StepManyResponse(results=[failed, applied, failed], free_blocks=2**32 - 1)
    assert answer.ByteSize() <= STEP_MANY_FIXED + 3 * STEP_MANY_ENTRY


async def test_cache_salt_limit_counts_only_the_bytes_the_client_sent() -> None:
    """A 20-byte salt under a 32-byte cap is taken: the daemon files it under the caller's
    tenant ("tenant:default\\0" + salt, 35 bytes), but the cap is on what the client sent."""
    async with daemon_and_stub(limits=Limits(max_cache_salt_bytes=32)) as (daemon, stub):
        taken = await open_session(stub, cache_salt=b"s" * 20)
        assert daemon.service.sessions.get(taken.session_id).salt.endswith(b"s" * 20)
        await open_session(stub, cache_salt=b"s" * 32)
        await refused(daemon, Code.INVALID_ARGUMENT, open_session(stub, cache_salt=b"s" * 33),
                      "cache_salt of 33 bytes; the limit is max_cache_salt_bytes=32")
