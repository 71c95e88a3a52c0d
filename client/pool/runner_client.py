"""A typed async client of the runner (`pagedkv.v1.Runner`): one RPC per client step, or, made
with `stream_steps=True` (as the engine's is), each session's steps on one long-lived stream
(`RunnerStream`, runner_stream.py).

    target = "unix:///run/pagedkv-runner/pagedkv-runner.sock"   # the shipped unit's socket
    async with await RunnerClient.connect(target) as runner:
        out = await runner.step(session, [SeqStep(1, prompt, new_sequence=True, params=greedy)])
        out = await runner.step(session, [SeqStep(1, [out[0].token_id])])  # the runner kept params

The session is the client's own KVPool session (`PoolClient.open_session`): the runner performs
the step's memory operations with it, so the sequences stay the client's. Errors are the same
`PagedKVError` classes as the daemon's.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import grpc

from pagedkv.client.pool.channel import ChannelOwner, open_channel
from pagedkv.client.pool.client import DEFAULT_TIMEOUT_S
from pagedkv.client.pool.errors import RunnerUnreachable, error_from_rpc
from pagedkv.client.pool.runner_stream import RunnerStream, StepStreamCall
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.client.pool.session import Session
from pagedkv.client.pool.step_outputs import StepOutputs
from pagedkv.client.pool.structured_outputs import StructuredOutputs
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc


@dataclass(frozen=True, slots=True)
class History:
    """What a sequence holds, sent to a runner that does not know it (it restarted; see
    runner.proto's SequenceHistory)."""

    # Every token the sequence holds in the daemon.
    token_ids: Sequence[int]
    # How many are the prompt.
    prompt_len: int
    # How many leading tokens have their K/V written, per the client: the runner never believes
    # it (it computes from the daemon's committed count), only checks it is in range.
    num_computed: int


@dataclass(frozen=True, slots=True)
class SeqStep:
    """One sequence of a step (see runner.proto's SequenceStep): the one record on both sides
    of the wire, built by the client and, from the message, by the runner's servicer."""

    # The sequence's id in the client's session.
    seq_id: int
    # The prompt (new_sequence), or tokens to append (a decode token, more prompt), or empty.
    token_ids: Sequence[int]
    # Whether the runner allocates it (a new prompt).
    new_sequence: bool = False
    # Most tokens to compute now (chunked prefill); 0 = all.
    max_compute_tokens: int = 0
    # How to sample its next token: sent with the sequence's first step (and with a history),
    # kept by the runner; None = the kept one.
    params: SamplingParams | None = None
    # The parent of a sequence the client just forked (first step only).
    parent_seq_id: int | None = None
    # For the first step after a runner restart: what the sequence holds.
    history: History | None = None
    # A new sequence without a parent: how many leading token_ids are the prompt (the rest were
    # generated before a preemption); 0 = all.
    num_prompt_tokens: int = 0
    # The next step of this sequence appends exactly the token this one samples (or releases
    # it): the runner may compute that step ahead, while the answer travels.
    decode_ahead: bool = False
    # A new sequence without a parent: recompute its prefix rather than restore it from the
    # daemon's host tier (AllocateRequest.skip_host_tier); the runner ignores it elsewhere.
    skip_host_tier: bool = False
    # The id of the client's request the sequence serves, sent as `params` is (its first
    # step, a resend): the runner and the daemon keep it and log it; "" = none (the kept one).
    request_id: str = ""

    def message(self) -> rpb.SequenceStep:
        step = rpb.SequenceStep(
            seq_id=self.seq_id, new_sequence=self.new_sequence, token_ids=self.token_ids,
            max_compute_tokens=self.max_compute_tokens,
            has_parent=self.parent_seq_id is not None, parent_seq_id=self.parent_seq_id or 0,
            num_prompt_tokens=self.num_prompt_tokens, decode_ahead=self.decode_ahead,
            skip_host_tier=self.skip_host_tier, request_id=self.request_id)
        p = self.params
        if p is not None:
            step.sampling.CopyFrom(rpb.SamplingParams(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, has_seed=p.seed is not None,
                seed=p.seed or 0, logprobs=-1 if p.logprobs is None else p.logprobs,
                stop_token_ids=p.stop_token_ids, max_tokens=p.max_tokens,
                min_tokens=p.min_tokens))
            if p.structured_outputs is not None:
                step.sampling.structured_outputs.CopyFrom(
                    structured_message(p.structured_outputs))
        h = self.history
        if h is not None:
            step.history.CopyFrom(rpb.SequenceHistory(token_ids=h.token_ids,
                                                      prompt_len=h.prompt_len,
                                                      num_computed=h.num_computed))
        return step


def structured_message(constraint: StructuredOutputs) -> rpb.StructuredOutputs:
    """`constraint` as runner.proto's StructuredOutputs (its one field set)."""
    if constraint.choice is not None:
        return rpb.StructuredOutputs(choice=rpb.Choices(choices=constraint.choice))
    if constraint.json is not None:
        return rpb.StructuredOutputs(json_schema=constraint.json)
    if constraint.regex is not None:
        return rpb.StructuredOutputs(regex=constraint.regex)
    if constraint.grammar is not None:
        return rpb.StructuredOutputs(grammar=constraint.grammar)
    return rpb.StructuredOutputs(json_object=True)


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """What a runner computes, and on which pool (see runner.proto's RunnerInfo)."""

    # The model's name, vocabulary and geometry.
    model: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # End-of-sequence token ids of the model's generation config (may be empty).
    eos_token_ids: tuple[int, ...]
    # The daemon pool the runner computes on, and its tokens per block.
    pool_id: str
    block_size: int
    # "triton", "cpu" or "torch": the attention kernels in use.
    attention_backend: str
    # The most tokens a sequence may hold.
    max_model_len: int
    # Drawn when the runner process starts: another id after a failed step means a restart.
    runner_id: str
    # The name it registered its model under with the daemon: its clients' sessions must name
    # it (PoolClient.open_session(model=...)), else the runner refuses their steps.
    model_name: str = ""

    @classmethod
    def from_proto(cls, m: rpb.RunnerInfo) -> "RunnerInfo":
        return cls(m.model, m.vocab_size, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype,
                   tuple(m.eos_token_ids), m.pool_id, m.block_size, m.attention_backend,
                   m.max_model_len, m.runner_id, m.model_name)


class RunnerClient(ChannelOwner):
    """One channel to a runner. Create with `await RunnerClient.connect(target)`."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float,
                 stream_steps: bool = False) -> None:
        self._channel = channel
        # The generated stub: private, callers use the typed methods.
        self._stub = runner_pb2_grpc.RunnerStub(channel)
        # Deadline of every call (of every step's answer on a stream), in seconds (a long CPU
        # prefill needs a generous one).
        self.timeout = timeout
        # Each session's step stream by session id, when steps go on streams (else None): one
        # per session stepped, open until the channel closes (each is one of the runner's
        # max_concurrent_rpcs).
        self.streams: dict[str, RunnerStream] | None = {} if stream_steps else None

    @classmethod
    async def connect(cls, target: str, *, timeout: float = 10 * DEFAULT_TIMEOUT_S,
                      stream_steps: bool = False) -> Self:
        """A client of the runner at `target`; `stream_steps`: send each session's steps on
        one Runner.StepStream instead of a Step call each."""
        # The runner's answers stay within max_answer_bytes (at most MAX_MESSAGE_BYTES).
        return cls(await open_channel(target, "runner", RunnerUnreachable, DEFAULT_TIMEOUT_S),
                   timeout, stream_steps)

    async def info(self, timeout: float | None = None) -> RunnerInfo:
        """What the runner computes and on which pool (`timeout`: this call's deadline instead
        of the client's)."""
        try:
            reply = await self._stub.GetRunnerInfo(rpb.GetRunnerInfoRequest(),
                                                   timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, RunnerUnreachable) from None
        return RunnerInfo.from_proto(reply)

    async def step(self, session: Session, seqs: Sequence[SeqStep],
                   release: Sequence[int] = (), *, follow: bool = False) -> StepOutputs:
        """Compute one step of the session's sequences; free `release` after it; `follow`:
        then step the session's decode_ahead sequences and push each answer (runner.proto's
        Following; `next_push`, `take_push`), on a client made with `stream_steps`."""
        request = rpb.RunnerStepRequest(session_id=session.session_id,
                                        seqs=[seq.message() for seq in seqs],
                                        release_seq_ids=release)
        if follow or self.streams is not None:
            reply = await self._stream(session, "follow").step(request, self.timeout,
                                                               follow=follow)
        else:
            try:
                reply = await self._stub.Step(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                raise error_from_rpc(exc, RunnerUnreachable) from None
        return StepOutputs.from_message(reply)

    async def next_push(self, session: Session, timeout: float | None = None) -> StepOutputs:
        """The session's next pushed answer, within `timeout` seconds (the client's by
        default); its errors are RunnerStream.next_push's."""
        stream = self._stream(session, "next_push")
        push = await stream.next_push(self.timeout if timeout is None else timeout)
        return StepOutputs.from_message(push)

    def take_push(self, session: Session) -> StepOutputs | None:
        """The session's next queued pushed answer, None if none is queued (RunnerStream's)."""
        reply = self._stream(session, "take_push").take_push()
        return None if reply is None else StepOutputs.from_message(reply)

    async def close(self) -> None:
        """End every session's stream (a step in flight fails as cancelled), then the channel."""
        for stream in (self.streams or {}).values():
            await stream.close()
        await super().close()

    def _stream(self, session: Session, use: str) -> RunnerStream:
        """The session's step stream client (its call opens at its first step); `use` names
        what needs it, in the ValueError of a client without streams."""
        if self.streams is None:
            raise ValueError(f"{use} needs a RunnerClient made with stream_steps=True "
                             "(pushed answers come on a step stream)")
        stream = self.streams.get(session.session_id)
        if stream is None:
            stream = self.streams[session.session_id] = RunnerStream(self._open_stream)
        return stream

    def _open_stream(self) -> StepStreamCall:
        """A new Runner.StepStream call, with no deadline of its own (it lives as long as its
        session's steps; each answer is awaited for `timeout`), its messages written on it."""
        return self._stub.StepStream(None)
