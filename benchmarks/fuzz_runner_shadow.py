"""The runner fuzzer's shadow: the served model rebuilt in the fuzzer's process, judging every
token an honest client is given against a private recomputation of that client's own sequence.

    reference = Reference("tiny-llama")             # a preset or a config.json, as the runner's
    wrong = reference.judge(tokens, token_id, logprob)   # None, or why the token is wrong

The runner random-initializes its model from the same source with seed 0 (`load_model`), so the
reference is the identical model; a greedy step must pick the reference's most likely next token
for exactly the tokens the honest client holds, and report its raw logprob. Nothing the runner,
the daemon or another client holds is consulted: K/V another tenant wrote into a shared block,
or a block certified without being computed, shows up as a wrong token or logprob.

Two float32 implementations (the runner's paged attention, transformers' eager attention) differ
by ~1e-5 in a logprob: a token within TIE_LOGPROB of the best counts as a tie, not a wrong token
(counted apart), and a logprob must agree within LOGPROB_TOLERANCE.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.model_runner.models import ModelSource, load_model

# Tokens whose reference logprob is this close to the best one's are equally greedy.
TIE_LOGPROB = 1e-3
# Largest difference allowed between the runner's logprob and the reference's.
LOGPROB_TOLERANCE = 1e-3
# Distributions remembered (sequences sharing a prefix, forks, repeated prompts).
MEMO_SIZE = 4096


@dataclass(frozen=True, slots=True)
class Verdict:
    """How one sampled token compares with the reference."""

    # Why the token is wrong ("" when it is right).
    wrong: str
    # The runner's token differs from the reference's best but is within TIE_LOGPROB of it.
    tie: bool


class Reference:
    """The served model in this process: log-probabilities of the next token of a sequence."""

    def __init__(self, model: str) -> None:
        # The same source and seed as the runner's `--random-init` (in eval mode).
        self.model = load_model(ModelSource(random_init=model, seed=0))
        self.model.set_attn_implementation("eager")
        self.vocab_size: int = self.model.config.vocab_size
        self.max_model_len: int = self.model.config.max_position_embeddings
        # tuple(tokens) -> log_softmax of the next token's logits: [vocab] fp32.
        self._memo: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        # Forwards run (memo misses), for the report.
        self.forwards = 0

    def next_logprobs(self, tokens: Sequence[int]) -> torch.Tensor:
        """log p(next token | tokens) under the reference: [vocab] fp32."""
        key = tuple(tokens)
        row = self._memo.get(key)
        if row is not None:
            self._memo.move_to_end(key)
            return row
        with torch.no_grad():
            logits = self.model(torch.tensor([key])).logits[0, -1].float()
        row = torch.log_softmax(logits, dim=-1)
        self.forwards += 1
        self._memo[key] = row
        if len(self._memo) > MEMO_SIZE:
            self._memo.popitem(last=False)
        return row

    def judge(self, tokens: Sequence[int], token_id: int, logprob: float) -> Verdict:
        """The runner sampled `token_id` (raw logprob `logprob`) greedily after `tokens`."""
        row = self.next_logprobs(tokens)
        best = int(row.argmax())
        if not 0 <= token_id < self.vocab_size:
            return Verdict(f"token {token_id} is outside the vocabulary", False)
        gap = float(row[best] - row[token_id])
        if gap > TIE_LOGPROB:
            return Verdict(f"token {token_id} (logprob {float(row[token_id]):.4f}) where the "
                           f"reference picks {best} (logprob {float(row[best]):.4f})", False)
        expected = float(row[token_id])
        if abs(logprob - expected) > LOGPROB_TOLERANCE:
            return Verdict(f"token {token_id} with logprob {logprob:.4f}, the reference's "
                           f"{expected:.4f}", False)
        return Verdict("", token_id != best)
