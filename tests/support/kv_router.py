"""A KV-aware router for the tests: what llm-d's KV-cache indexer and Dynamo's KV router do with
a daemon's KV events, small enough to read, to show that several daemons can be routed by them.
A test helper, not a product router.

It reads only the wire (pyzmq SUB and msgpack, no pagedkv import), in llm-d's "global socket"
layout: its SUB socket binds one endpoint per daemon and each daemon's PUB connects to it
(`kv_events_endpoint = "tcp://127.0.0.1:PORT"`, a host name: connected); the daemon is named by
its topic, `kv@NAME@MODEL`. A batch whose seq skips ahead is repaired by a replay from the
daemon's ROUTER endpoint; a seq back to 0 (a restarted daemon) empties its blocks. Events are
read in both encodings (a map tagged under "type", or vLLM's older array `[tag, fields...]`).

The index keys each block by its token ids chained to its parent's key, as llm-d rehashes
blocks from `token_ids`: it never relies on the daemon's hash function, which it uses only to
find a block's parent and what a BlockRemoved names. A request goes to the daemon holding the
longest indexed prefix of its prompt; without a hit, or on a tie, to the least loaded one
(requests routed so far), the first by name on equal load.
"""

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

# vLLM's field order, for events written as arrays [tag, field, ...].
FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
          "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}
# The parent key of a prompt's first block.
ROOT = 0
END_SEQ = -1
REPLAY_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class EventSource:
    """One daemon as the router sees it."""

    # The pod name in its topic (kv@NAME@).
    name: str
    # The endpoint the router's SUB binds; the daemon's kv_events_endpoint connects to it.
    pub_endpoint: str
    # The daemon's kv_events_replay_endpoint (bound by the daemon).
    replay_endpoint: str


@dataclass(frozen=True)
class Route:
    """Where a request goes, and why."""

    # The chosen daemon's name.
    daemon: str
    # Tokens of the prompt's longest prefix indexed there (0: no hit).
    matched_tokens: int


