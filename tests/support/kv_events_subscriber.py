"""A KV events subscriber process for the tests: pyzmq and msgpack only, no pagedkv import.

    python kv_events_subscriber.py PUB REPLAY TOPIC_PREFIX MODE [DEFAULT_MODEL]

It rebuilds the committed-block index {(model, hash): (token ids, parent hash, extra keys)}
from the daemon's PUB stream, applying batches strictly in seq order:
- a gap (a seq missed) is repaired by REPLAY when DEFAULT_MODEL is given: one frame with the
  first missing seq on a DEALER to the ROUTER, every buffered batch from there, the end marker
  (seq -1). A replayed batch carries no topic (vLLM's answer is [seq, payload]), so it is taken
  as DEFAULT_MODEL's: give one only when a single model publishes;
- without DEFAULT_MODEL (several models publish) a gap is repaired by a SNAPSHOT instead, as
  ops/OPERATIONS.md says: the index emptied, every committed block as BlockStored, then the
  marker [b"", S, b""]; the live stream followed from S (batches below S skipped);
- MODE "live" discards the PUB batches of seqs 0..7 as a slow join loses them, so the first
  repair is always exercised; MODE "gap" discards those of seqs 40..47 as if lost;
- MODE "late" starts with a snapshot.

Every payload goes through `decode`, written from the consumers' published decoding rules
(llm-d's kv-cache indexer VLLMAdapter and Dynamo's KvEventBatch / RawKvEvent, as the issue
lists them): a batch is an array [ts, events, data_parallel_rank?]; an event is a map tagged
under "type" or an array [tag, fields...] in vLLM's field order; hashes are unsigned 64-bit;
BlockStored's token_ids hold block_size tokens per hash. A message it refuses is counted.

Commands on stdin, one a line: "sync T" applies batches until a stored block whose first
token is T has been applied, then prints the index as one JSON line.
"""

import json
import sys
from typing import Any

import msgpack
import zmq

GAP = range(40, 48)
SLOW_JOIN = range(8)
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
U64 = range(2**64)


class Refused(ValueError):
    pass


def fields_of(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:], strict=False))


