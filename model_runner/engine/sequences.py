"""What the runner knows of its clients' sequences, learned from the daemon and never from a client.

A client names its sequences by id and sends tokens; where their K/V lives (block tables, slots)
comes only from the daemon's answers to calls the runner makes under the client's session. The
runner keeps, per (session, sequence), the tokens the sequence holds, how many of them are
computed and how many the daemon holds, and its block table, so a decode step needs no table
transfer, and a daemon Step only once a block (reservations.py); and its sampling parameters,
which the client sends once, with the sequence's first step.
A sequence the runner does not know (forked by the client, or after a runner restart) is read
back from the daemon (`GetBlockTables`, with the token ids it holds) before it is used: what a
client says it holds must be those ids, and only the daemon's committed tokens count as
computed.
"""

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from xgrammar import CompiledGrammar

from pagedkv.client import (
    Commit,
    PoolClient,
    SamplingParams,
    SeqOutput,
    SeqStep,
    Session,
    StructuredOutputs,
)
from pagedkv.model_runner.engine.grammar import GrammarState
from pagedkv.model_runner.engine.steps import InvalidStep, UnknownSequence
from pagedkv.vocab.blocks import patch_table, slots_of


@dataclass
class Ahead:
    """A step the runner took for a sequence before its client asked (runner.proto's
    decode_ahead): the sampled token appended in the daemon, then its forward."""

    # The token appended: what the client's last answer sampled, so its next step names it.
    token_id: int
    # That step's result (sampled with the sequence's kept SeqState.params), once its forward
    # is done (None if it has not run or failed).
    result: SeqOutput | None = None


# Set to "1", the step engine checks every sequence of a session (SessionSequences.check) each
# time a step, an ahead step or a decode run lets go of the session's lock; the tests set it (and
# the runners they start inherit it). Unset or "0": no check (a debug aid, off the hot path).
CHECK_ENV = "PAGEDKV_CHECK_SEQUENCES"


