"""vLLM's KV-event wire format (daemon/events/wire.py): the bytes vLLM's msgspec structs write,
both event forms decoded, chains split into BlockStored events as vLLM sends them."""

import struct

import msgpack
import pytest

from pagedkv.daemon.events.sink import StoredBlock
from pagedkv.daemon.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    decode_batch,
    encode_batch,
    seq_bytes,
    seq_of,
    stored_events,
)

TOP = 2**64 - 1  # a hash with the high bit set: must travel as uint64, not int64


def fixstr(text: str) -> bytes:
    """msgpack fixstr (under 32 bytes), as msgspec writes a field name or a short value."""
    data = text.encode()
    assert len(data) < 32
    return bytes([0xA0 | len(data)]) + data


def test_block_stored_bytes_are_what_vllm_writes() -> None:
    # vLLM (kv_events.py): EventBatch is array_like -> [ts, events, data_parallel_rank];
    # KVCacheEvent is tag=True, omit_defaults=True, no array_like since vllm#42892 -> a map,
    # "type" first, then the fields in declaration order; lora_id, medium and lora_name have no
    # default (always written), extra_keys, group_idx, kv_cache_spec_kind and
    # kv_cache_spec_sliding_window default to None (left out when None).
    batch = EventBatch(1.5, (BlockStored(
        block_hashes=(TOP, 5), parent_block_hash=2**63, token_ids=(1, 2, 300, 4), block_size=2,
        medium="GPU", extra_keys=(("tenant-a",), None), group_idx=0,
        kv_cache_spec_kind="full_attention"),), 0)
    expected = b"".join([
        b"\x93", b"\xcb" + struct.pack(">d", 1.5),          # [ts,
        b"\x91", b"\x8b",                                    #  [{11 keys:
        fixstr("type"), fixstr("BlockStored"),
        fixstr("block_hashes"), b"\x92\xcf" + b"\xff" * 8 + b"\x05",
        fixstr("parent_block_hash"), b"\xcf\x80" + b"\x00" * 7,
        fixstr("token_ids"), b"\x94\x01\x02\xcd\x01\x2c\x04",
        fixstr("block_size"), b"\x02",
        fixstr("lora_id"), b"\xc0",
        fixstr("medium"), fixstr("GPU"),
        fixstr("lora_name"), b"\xc0",
        fixstr("extra_keys"), b"\x92\x91" + fixstr("tenant-a") + b"\xc0",
        fixstr("group_idx"), b"\x00",
        fixstr("kv_cache_spec_kind"), fixstr("full_attention"),
        b"\x00",                                             #  }], rank 0]
    ])
    assert encode_batch(batch) == expected
    assert decode_batch(expected) == batch


def test_removed_and_cleared_bytes() -> None:
    batch = EventBatch(2.0, (BlockRemoved((7,), "CPU", 0), AllBlocksCleared()), 0)
    expected = b"".join([
        b"\x93\xcb" + struct.pack(">d", 2.0), b"\x92",
        b"\x84", fixstr("type"), fixstr("BlockRemoved"), fixstr("block_hashes"), b"\x91\x07",
        fixstr("medium"), fixstr("CPU"), fixstr("group_idx"), b"\x00",
        b"\x81", fixstr("type"), fixstr("AllBlocksCleared"),
        b"\x00",
    ])
    assert encode_batch(batch) == expected


def test_round_trip_of_every_event() -> None:
    batch = EventBatch(3.25, (
        BlockStored((1, TOP), None, (9,) * 8, 4, medium="CPU", extra_keys=(None, (b"\xff",)),
                    group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockStored((2,), 1, (5, 6, 7, 8), 4, medium="GPU"),
        BlockRemoved((1, 2, TOP), "GPU", 0),
        AllBlocksCleared(),
    ), 0)
    assert decode_batch(encode_batch(batch)) == batch


def test_the_older_array_form_decodes() -> None:
    # Before vllm#42892 every event was [tag, field, ...] in declaration order, trailing
    # defaults left out; the first versions had neither medium nor a rank in the batch.
    payload = msgpack.packb([4.0, [
        ["BlockStored", [TOP], None, [1, 2], 2, None],
        ["BlockStored", [3, 4], TOP, [1, 2, 3, 4], 2, None, "GPU", None, [None, None], 0,
         "full_attention"],
        ["BlockRemoved", [3]],
        ["BlockRemoved", [4], "GPU", 0],
        ["AllBlocksCleared"],
    ]])
    assert decode_batch(payload) == EventBatch(4.0, (
        BlockStored((TOP,), None, (1, 2), 2),
        BlockStored((3, 4), TOP, (1, 2, 3, 4), 2, medium="GPU", extra_keys=(None, None),
                    group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved((3,)),
        BlockRemoved((4,), "GPU", 0),
        AllBlocksCleared(),
    ), None)


def test_unknown_map_keys_are_ignored() -> None:
    payload = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                    "medium": None, "locality": "x"}], 0])
    assert decode_batch(payload).events == (BlockRemoved((1,)),)


@pytest.mark.parametrize(("payload", "message"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1.0]), "a batch is"),
    (msgpack.packb([1.0, [{"type": "BlockGone"}], 0]), "unknown event type"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "parent_block_hash": None,
                           "token_ids": [], "block_size": 2}], 0]), "lacks block_hashes"),
    (msgpack.packb([1.0, [["BlockRemoved"]], 0]), "lacks block_hashes"),
    (msgpack.packb([1.0, [7], 0]), "tagged map or array"),
])
def test_a_malformed_batch_is_refused(payload: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_batch(payload)


def test_stored_events_split_at_each_new_chain() -> None:
    blocks = [StoredBlock(10, None, (1, 2), None), StoredBlock(11, 10, (3, 4), None),
              StoredBlock(20, 10, (5, 6), b"tenant:a\0s"), StoredBlock(21, 20, (7, 8), b"\xff")]
    assert list(stored_events(blocks, 2, "GPU")) == [
        BlockStored((10, 11), None, (1, 2, 3, 4), 2, medium="GPU", extra_keys=(None, None),
                    group_idx=0, kv_cache_spec_kind="full_attention"),
        # A text salt goes as a string (vLLM's cache_salt), other bytes as they are.
        BlockStored((20, 21), 10, (5, 6, 7, 8), 2, medium="GPU",
                    extra_keys=(("tenant:a\0s",), (b"\xff",)), group_idx=0,
                    kv_cache_spec_kind="full_attention"),
    ]


def test_sequence_numbers() -> None:
    assert seq_bytes(0) == b"\x00" * 8 and seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert seq_bytes(-1) == END_SEQ == b"\xff" * 8 and seq_of(END_SEQ) == -1
    with pytest.raises(WireError, match="8 bytes"):
        seq_of(b"\x00" * 4)
