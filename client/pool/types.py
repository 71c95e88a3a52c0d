"""The client's records: small typed dataclasses built from the daemon's messages.

Only ids, counts and slots travel; no numpy. Every public method of `PoolClient` and `Session`
returns these records (or plain ints), never a protobuf object, except PoolInfo.memory and
ModelInfo.memory: the pool-memory handle's wire form, which only `pagedkv.memory` reads. (The
runner's records, `RunnerInfo` and `SeqOutput`, live beside `RunnerClient`.)
"""

from dataclasses import dataclass, field

from pagedkv.proto import kvpool_pb2 as pb


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy-on-write copy the daemon already did in pool memory."""

    # Block the data came from (still held by the other sharers).
    src: int
    # The caller's new private block.
    dst: int


@dataclass(frozen=True, slots=True)
class SequenceBlocks:
    """One sequence after a call."""

    # The client's id for the sequence.
    seq_id: int
    # Block table: logical block i -> physical block block_ids[i]; empty after a free.
    block_ids: list[int]
    # Tokens the sequence holds.
    num_tokens: int
    # Leading tokens found in the prefix cache (allocate only).
    num_cached_tokens: int
    # Slot (block * block_size + offset) of each token this call added.
    slot_mapping: list[int]
    # Copy-on-write copies done for this call.
    copies: list[BlockCopy]
    # Every token id the sequence holds (block_tables(token_ids=True) only; empty when the
    # daemon does not know them all).
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_proto(cls, message: pb.SequenceBlocks) -> "SequenceBlocks":
        return cls(message.seq_id, list(message.block_ids), message.num_tokens,
                   message.num_cached_tokens, list(message.slot_mapping),
                   [BlockCopy(c.src, c.dst) for c in message.copies], list(message.token_ids))


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one Step did, as parallel lists (index i of the changed_* lists is one entry)."""

    # Slots of the appended tokens, sequence-major (len(seq_ids) * num_tokens).
    slot_mapping: list[int]
    # Block-table entries that changed: index into the step's seq_ids, logical block, and
    # the physical block now there (new blocks and copy-on-write replacements).
    changed_seq_index: list[int]
    changed_logical_block: list[int]
    changed_block_id: list[int]
    # Copy-on-write copies done for this step.
    copies: list[BlockCopy]
    # Each sequence's token count after the step, in the step's order.
    num_tokens: list[int]

    @classmethod
    def from_proto(cls, message: pb.StepResponse) -> "StepResult":
        return cls(list(message.slot_mapping), list(message.changed_seq_index),
                   list(message.changed_logical_block), list(message.changed_block_id),
                   [BlockCopy(s, d) for s, d in zip(message.copy_src, message.copy_dst,
                                                    strict=True)],
                   list(message.num_tokens))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model registered with the daemon (kvpool.proto's "Models and pages")."""

    # The name sessions name it by (OpenSessionRequest.model).
    name: str
    # Its KV geometry (block_size is the pool's, the same for every model).
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # K and V of block_size tokens over all layers; a page holds blocks_per_page of them.
    bytes_per_block: int
    blocks_per_page: int
    # Block ids of its format: num_pages * blocks_per_page.
    num_blocks: int
    # Where its runner serves clients (a gRPC target); "" if none registered one.
    runner_target: str
    # It sleeps: new sessions of it are refused (ModelAsleep).
    asleep: bool
    # Its [models.NAME] policy in bytes: reserved, and its cap (0 = none).
    min_memory: int
    max_memory: int
    # Now: blocks its sessions hold, its committed cached blocks, pages of its format.
    used_blocks: int
    cached_blocks: int
    format_pages: int
    # Its view of the pool memory, in its wire form (runners only; kind "" otherwise): a runner
    # maps it with attach_pool(PoolMemoryHandle.from_proto(model.memory)) (pagedkv.memory).
    memory: pb.PoolMemory

    @classmethod
    def from_proto(cls, m: pb.ModelInfo) -> "ModelInfo":
        return cls(m.name, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype, m.bytes_per_block,
                   m.blocks_per_page, m.num_blocks, m.runner_target, m.asleep, m.min_memory,
                   m.max_memory, m.used_blocks, m.cached_blocks, m.format_pages, m.memory)


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """The pool's geometry and how to attach to its memory."""

    # Random id of the daemon run; changes on restart.
    pool_id: str
    num_blocks: int
    block_size: int
    # Model geometry the pool is laid out for ("" and zeros when the daemon has none).
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # K and V of block_size tokens over all layers.
    bytes_per_block: int
    # Axes of the pool tensor, comma-separated.
    layout: str
    # Attach instructions, in their wire form: a runner maps them with
    # attach_pool(PoolMemoryHandle.from_proto(info.memory)) (pagedkv.memory); kind "" when the
    # daemon keeps bookkeeping only.
    memory: pb.PoolMemory
    # Blocks each sequence reserves when allocated or forked (a contiguous daemon); 0 = paged.
    reservation_blocks: int = 0
    # The pool's memory: num_pages pages of page_bytes, shared by every model's format.
    page_bytes: int = 0
    num_pages: int = 0
    # Every registered model (the daemon's own included), by registration order.
    models: tuple[ModelInfo, ...] = ()
    # The host-memory tier: blocks of the daemon's own model it holds (0 = no tier), and the
    # daemon's copy rate between it and the pool, in bytes per second (kvpool.proto).
    host_tier_blocks: int = 0
    host_copy_bytes_per_s: int = 0
    # The pool whose memory and state this daemon took over across a restart (restore =
    # auto); "" when it started cold (kvpool.proto).
    previous_pool_id: str = ""
    # That state came from the crash log, not a snapshot: K/V past each sequence's committed
    # tokens is not trusted, a runner recomputes it (kvpool.proto).
    recovered_from_crash_log: bool = False

    @classmethod
    def from_proto(cls, message: pb.PoolInfo) -> "PoolInfo":
        return cls(message.pool_id, message.num_blocks, message.block_size, message.model,
                   message.num_layers, message.num_kv_heads, message.head_dim, message.dtype,
                   message.bytes_per_block, message.layout, message.memory,
                   message.reservation_blocks, message.page_bytes, message.num_pages,
                   tuple(ModelInfo.from_proto(m) for m in message.models),
                   message.host_tier_blocks, message.host_copy_bytes_per_s,
                   message.previous_pool_id, message.recovered_from_crash_log)

    def model_info(self, name: str) -> ModelInfo | None:
        """The registered model of that name, or None."""
        return next((model for model in self.models if model.name == name), None)

    def runner_for(self, name: str) -> str:
        """The gRPC target of the runner serving model `name` (as it registered); ValueError
        naming the models that have a runner when none serves it."""
        model = self.model_info(name)
        if model is not None and model.runner_target:
            return model.runner_target
        served = ", ".join(repr(m.name) for m in self.models if m.runner_target) or "none"
        state = "is registered by no runner" if model is not None else "is not registered"
        raise ValueError(f"model {name!r} {state} with the daemon; models with a runner: "
                         f"{served}")


@dataclass(frozen=True, slots=True)
class SessionStats:
    """One session's figures (GetStats returns only the caller's own)."""

    # "client_name#number".
    name: str
    num_sequences: int
    # Block-table entries over the session's sequences: what max_blocks bounds (a contiguous
    # daemon counts each sequence's whole reservation).
    block_table_entries: int
    # Distinct physical blocks referenced (contiguous: reserved).
    blocks_held: int
    max_blocks: int
    # Prefix-cache lookups of the session's allocations, in tokens.
    prefix_cache_queries: int
    prefix_cache_hits: int
    lease_ttl_ms: int
    # The model whose K/V the session holds (what a runner checks against its own).
    model: str = ""

    @classmethod
    def from_proto(cls, m: pb.SessionStats) -> "SessionStats":
        return cls(m.name, m.num_sequences, m.block_table_entries, m.blocks_held, m.max_blocks,
                   m.prefix_cache_queries, m.prefix_cache_hits, m.lease_ttl_ms, m.model)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What a client may see of the pool: its capacity, and its own session's figures (other
    sessions' activity is for operators, on the daemon's /metrics)."""

    num_blocks: int
    block_size: int
    # Blocks an allocation could take now (including evictable cached ones); on a contiguous
    # daemon, those whole max_model_len reservations can take (one per new sequence).
    free_blocks: int
    # The caller's own session, when asked through a Session.
    session: SessionStats | None
    # Every registered model's figures (no memory views).
    models: tuple[ModelInfo, ...] = ()

    @classmethod
    def from_proto(cls, m: pb.PoolStats) -> "PoolStats":
        session = SessionStats.from_proto(m.sessions[0]) if m.sessions else None
        return cls(m.num_blocks, m.block_size, m.free_blocks, session,
                   tuple(ModelInfo.from_proto(model) for model in m.models))
