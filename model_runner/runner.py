"""The co-located model runner: a transformers model computing on the daemon's pool memory.

    info = await client.pool_info()
    runner = ModelRunner.attach(model, info, get_backend("auto", device))
    logits = runner.step([SequenceChunk(prompt, 0, blocks.slot_mapping, blocks.block_ids)])

The daemon decides where every token's K/V lives (block tables, slots); the runner only computes:
`ModelRunner.step` runs the model once over a packed batch of `SequenceChunk`s (a prompt's
uncached suffix, or one decode token) and returns each chunk's next-token logits. The step loop
that asks the daemon for those tables and samples the logits is the step engine's
(`pagedkv.model_runner.engine`). The daemon performs copy-on-write copies in pool memory,
complete, before it answers, so the runner never copies a block.

A prompt whose every token is in the prefix cache (a multiple of the block size, all blocks
shared) still needs the logits of its last token: the runner recomputes that one token with
slot -1, so store_kv writes nothing. Its K/V is already in the cached block, which other
sequences share; writing there, even the same values, would break the rule that no sequence
writes into a block another table references.
"""

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

import numpy as np
import torch
from transformers import PreTrainedModel

from pagedkv.client import PoolInfo
from pagedkv.memory import PoolMemoryHandle
from pagedkv.memory.attach import attach_pool
from pagedkv.model_runner.decode_graphs import BUCKETS, CUDA_GRAPH_OPS, DecodeGraphs, GraphOps
from pagedkv.model_runner.kernels.attention_backend import AttentionBackend
from pagedkv.model_runner.kernels.paged_attention import (
    CONTEXT_KWARG,
    PagedContext,
    enable_paged_attention,
)
from pagedkv.model_runner.kernels.paged_checks import FP8_CACHE_DTYPE, check_fp8_device
from pagedkv.vocab.blocks import blocks_for, ceil_div


@dataclass(frozen=True)
class SequenceChunk:
    """New tokens of one sequence to run through the model in a step, and where they go."""

    # The tokens to compute, in order.
    token_ids: Sequence[int]
    # Tokens of the sequence before these (the position of token_ids[0]); their K/V is in the
    # pool already or is written by an earlier chunk of the same step.
    start: int
    # One pool slot per token (block * block_size + offset); -1 computes without writing.
    slot_mapping: Sequence[int]
    # The sequence's block table, covering at least start + len(token_ids) tokens.
    block_table: Sequence[int]


@dataclass(frozen=True)
class StepInputs:
    """What `model(...)` gets for one step."""

    # [1, T] the chunks' tokens packed into one row.
    input_ids: torch.Tensor
    # [1, T] each token's position in its own sequence (rotary embeddings need them).
    position_ids: torch.Tensor
    # The logits kept (transformers' logits_to_keep): [S] the index in the packed row of each
    # chunk's last token, or 0, every row in order (a decode step: no gather of the rows).
    last_token_index: torch.Tensor | int
    # The kernels' view of the batch.
    context: PagedContext


class PoolReleased(RuntimeError):
    """The runner dropped its mapping of the pool: its daemon went away (it maps the pool again
    once the daemon answers)."""