def checking(env: Mapping[str, str]) -> bool:
    """Whether CHECK_ENV asks for the checks; ValueError for a value other than "", "0", "1"."""
    value = env.get(CHECK_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{CHECK_ENV} must be 0 or 1, not {value!r}")
    return value == "1"


# SeqState's invariants, true whenever no step of its session is under way (the session's lock
# is free: StepEngine checks them there while CHECK_ENV is set, as the tests set it). Each is a
# name, and a test of one sequence's state `s` in a pool of blocks of `bs` slots.
INVARIANTS: tuple[tuple[str, Callable[["SeqState", int], bool]], ...] = (
    # The prompt is a prefix of the tokens.
    ("0 <= prompt_len <= len(tokens)", lambda s, bs: 0 <= s.prompt_len <= len(s.tokens)),
    # The daemon holds a prefix of the tokens, and committed blocks only of what it holds.
    ("0 <= committed <= held <= len(tokens)",
     lambda s, bs: 0 <= s.committed <= s.held <= len(s.tokens)),
    # What is computed is a prefix of the tokens, at least what the prefix cache and the
    # committed blocks served: the runner never recomputes shared K/V.
    ("num_cached <= num_computed and committed <= num_computed <= len(tokens)",
     lambda s, bs: s.num_cached <= s.num_computed and s.committed <= s.num_computed
     <= len(s.tokens)),
    # A reservation starts past the tokens the daemon holds and ends inside the block table.
    ("private_end == 0 or held <= private_end <= len(block_table) * bs",
     lambda s, bs: s.private_end == 0 or s.held <= s.private_end <= len(s.block_table) * bs),
    # Tokens the daemon does not hold were decoded into reserved slots, never past them.
    ("len(tokens) <= max(held, private_end)",
     lambda s, bs: len(s.tokens) <= max(s.held, s.private_end)),
    # The block table has a slot for every token (so for every held one).
    ("len(tokens) <= len(block_table) * bs",
     lambda s, bs: len(s.tokens) <= len(s.block_table) * bs),
    # A token appended ahead is the last token; its result, once there, is of a computed one.
    ("ahead is None or ahead.token_id == tokens[-1]",
     lambda s, bs: s.ahead is None or (bool(s.tokens) and s.ahead.token_id == s.tokens[-1])),
    ("ahead.result is None or num_computed == len(tokens)",
     lambda s, bs: s.ahead is None or s.ahead.result is None or s.num_computed == len(s.tokens)),
    # A commit due certifies computed K/V of ids the daemon holds, whole blocks' worth at least.
    ("commit_due == 0 or (verified and bs <= commit_due <= min(num_computed, held))",
     lambda s, bs: s.commit_due == 0
     or (s.verified and bs <= s.commit_due <= min(s.num_computed, s.held))),
    # A matcher is that of the kept sampling's constraint.
    ("grammar is None or grammar.constraint == params.structured_outputs",
     lambda s, bs: s.grammar is None
     or (s.params is not None and s.grammar.constraint == s.params.structured_outputs)),
)


@dataclass
class SeqState:
    """One client sequence as the runner knows it (its invariants: INVARIANTS)."""

    # Every token the sequence holds as the runner and its client see it (prompt, then
    # generated); the daemon holds the first `held` of them (reservations.py).
    tokens: list[int]
    # Prompt length: tokens after it are generated (repetition penalty, per-step seeds).
    prompt_len: int
    # Leading tokens whose K/V is written in the pool.
    num_computed: int
    # Logical block i -> physical block, from the daemon's answers.
    block_table: list[int]
    # Leading tokens the prefix cache served when the sequence was allocated.
    num_cached: int = 0
    # Leading tokens in committed blocks when the runner learnt the sequence from the daemon
    # (shared K/V others read): no forward may write a slot below it.
    committed: int = 0
    # Whether `tokens` are known to be the ids the daemon holds (the runner sent them, or
    # checked a client's history against the daemon's): the runner commits only such a
    # sequence, else it would certify K/V of tokens that are not the blocks' keys.
    verified: bool = True
    # The runner appended a token ahead of the client (the last token of `tokens`), until the
    # client's next step names it.
    ahead: Ahead | None = None
    # Leading tokens a prefill computed whose commit is not sent yet (0: none): it rides the
    # session's next daemon Step or Batch, or the end of the runner's hold (holds.py).
    commit_due: int = 0
    # How to sample its next token, as the client sent it on the sequence's first step (or
    # last changed it), kept so that later steps need not send it; None until a step that
    # sent it was prepared (a sequence learnt by a step that then failed).
    params: SamplingParams | None = None
    # The id of the client's request it serves (SequenceStep.request_id, sent as params is;
    # a fork's child inherits its parent's): what the runner's lines about it name. "" = none.
    request_id: str = ""
    # The matcher of its structured output (params.structured_outputs; None without one),
    # touched only on the forward thread (grammar.py).
    grammar: GrammarState | None = None
    # Slots below it, past the tokens the daemon holds, are reserved for the sequence alone
    # (a Step's reserve_tokens): the runner writes decode tokens there with no daemon call
    # (reservations.py). 0: no reservation the runner may write into.
    private_end: int = 0
    # Leading tokens the daemon holds (appended, by id, in the runner's calls): the rest were
    # decoded into reserved slots and are certified by a later call. Starts at len(tokens).
    held: int = field(init=False)

    def __post_init__(self) -> None:
        self.held = len(self.tokens)

    def check(self, seq_id: int, block_size: int) -> None:
        """AssertionError naming the first of INVARIANTS that `self` breaks, and its values."""
        for name, holds in INVARIANTS:
            if not holds(self, block_size):
                raise AssertionError(
                    f"sequence {seq_id} breaks {name}: tokens={len(self.tokens)} "
                    f"prompt_len={self.prompt_len} held={self.held} committed={self.committed} "
                    f"num_cached={self.num_cached} num_computed={self.num_computed} "
                    f"private_end={self.private_end} blocks={len(self.block_table)} "
                    f"block_size={block_size} commit_due={self.commit_due} "
                    f"verified={self.verified} ahead={self.ahead}")

    def claim_ahead(self) -> SeqOutput | None:
        """A step takes the token appended ahead (`ahead`) as its own: the result computed for
        it, if its forward ran (else that step computes it)."""
        assert self.ahead is not None, "only a token appended ahead is claimed"
        result, self.ahead = self.ahead.result, None
        return result

    @property
    def uncertified(self) -> list[int]:
        """The tokens the daemon does not hold yet (decoded into reserved slots)."""
        return self.tokens[self.held:]

    def slots(self, start: int, end: int, block_size: int) -> list[int]:
        """Pool slots of positions [start, end), from the block table."""
        return slots_of(self.block_table, start, end, block_size)

    def patch(self, logical: int, block: int) -> None:
        """A block-table entry a daemon Step changed: a new last block or a copy-on-write copy."""
        patch_table(self.block_table, logical, block)


@dataclass
class SessionSequences:
    """The sequences of one client session the runner has seen, and its hold on them."""

    # seq_id -> state.
    seqs: dict[int, SeqState] = field(default_factory=dict)
    # When the runner last asked the daemon to hold the session (kvpool.proto's "Runner holds":
    # no client frees its blocks until then + hold_ms), monotonic seconds taken before the
    # call; -inf: no hold asked, or the hold ended.
    held_at: float = -math.inf
    # Whether a call asking the daemon to hold the session was sent since the hold last ended,
    # answered or not (a call cut short by a deadline may have been applied): the runner ends
    # that hold itself, since the daemon stops a live runner whose hold lapses when someone
    # needs the session's blocks (kvpool.proto, "Runner holds").
    may_hold: bool = False
    # The runner's handle on the client's session in the daemon (`attach`): every daemon call
    # about the session goes through it, and a lost answer is read back from the lengths it saw.
    handle: Session | None = None
    # Steps of the session the runner has begun (the client's and its own ahead): an idle
    # session's hold ends only if none began meanwhile (holds.py).
    stepped: int = 0

    def asking_hold(self) -> float:
        """A call asking the daemon to hold the session goes now: from here on the session may
        be held until the runner ends the hold. The send time, for `held_at` once answered."""
        self.may_hold = True
        return time.monotonic()

    def hold_ended(self) -> None:
        """The daemon answered a call that ended the runner's hold: nothing holds the session."""
        self.held_at, self.may_hold = -math.inf, False

    def attach(self, pool: PoolClient, session_id: str, block_size: int) -> Session:
        """The handle on the session, made at its first step."""
        if self.handle is None:
            self.handle = pool.attach(session_id, block_size)
        return self.handle

    @property
    def session(self) -> Session:
        """The handle, which the session's first step made before any daemon call."""
        assert self.handle is not None, "a step attaches the session before its daemon calls"
        return self.handle

    def due(self, skip: Sequence[int] = ()) -> Commit | None:
        """The commits due (SeqState.commit_due) as one Commit op, but those of `skip`; None
        if there are none."""
        due = [(seq_id, state.commit_due) for seq_id, state in self.seqs.items()
               if state.commit_due and seq_id not in skip]
        return Commit([seq_id for seq_id, _ in due], [n for _, n in due]) if due else None

    def clear_due(self, seq_ids: Sequence[int]) -> None:
        """No commit of these sequences is due any more (one was applied, or it was dropped)."""
        for seq_id in seq_ids:
            if (state := self.seqs.get(seq_id)) is not None:
                state.commit_due = 0

    def check(self, block_size: int) -> None:
        """Every sequence's SeqState.check."""
        for seq_id, state in self.seqs.items():
            state.check(seq_id, block_size)

    def get(self, seq_id: int) -> SeqState | None:
        return self.seqs.get(seq_id)

    def known(self, seq_id: int) -> SeqState:
        """The sequence's state; InvalidStep if the runner does not know it."""
        state = self.seqs.get(seq_id)
        if state is None:
            raise InvalidStep(f"sequence {seq_id} is not known to the runner: send it as a new "
                              "sequence, or name its parent on a fork's first step")
        return state

    def put(self, seq_id: int, state: SeqState) -> None:
        self.seqs[seq_id] = state

    def drop(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)

    def stale(self, seq_id: int) -> NoReturn:
        """The daemon's answer disagrees with the runner's view of a sequence: the client
        changed it directly in the daemon. Forget it rather than compute on a stale table."""
        self.drop([seq_id])
        raise UnknownSequence(f"sequence {seq_id} changed in the daemon behind the runner (freed "
                              "or re-created directly): resend it with its history")

    def with_params(self, requests: Sequence[SeqStep]) -> list[SeqStep]:
        """`requests`, each with the sampling it sends, else the one kept for its sequence.
        UnknownSequence naming the first known sequence whose sampling the runner does not keep
        (learnt by a step that then failed): the client resends it with its history and
        sampling. A sequence the runner does not know is left as it is: the preparer asks the
        daemon first (another session's sequence is NOT_FOUND) and refuses it without its
        history and sampling. Nothing changes here."""
        return [request if request.params is not None or request.seq_id not in self.seqs
                else dataclasses.replace(request, params=self._kept_params(request.seq_id))
                for request in requests]

    def keep_params(self, requests: Sequence[SeqStep], states: Sequence[SeqState],
                    compiled: Mapping[StructuredOutputs, CompiledGrammar]) -> None:
        """Keep each prepared sequence's sampling (`requests` as `with_params` gave them) and
        the request id it sent, for the steps that leave them out, and a matcher for its
        constraint (`compiled`: the grammars of the constraints the step sent): a matcher of the
        same constraint is kept."""
        for request, state in zip(requests, states, strict=True):
            state.params = request.params
            state.request_id = request.request_id or state.request_id
            constraint = request.params.structured_outputs if request.params else None
            if constraint is None:
                state.grammar = None
            elif state.grammar is None or state.grammar.constraint != constraint:
                state.grammar = GrammarState(constraint, compiled[constraint])

    def _kept_params(self, seq_id: int) -> SamplingParams:
        params = self.seqs[seq_id].params
        if params is None:
            raise UnknownSequence(f"sequence {seq_id}: the runner keeps no sampling for it: "
                                  "resend it with its history and sampling")
        return params
