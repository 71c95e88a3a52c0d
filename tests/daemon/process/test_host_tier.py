"""The host tier in the real daemon (`pagedkv daemon --host-tier-memory`): PoolInfo, /metrics,
a prefix evicted and restored over gRPC, and the KV events a subscriber reads for each move.

Pool: 8 blocks of 16 tokens of the tiny model (32 KiB a block); host tier: 1 MiB = 32 slots.
"""

import asyncio

import zmq
import zmq.asyncio

from pagedkv.client import PoolClient

from kv_events_subscriber import decode  # the tests' decoder, from the consumers' rules
from pagedkvd_process import free_tcp_port, pagedkvd, tenant_samples

END = (-1).to_bytes(8, "big", signed=True)


async def replayed(endpoint: str) -> list[tuple[str, str, list[int]]]:
    """Every buffered batch from seq 0, by replay: (type, medium, block hashes) per event."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    events = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 30)
            seq, payload = frames[-2], frames[-1]
            if seq == END:
                break
            for kind, fields in decode(payload):
                events.append((kind, fields.get("medium"), list(fields["block_hashes"])))
    finally:
        dealer.close(linger=0)
        context.term()
    return events


async def test_a_prefix_evicted_to_the_host_tier_is_restored_and_announced() -> None:
    pub, replay, metrics = free_tcp_port(), free_tcp_port(), free_tcp_port()
    with pagedkvd("--num-blocks", "8", "--host-tier-memory", "1MiB",
                  "--kv-events-endpoint", f"tcp://*:{pub}",
                  "--kv-events-replay-endpoint", f"tcp://*:{replay}",
                  "--kv-events-all-salts", "--metrics-listen", f"127.0.0.1:{metrics}") as daemon:
        async with await PoolClient.connect(daemon.unix_target) as client:
            info = await client.pool_info()
            assert info.host_tier_blocks == (1 << 20) // info.bytes_per_block == 32
            assert info.host_copy_bytes_per_s > 0
            bs = info.block_size
            session = await client.open_session("c", cache_salt=b"team")
            prefix = [5] * (2 * bs)
            await session.allocate(1, token_ids=[*prefix, 6])
            await session.commit([1])
            await session.free(1)
            # Every block of the pool for other tokens: the prefix's two blocks are evicted.
            await session.allocate(2, token_ids=[7] * (8 * bs))
            await session.free(2)
            got = await session.allocate(3, token_ids=[*prefix, 8])
            assert got.num_cached_tokens == 2 * bs  # restored, not recomputed
            samples = tenant_samples(f"127.0.0.1:{metrics}")
            assert samples["pagedkv:host_tier_stores_total", None] == 2
            assert samples["pagedkv:host_tier_restores_total", None] == 2
            assert samples["pagedkv:host_tier_used_blocks", None] == 2
            events = await replayed(f"tcp://127.0.0.1:{replay}")
        assert daemon.stop() == 0
    stored = [hashes for kind, medium, hashes in events if kind == "BlockStored"]
    assert len(stored[0]) == 2
    chain = stored[0]
    # Committed in the pool, copied to the host tier, evicted from the pool, restored.
    assert [(kind, medium, sorted(hashes)) for kind, medium, hashes in events] == [
        ("BlockStored", "GPU", sorted(chain)), ("BlockStored", "CPU", sorted(chain)),
        ("BlockRemoved", "GPU", sorted(chain)), ("BlockStored", "GPU", sorted(chain))]