class ModelRunner:
    """Runs `model` with its KV cache in `pool` (switches the model to "pagedkv" attention).

    pool: [num_blocks, num_layers, 2, block_size, H_kv, D], on the model's device, in its
    dtype or fp8 (kv_cache_dtype fp8: the kernels quantize and dequantize).
    """

    def __init__(self, model: PreTrainedModel, pool: torch.Tensor, block_size: int,
                 backend: AttentionBackend) -> None:
        num_layers = model.config.get_text_config().num_hidden_layers
        if pool.dim() != 6 or pool.shape[1] != num_layers or pool.shape[3] != block_size:
            raise ValueError(f"pool {tuple(pool.shape)} is not [blocks, {num_layers} layers, 2, "
                             f"{block_size} slots, H_kv, D] for this model")
        if pool.dtype not in (model.dtype, FP8_CACHE_DTYPE) or pool.device != model.device:
            raise ValueError(f"pool is {pool.dtype} on {pool.device}, the model {model.dtype} "
                             f"on {model.device}")
        check_fp8_device(pool)
        # Heads and head_dim are checked by store_kv in the first layer, before any write.
        self.model = model
        # The pool's memory, mapped; None once released (`release_pool`).
        self._pool: torch.Tensor | None = pool
        self.block_size = block_size
        self.backend = backend
        text_config = model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        # The longest context the model takes: GPT-2 and OPT have no embedding for a later
        # position, and no model was trained past it (vLLM's max_model_len).
        self.max_model_len = int(text_config.max_position_embeddings)
        # Decode steps replayed from CUDA graphs (`capture_decode_graphs`); None: every step
        # eager, as on the CPU.
        self.decode_graphs: DecodeGraphs | None = None
        enable_paged_attention(model)

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids, from its generation config (may be none)."""
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @classmethod
    def attach(cls, model: PreTrainedModel, info: PoolInfo,
               backend: AttentionBackend) -> Self:
        """A runner over the memory of the daemon that answered `info` (client.pool_info())."""
        pool = attach_pool(PoolMemoryHandle.from_proto(info.memory))
        return cls(model, pool, info.block_size, backend)

    @property
    def pool(self) -> torch.Tensor:
        """The pool memory; PoolReleased once `release_pool` dropped it."""
        if self._pool is None:
            raise PoolReleased("the runner released the pool memory: its daemon went away")
        return self._pool

    @property
    def released(self) -> bool:
        """Whether `release_pool` dropped the pool memory."""
        return self._pool is None

    def release_pool(self) -> None:
        """Drop this runner's reference to the pool memory. Its pages are freed once no tensor
        views them any more: a dead daemon's /dev/shm pool stays allocated for as long as a
        runner maps it, and a new daemon may need that room. Call it between forwards
        (`ForwardLoop.between_forwards`): a running forward holds the pool until it ends, and
        a later step on this runner raises PoolReleased before it reads the pool."""
        self._pool = None

    @torch.inference_mode()
    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Compute every chunk (writing its K/V) and return [S, vocab] fp32 logits of each
        chunk's last token. Bad chunks raise ValueError before anything is written."""
        inputs = self.prepare(chunks)
        if self.decode_graphs is not None and self.decode_graphs.fits(inputs):
            return self.decode_graphs.run(inputs)
        output = self.model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                            use_cache=False, logits_to_keep=inputs.last_token_index,
                            **{CONTEXT_KWARG: inputs.context})
        logits: torch.Tensor = output.logits  # [1, S, vocab]
        return logits[0].float()

    def warm_up(self) -> None:
        """Run the steps whose kernel launches cover every compiled variant this runner's steps
        can meet, so that none compiles (seconds, on Triton's JIT) under load: a prefill, a decode
        at the shortest and at the longest context (the most split-K splits), and a batch mixing
        them. Every variant of a layer is launched by every layer of its kind (windowed,
        soft-capped). They read block 0 only and write nothing (slot -1)."""
        longest = self.max_model_len
        table = [0] * blocks_for(longest, self.block_size)
        prefill = SequenceChunk([0, 0], 0, [-1, -1], table)
        short = SequenceChunk([0], 0, [-1], [0])
        long = SequenceChunk([0], longest - 1, [-1], table)
        for chunks in ([prefill], [short], [long], [prefill, short, long]):
            self.step(chunks)

    def capture_decode_graphs(self, ops: GraphOps = CUDA_GRAPH_OPS,
                              buckets: tuple[int, ...] = BUCKETS) -> None:
        """Capture a decode forward per bucket of batch sizes (`pagedkv runner --cuda-graphs`):
        later decode steps that fit a bucket replay it (decode_graphs.py). CUDA's graphs: a
        ValueError on a CPU pool, or with the torch backend (its kernels read values back, which
        a capture cannot); `ops` stands in for them in tests."""
        if ops is CUDA_GRAPH_OPS and self.pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the pool on a CUDA device, not "
                             f"{self.pool.device}: eager is the only path on the CPU")
        if ops is CUDA_GRAPH_OPS and self.backend.name != "triton":
            raise ValueError(f"CUDA graphs need the triton attention backend, not "
                             f"{self.backend.name!r}")
        self.decode_graphs = DecodeGraphs(self, ops, buckets)

    def prepare(self, chunks: Sequence[SequenceChunk]) -> StepInputs:
        """Pack and validate the chunks on the host (numpy), then move them to the pool's device
        in one host-to-device copy of one packed buffer, of which the inputs are views.
        Sequences that bring one token are packed first (PagedContext.num_decodes); the logits
        still come back in chunk order. A decode step (one token per chunk) keeps its order,
        and every numpy op it skips is ~1 us of a step's host time."""
        _check_chunks(chunks)
        num_seqs = len(chunks)
        lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, num_seqs)  # [S]
        num_tokens = int(lens.sum())
        decode = num_tokens == num_seqs  # one token per sequence
        if not decode:  # packed sequence -> its chunk: one-token chunks first, in chunk order
            order = np.argsort(lens != 1, kind="stable")
            chunks, lens = [chunks[i] for i in order], lens[order]
        starts = np.fromiter((c.start for c in chunks), np.int64, num_seqs)  # [S]
        table_lens = np.fromiter((len(c.block_table) for c in chunks), np.int64, num_seqs)
        buffer = PackedBuffer(_step_fields(num_tokens, num_seqs, int(table_lens.max()), decode))
        host = buffer.host
        token_ids = host["input_ids"][0]  # [T]
        token_ids[:] = _flatten((c.token_ids for c in chunks), num_tokens)
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        seq_lens = starts + lens  # [S]
        if decode:
            seq_of, positions = np.arange(num_seqs), starts  # [T] = [S]
            host["query_start_loc"][:] = np.arange(num_seqs + 1)
        else:
            query_start_loc = np.zeros(num_seqs + 1, np.int64)
            np.cumsum(lens, out=query_start_loc[1:])
            seq_of = np.repeat(np.arange(num_seqs), lens)  # [T]
            positions = np.arange(num_tokens) - query_start_loc[seq_of] + starts[seq_of]
            host["query_start_loc"][:] = query_start_loc
            host["last"][order] = query_start_loc[1:] - 1  # chunk i's last token, for chunk i
        host["positions"][0] = positions
        host["slots"][:] = _flatten((c.slot_mapping for c in chunks), num_tokens)
        host["seq_lens"][:] = seq_lens
        self._fill_tables(host["tables"], chunks, table_lens, seq_lens)
        self._check_slots(host["tables"], seq_of, positions, host["slots"])
        device = buffer.to(self.pool.device)
        num_decodes = num_seqs if decode else int((lens == 1).sum())
        context = PagedContext(
            backend=self.backend, pool=self.pool, slot_mapping=device["slots"],
            block_tables=device["tables"], seq_lens=device["seq_lens"],
            query_start_loc=device["query_start_loc"], num_decodes=num_decodes,
            max_decode_len=int(seq_lens[:num_decodes].max(initial=0)),
            max_q_len=None if decode else int(lens[num_decodes:].max(initial=0)) or None)
        return StepInputs(device["input_ids"], device["positions"],
                          0 if decode else device["last"], context)

    def _fill_tables(self, tables: np.ndarray, chunks: Sequence[SequenceChunk],
                     table_lens: np.ndarray, seq_lens: np.ndarray) -> None:
        """Write the chunks' block tables into `tables` [S, width] (padded with block 0) once
        each table covers its sequence with pool blocks."""
        if bool((table_lens * self.block_size < seq_lens).any()):
            raise ValueError("a block table is shorter than its sequence")
        used = _flatten((c.block_table for c in chunks), int(table_lens.sum()))
        num_blocks = self.pool.shape[0]
        if int(used.min()) < 0 or int(used.max()) >= num_blocks:
            raise ValueError(f"block ids must be in [0, {num_blocks})")
        tables.fill(0)
        tables[np.arange(tables.shape[1]) < table_lens[:, None]] = used

    def _check_slots(self, tables: np.ndarray, seq_of: np.ndarray, positions: np.ndarray,
                     slots: np.ndarray) -> None:
        """Each slot is -1 or the slot of its token's position in its table (so a runner whose
        tables went stale fails here)."""
        block, offset = np.divmod(positions, self.block_size)
        expected = tables[seq_of, block] * np.int64(self.block_size) + offset  # int64: no wrap
        if bool(((slots != expected) & (slots != -1)).any()):
            raise ValueError("a slot is neither -1 nor its token's slot in the block table")