def decode(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A batch's events as (type, fields); Refused for anything the consumers would not
    read."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise Refused(f"a batch is [ts, events, rank], got {batch!r:.60}")
    ts, events = batch[0], batch[1]
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise Refused("ts is a number, events an array")
    if len(batch) == 3 and not (batch[2] is None or isinstance(batch[2], int)):
        raise Refused("data_parallel_rank is an integer")
    out = []
    for raw in events:
        if isinstance(raw, dict):
            tag = raw.get("type")
        elif isinstance(raw, list) and raw:
            tag = raw[0]
        else:
            raise Refused(f"an event is a tagged map or array, got {raw!r:.60}")
        if tag == "BlockStored":
            f = fields_of(raw, STORED_FIELDS)
            hashes, tokens, size = f["block_hashes"], f["token_ids"], f["block_size"]
            if not all(isinstance(h, int) and h in U64 for h in hashes):
                raise Refused("block hashes are unsigned 64-bit integers")
            parent = f["parent_block_hash"]
            if parent is not None and not (isinstance(parent, int) and parent in U64):
                raise Refused("the parent hash is an unsigned 64-bit integer or nil")
            if not isinstance(size, int) or size <= 0 or len(tokens) != size * len(hashes):
                raise Refused("token_ids hold block_size tokens per block")
            extra = f.get("extra_keys")
            if extra is not None and len(extra) != len(hashes):
                raise Refused("extra_keys has one entry per block")
            if f.get("medium") not in (None, "GPU", "CPU"):
                raise Refused("medium is GPU or CPU")
        elif tag == "BlockRemoved":
            f = fields_of(raw, REMOVED_FIELDS)
            if not all(isinstance(h, int) and h in U64 for h in f["block_hashes"]):
                raise Refused("block hashes are unsigned 64-bit integers")
        elif tag == "AllBlocksCleared":
            f = {}
        else:
            raise Refused(f"unknown event type {tag!r}")
        out.append((tag, f))
    return out


class Index:
    def __init__(self) -> None:
        self.blocks: dict[tuple[str, int], tuple[list[int], int | None, Any]] = {}
        self.first_tokens: set[int] = set()
        self.accepted = 0
        self.refused: list[str] = []
        # Hashes removed, over the whole stream.
        self.removed = 0

    def clear(self) -> None:
        """Forget every block (a snapshot rebuilds them)."""
        self.blocks.clear()
        self.first_tokens.clear()

    def apply(self, model: str, payload: bytes) -> None:
        try:
            events = decode(payload)
        except (Refused, KeyError, TypeError, ValueError) as exc:
            self.refused.append(str(exc))
            return
        self.accepted += 1
        for tag, f in events:
            if tag == "BlockStored":
                parent, size = f["parent_block_hash"], f["block_size"]
                extra = f.get("extra_keys") or [None] * len(f["block_hashes"])
                for i, block_hash in enumerate(f["block_hashes"]):
                    tokens = f["token_ids"][i * size:(i + 1) * size]
                    self.blocks[model, block_hash] = (tokens, parent, extra[i])
                    self.first_tokens.add(tokens[0])
                    parent = block_hash
            elif tag == "BlockRemoved":
                for block_hash in f["block_hashes"]:
                    self.blocks.pop((model, block_hash), None)
                    self.removed += 1
            else:
                for key in [key for key in self.blocks if key[0] == model]:
                    del self.blocks[key]


class Subscriber:
    def __init__(self, pub: str, replay: str, prefix: str, mode: str, model: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt(zmq.SUBSCRIBE, prefix.encode())
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.prefix, self.mode, self.model = prefix, mode, model
        self.index = Index()
        self.next_seq = 0
        self.replays = 0
        self.snapshots = 0
        self.skipped = 0
        if mode == "late":
            self.snapshot()

    def model_of(self, topic: bytes) -> str:
        return topic.decode()[len(self.prefix):]

    def snapshot(self) -> None:
        self.index.clear()
        self.dealer.send_multipart([b"", b"snapshot"])
        while True:
            frames = self.dealer.recv_multipart()[1:]
            topic, seq, payload = frames
            if not topic:
                start = int.from_bytes(seq, "big", signed=True)
                assert start >= 0, "the snapshot failed"
                self.next_seq, self.snapshots = start, self.snapshots + 1
                return
            self.index.apply(self.model_of(topic), payload)

    def repair(self) -> None:
        """Catch up from next_seq: by replay when the topicless replayed batches are known to
        be DEFAULT_MODEL's, else by a snapshot."""
        if self.model:
            self.replay()
        else:
            self.snapshot()

    def replay(self) -> None:
        self.replays += 1
        self.dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            frames = self.dealer.recv_multipart()[1:]
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                return
            assert seq == self.next_seq, f"replay gave seq {seq}, {self.next_seq} needed"
            model = self.model_of(frames[0]) if len(frames) == 3 else self.model
            self.index.apply(model, frames[-1])
            self.next_seq += 1

    def receive(self, timeout_ms: int) -> bool:
        """One PUB batch applied (a gap before it repaired first); False on timeout."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_frame, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_frame, "big")
        if (self.mode == "gap" and seq in GAP) or (self.mode == "live" and seq in SLOW_JOIN):
            self.skipped += 1
            return True
        if seq < self.next_seq:
            return True  # below the snapshot's S, or replayed already
        if seq > self.next_seq:
            self.repair()
            if seq < self.next_seq:
                return True
        assert seq == self.next_seq, f"seq {seq} after replay to {self.next_seq}"
        self.index.apply(self.model_of(topic), payload)
        self.next_seq += 1
        return True

    def sync(self, token: int) -> None:
        while token not in self.index.first_tokens:
            if not self.receive(1000):
                self.repair()  # a batch the PUB socket dropped at the end: ask again

    def dump(self) -> str:
        return json.dumps({
            "blocks": [[model, block_hash, tokens, parent, extra]
                       for (model, block_hash), (tokens, parent, extra)
                       in self.index.blocks.items()],
            "accepted": self.index.accepted, "refused": self.index.refused,
            "removed": self.index.removed,
            "replays": self.replays, "snapshots": self.snapshots, "skipped": self.skipped,
            "next_seq": self.next_seq}, default=repr)


def main() -> None:
    pub, replay, prefix, mode = sys.argv[1:5]
    model = sys.argv[5] if len(sys.argv) > 5 else ""
    subscriber = Subscriber(pub, replay, prefix, mode, model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "sync":
            subscriber.sync(int(argument))
            print(subscriber.dump(), flush=True)


if __name__ == "__main__":
    main()
