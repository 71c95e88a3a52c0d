"""Only public salts are published: a real pagedkvd with [tenants] tables, read by a pyzmq
DEALER over its replay and snapshot endpoint (msgpack decoding), as an unauthenticated
subscriber would.

The default tenant lists two salts: "team" (listed by this tenant alone: global, yet not
marked public) and "docs" (in public_salts). Blocks committed under "team" carry token 7,
those under "docs" token 5: no batch, replayed or in a snapshot, may carry a 7.
"""

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from pagedkv.client import PoolClient
from pagedkv.daemon.events.sender import SNAPSHOT_REQUEST
from pagedkv.daemon.events.wire import BlockStored, decode_batch, seq_bytes

from pagedkvd_process import free_tcp_port, pagedkvd, short_tmp_dir

# How long the test waits for the events before it fails (a guard, not a timing assertion).
WAIT_S = 30.0
TENANTS = """
[tenants.default]
salts = ["team", "docs"]
public_salts = ["docs"]
"""


async def answer(replay: str, body: bytes) -> list[list[bytes]]:
    """The daemon's answer to one request: every message up to the one ending in b""."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(replay)
    try:
        await socket.send_multipart([b"", body])
        messages: list[list[bytes]] = []
        while not messages or messages[-1][-1]:
            _, *frames = await socket.recv_multipart()
            messages.append(frames)
        return messages
    finally:
        context.destroy(linger=0)


def first_tokens(payloads: list[bytes]) -> set[int]:
    """The first token of every block stored in these batches."""
    tokens = set()
    for payload in payloads:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                tokens.update(event.token_ids[::event.block_size])
    return tokens


async def test_a_salt_one_tenant_lists_is_not_published_unless_marked_public() -> None:
    pub, replay_port = free_tcp_port(), free_tcp_port()
    replay = f"tcp://127.0.0.1:{replay_port}"
    with short_tmp_dir() as folder:
        config = Path(folder) / "pagedkv.toml"
        config.write_text(TENANTS)
        with pagedkvd("--config", str(config), "--num-blocks", "16",
                      "--kv-events-endpoint", f"tcp://*:{pub}",
                      "--kv-events-replay-endpoint", f"tcp://*:{replay_port}") as daemon:
            async with await PoolClient.connect(daemon.unix_target) as client:
                block_size = (await client.pool_info()).block_size
                for salt, token in ((b"team", 7), (b"docs", 5)):
                    session = await client.open_session(salt.decode(), cache_salt=salt)
                    await session.allocate(1, token_ids=[token] * (2 * block_size))
                    await session.commit([1])
            # The batches reach the sending thread after the calls: replay until "docs" is
            # there, then every batch before it ("team"'s would be) is too.
            async with asyncio.timeout(WAIT_S):
                replayed: set[int] = set()
                while 5 not in replayed:
                    messages = await answer(replay, seq_bytes(0))
                    replayed = first_tokens([payload for _, payload in messages[:-1]])
            snapshot = await asyncio.wait_for(answer(replay, SNAPSHOT_REQUEST), WAIT_S)
            assert daemon.stop() == 0
    assert replayed == {5}
    assert first_tokens([payload for _, _, payload in snapshot[:-1]]) == {5}
