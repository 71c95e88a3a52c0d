"""vLLM's KV events on the wire: the records, their msgpack encoding, a decoder.

Checked against vLLM's `vllm/distributed/kv_events.py` (msgspec structs) and what its
consumers decode (llm-d's `VLLMAdapter`, Dynamo's `KvEventBatch`/`RawKvEvent`):
- A batch is a msgpack array `[ts, [events...], data_parallel_rank]` (`EventBatch`,
  msgspec `array_like=True`; the publisher sets the rank, 0 here).
- An event is a map tagged under "type" with the class name, then its fields in declaration
  order (msgspec `tag=True`, `omit_defaults=True`; vLLM dropped `array_like` from the events
  in vllm-project/vllm#42892). Fields without a default are always written (None as nil);
  fields with a default of None are left out when None.
- Before that change an event was an array `[tag, field, ...]` in the same order, trailing
  defaults left out; `decode_batch` reads both forms (and a batch written as a map).
- Hashes are unsigned 64-bit integers.

The PUB frames are `[topic, seq, payload]`: `seq` 8 bytes big-endian from 0 per publisher.
"""

from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

import msgpack

from pagedkv.daemon.events.sink import MEDIUM_CPU as MEDIUM_CPU  # re-exported: the tiers
from pagedkv.daemon.events.sink import MEDIUM_GPU as MEDIUM_GPU
from pagedkv.daemon.events.sink import StoredBlock

# BlockStored `kv_cache_spec_kind` of a full-attention cache group (vLLM's spec kinds).
FULL_ATTENTION = "full_attention"
# The seq of the end marker closing a replay answer: -1, 8 bytes signed big-endian.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class WireError(ValueError):
    """A payload that is not a batch of known events; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became matchable: one chain, each block's parent the one before it."""

    # The blocks' hashes, in chain order.
    block_hashes: tuple[int, ...]
    # The hash of the first block's parent; None for a prompt's first block.
    parent_block_hash: int | None
    # Every block's tokens, concatenated (block_size per block).
    token_ids: tuple[int, ...]
    # Tokens per block.
    block_size: int
    # Deprecated in vLLM (lora_name replaces it); None here.
    lora_id: int | None = None
    # Where the blocks live: MEDIUM_GPU or MEDIUM_CPU.
    medium: str | None = None
    # The LoRA adapter's name; None here.
    lora_name: str | None = None
    # Per block: a tuple of the extra keys its hash mixes in (here the salt), or None.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    # The KV-cache group (0: one full-attention group).
    group_idx: int | None = None
    # The group's spec kind (FULL_ATTENTION) and sliding window (None: none).
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that left the cache."""

    # Their hashes.
    block_hashes: tuple[int, ...]
    # Where they lived.
    medium: str | None = None
    # Their KV-cache group.
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the topic's model is gone (or, after a drop, unknown: resync)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
# Fields vLLM declares without a default: written even when None.
_ALWAYS_WRITTEN = {BlockStored: 7, BlockRemoved: 2, AllBlocksCleared: 0}


@dataclass(frozen=True, slots=True)
class EventBatch:
    """What one PUB message carries."""

    # Seconds since the epoch when the batch was made.
    ts: float
    # Its events, in order.
    events: tuple[Event, ...]
    # vLLM's data-parallel rank of the publisher; always 0 for a daemon.
    data_parallel_rank: int | None = 0


def encode_batch(batch: EventBatch) -> bytes:
    """The batch as vLLM's msgspec encoder writes it (see the module docstring)."""
    payload: bytes = msgpack.packb([batch.ts, [_event_map(event) for event in batch.events],
                                    batch.data_parallel_rank], use_bin_type=True)
    return payload


def _event_map(event: Event) -> dict[str, Any]:
    tagged: dict[str, Any] = {"type": type(event).__name__}
    for index, spec in enumerate(fields(event)):
        value = getattr(event, spec.name)
        if value is not None or index < _ALWAYS_WRITTEN[type(event)]:
            tagged[spec.name] = value
    return tagged


def decode_batch(payload: bytes) -> EventBatch:
    """A batch of either event form; WireError when it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise WireError(f"a batch is [ts, events, data_parallel_rank], got {raw!r:.80}")
    ts, events, *rank = raw
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError(f"a batch is [ts, events, data_parallel_rank], got {raw!r:.80}")
    return EventBatch(float(ts), tuple(decode_event(event) for event in events),
                      rank[0] if rank else None)


def decode_event(raw: Any) -> Event:
    """One event from its map or array form; unknown map keys and extra array items ignored."""
    if isinstance(raw, dict):
        tag, values = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag, values = raw[0], None
    else:
        raise WireError(f"an event is a tagged map or array, got {raw!r:.80}")
    cls = EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise WireError(f"unknown event type {tag!r}")
    names = [spec.name for spec in fields(cls)]
    if values is None:
        values = dict(zip(names, raw[1:], strict=False))
    missing = [spec.name for spec in fields(cls)
               if spec.default is MISSING and spec.name not in values]
    if missing:
        raise WireError(f"{tag} lacks {', '.join(missing)}")
    kwargs = {name: _tuples(values[name]) for name in names if name in values}
    return cls(**kwargs)


def _tuples(value: Any) -> Any:
    """msgpack's lists as tuples, so decoded records compare equal to built ones."""
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def stored_events(blocks: Sequence[StoredBlock], block_size: int,
                  medium: str) -> Iterator[BlockStored]:
    """The sink's blocks as vLLM's events: one BlockStored per run of blocks each continuing
    the one before it (its parent_hash the previous block's hash)."""
    run: list[StoredBlock] = []
    for block in blocks:
        if run and block.parent_hash != run[-1].block_hash:
            yield _stored(run, block_size, medium)
            run = []
        run.append(block)
    if run:
        yield _stored(run, block_size, medium)


def _stored(run: list[StoredBlock], block_size: int, medium: str) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(block.block_hash for block in run),
        parent_block_hash=run[0].parent_hash,
        token_ids=tuple(token for block in run for token in block.token_ids),
        block_size=block_size, medium=medium,
        # vLLM writes one entry per block, None for a block with no extra key.
        extra_keys=tuple(None if block.extra_key is None else (salt_key(block.extra_key),)
                         for block in run),
        group_idx=0, kv_cache_spec_kind=FULL_ATTENTION)


def salt_key(salt: bytes) -> str | bytes:
    """A salt as an extra key: text (vLLM's cache_salt is a string, and Dynamo reads a string
    extra key as the namespace) when it is UTF-8, else the bytes as they are."""
    try:
        return salt.decode()
    except UnicodeDecodeError:
        return salt


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number as it travels: 8 bytes big-endian (signed, for END_SEQ)."""
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """The sequence number of an 8-byte frame; WireError for another length."""
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