# A PackedBuffer's arrays: (name, dtype, shape) each.
Fields = tuple[tuple[str, type[np.integer], tuple[int, ...]], ...]


class PackedBuffer:
    """Host arrays laid out back to back (each 16-byte aligned) in one byte buffer, so that they
    cross to a device in one copy and arrive as views of one device tensor.

        buffer = PackedBuffer((("ids", np.int64, (T,)), ("tables", np.int32, (S, W))))
        buffer.host["ids"][:] = ...                    # fill the numpy views
        on_device = buffer.to(device)                  # {"ids": tensor, "tables": tensor}
    """

    ALIGN = 16  # bytes: every array starts at a multiple (int64 views, vectorized loads)

    def __init__(self, fields: Fields) -> None:
        # name -> (dtype, its elements' span in the buffer viewed as dtype, shape)
        self.layout, end = _layout(fields, self.ALIGN)
        self.bytes = np.empty(end, np.uint8)
        # The numpy view of each array, to fill on the host.
        typed = {dtype: self.bytes.view(dtype) for dtype, _, _ in self.layout.values()}
        self.host = {name: _shaped(typed[dtype][span], shape)
                     for name, (dtype, span, shape) in self.layout.items()}

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every array as a view of ONE copy of the buffer on `device`; on the CPU the host
        arrays themselves, no copy (torch.from_numpy: no aten op per view)."""
        if device.type == "cpu":
            return {name: torch.from_numpy(array) for name, array in self.host.items()}
        packed = torch.from_numpy(self.bytes).to(device)
        typed = {dtype: packed.view(_TORCH_DTYPES[dtype]) for dtype, _, _ in self.layout.values()}
        return {name: _shaped(typed[dtype][span], shape)
                for name, (dtype, span, shape) in self.layout.items()}


# name -> (dtype, its elements' span in the buffer viewed as dtype, shape)
Layout = dict[str, tuple[np.dtype, slice, tuple[int, ...]]]


@functools.lru_cache(maxsize=64)
def _layout(fields: Fields, align: int) -> tuple[Layout, int]:
    """Where each field lies in a PackedBuffer, and the buffer's bytes: one computation per
    batch shape (decode steps repeat a few), not per step. Callers only read the dict."""
    layout: Layout = {}
    end = 0
    for name, dtype, shape in fields:
        itemsize, size = np.dtype(dtype).itemsize, math.prod(shape)
        layout[name] = (np.dtype(dtype), slice(end // itemsize, end // itemsize + size), shape)
        end += ceil_div(itemsize * size, align) * align
    return layout, end


@functools.lru_cache(maxsize=64)
def _step_fields(num_tokens: int, num_seqs: int, width: int, decode: bool) -> Fields:
    """The arrays of a step of `num_seqs` sequences bringing `num_tokens` tokens, with tables
    `width` blocks wide: built once per batch shape, not per step. input_ids and positions are
    the model's [1, T] rows as they are; a decode step keeps every row, so it has no `last`."""
    last = () if decode else (("last", np.int64, (num_seqs,)),)
    return (("input_ids", np.int64, (1, num_tokens)), ("positions", np.int64, (1, num_tokens)),
            ("slots", np.int64, (num_tokens,)), *last, ("tables", np.int32, (num_seqs, width)),
            ("seq_lens", np.int32, (num_seqs,)), ("query_start_loc", np.int32, (num_seqs + 1,)))


ArrayOrTensor = TypeVar("ArrayOrTensor", np.ndarray, torch.Tensor)


def _shaped(flat: ArrayOrTensor, shape: tuple[int, ...]) -> ArrayOrTensor:
    """A flat view in `shape`; the view itself when it is 1-D (no reshape op)."""
    return flat if len(shape) == 1 else flat.reshape(shape)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def _flatten(rows: Iterable[Iterable[int]], count: int) -> np.ndarray:
    """The rows' ints back to back, int64 [count]."""
    return np.fromiter(itertools.chain.from_iterable(rows), np.int64, count)


def _check_chunks(chunks: Sequence[SequenceChunk]) -> None:
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    for chunk in chunks:
        if not chunk.token_ids or chunk.start < 0:
            raise ValueError(f"a chunk needs tokens and a start >= 0, got "
                             f"{len(chunk.token_ids)} tokens from {chunk.start}")
        if len(chunk.slot_mapping) != len(chunk.token_ids):
            raise ValueError(f"a chunk of {len(chunk.token_ids)} tokens has "
                             f"{len(chunk.slot_mapping)} slots")