def decode_events(payload: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A batch `[ts, [events...], rank]` as (tag, fields) per event, in either encoding."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    events = []
    for raw in batch[1]:
        if isinstance(raw, dict):
            events.append((str(raw["type"]), raw))
        else:
            events.append((str(raw[0]), dict(zip(FIELDS[raw[0]], raw[1:], strict=False))))
    return events


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """A block's key: its tokens chained to its parent's key (tuples of ints hash the same in
    every process)."""
    return hash((parent, tuple(tokens)))


class PrefixIndex:
    """Chained token-block keys -> the daemons holding them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.holders: defaultdict[int, set[str]] = defaultdict(set)
        # Per daemon: its own block hash -> our key, to resolve parents and removals.
        self.keys: defaultdict[str, dict[int, int]] = defaultdict(dict)
        # BlockStored chains whose parent was unknown (stored before we subscribed).
        self.unanchored = 0

    def keys_of(self, tokens: Sequence[int]) -> list[int]:
        """The keys of the full blocks of `tokens`, in order."""
        keys, parent = [], ROOT
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = chain_key(parent, tokens[start:start + self.block_size])
            keys.append(parent)
        return keys

    def store(self, daemon: str, fields: dict[str, Any]) -> None:
        own = self.keys[daemon]
        parent_hash = fields["parent_block_hash"]
        if parent_hash is not None and parent_hash not in own:
            self.unanchored += 1
            return
        parent = ROOT if parent_hash is None else own[parent_hash]
        tokens, size = fields["token_ids"], fields["block_size"]
        assert size == self.block_size, f"{daemon} sends blocks of {size}, not {self.block_size}"
        for i, block_hash in enumerate(fields["block_hashes"]):
            parent = chain_key(parent, tokens[i * size:(i + 1) * size])
            own[block_hash] = parent
            self.holders[parent].add(daemon)

    def remove(self, daemon: str, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            key = self.keys[daemon].pop(block_hash, None)
            if key is not None:
                self.holders[key].discard(daemon)

    def clear(self, daemon: str) -> None:
        self.remove(daemon, list(self.keys[daemon]))

    def matched_blocks(self, tokens: Sequence[int], daemons: Iterable[str]) -> dict[str, int]:
        """Per daemon, how many leading full blocks of `tokens` it holds."""
        matched = dict.fromkeys(daemons, 0)
        for depth, key in enumerate(self.keys_of(tokens), 1):
            holding = [d for d in matched if matched[d] == depth - 1 and d in self.holders[key]]
            if not holding:
                break
            for daemon in holding:
                matched[daemon] = depth
        return matched


@dataclass
class Feed:
    """One daemon's place in its stream."""

    # The seq the next batch must have.
    next_seq: int = 0
    # DEALER to its replay endpoint.
    replay: Any = None
    # Requests routed to it.
    load: int = 0
    # Batches applied (live or replayed).
    batches: int = 0
    # Replays asked for.
    replays: int = 0


class KvRouter:
    """Subscribes to every daemon's KV events and routes prompts by them."""

    def __init__(self, sources: Sequence[EventSource], block_size: int) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.index = PrefixIndex(block_size)
        self.feeds: dict[str, Feed] = {}
        for source in sources:
            self.sub.bind(source.pub_endpoint)
            dealer = self.context.socket(zmq.DEALER)
            dealer.connect(source.replay_endpoint)
            self.feeds[source.name] = Feed(replay=dealer)

    def close(self) -> None:
        self.context.destroy(linger=0)

    # ------------------------------------------------------------ routing

    def route(self, prompt: Sequence[int]) -> Route:
        """The daemon with the longest indexed prefix of `prompt`; least loaded otherwise."""
        matched = self.index.matched_blocks(prompt, sorted(self.feeds))
        best = max(matched.values())
        tied = [d for d in sorted(matched) if matched[d] == best]
        daemon = min(tied, key=lambda d: self.feeds[d].load)
        self.feeds[daemon].load += 1
        return Route(daemon, best * self.index.block_size)

    def holds(self, daemon: str, tokens: Sequence[int]) -> bool:
        """Whether the index has every full block of `tokens` on `daemon`."""
        return all(daemon in self.index.holders[key] for key in self.index.keys_of(tokens))

    # ------------------------------------------------------------ events

    def apply(self, daemon: str, payload: bytes) -> None:
        """One batch's events applied to the index."""
        self.feeds[daemon].batches += 1
        for tag, fields in decode_events(payload):
            if tag == "BlockStored":
                self.index.store(daemon, fields)
            elif tag == "BlockRemoved":
                self.index.remove(daemon, fields["block_hashes"])
            elif tag == "AllBlocksCleared":
                self.index.clear(daemon)

    def pump(self, timeout_ms: int) -> bool:
        """One PUB batch applied in seq order (a gap repaired first); False on timeout."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_frame, payload = self.sub.recv_multipart()
        daemon = topic.decode().split("@")[1]
        feed, seq = self.feeds[daemon], int.from_bytes(seq_frame, "big")
        if seq == 0 and feed.next_seq > 0:  # the daemon restarted: a new, empty pool
            self.index.clear(daemon)
            feed.next_seq = 0
        if seq > feed.next_seq:
            self.replay(daemon)
        if seq == feed.next_seq:
            self.apply(daemon, payload)
            feed.next_seq += 1
        return True

    def replay(self, daemon: str) -> None:
        """Every buffered batch of `daemon` from the one we miss, applied in order."""
        feed = self.feeds[daemon]
        feed.replays += 1
        feed.replay.send_multipart([b"", feed.next_seq.to_bytes(8, "big")])
        while True:
            assert feed.replay.poll(REPLAY_TIMEOUT_MS), f"{daemon} does not answer the replay"
            *_, seq_frame, payload = feed.replay.recv_multipart()
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == END_SEQ:
                return
            if seq == feed.next_seq:
                self.apply(daemon, payload)
                feed.next_seq += 1

    def wait_until(self, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
        """Apply events until `done()`; a quiet PUB socket gets every daemon replayed (a
        batch lost at the end of the stream leaves no gap to notice)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "the index never caught up"
            if not self.pump(100):
                for daemon in self.feeds:
                    self.replay(daemon)
