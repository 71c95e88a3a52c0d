"""How one sequence picks its next token: the parameters a client sends with each step.

Torch-free (it lives in the client); the runner's `model_runner/engine/sampling.py` applies
them, in the order its module docstring gives. Names and "off" values follow vLLM's
`SamplingParams`, so a request written for vLLM reads the same here.

The request-level fields (`n`, `best_of`, beam search) are the client scheduler's
(`pagedkv.client.engine.engine`): the runner sees one SamplingParams per sequence and ignores them.
`ignore_eos` is the client's as well: the engine leaves the model's end-of-sequence ids out of the
stop ids it sends the runner. `min_tokens` and `structured_outputs` travel to the runner, which
masks the logits (stop tokens before min_tokens; what the constraint forbids).
"""

from dataclasses import dataclass
from typing import Literal

from pagedkv.client.pool.checks import check_float, check_int, token_ids
from pagedkv.client.pool.structured_outputs import StructuredOutputs

# Temperatures below this are greedy, as in vLLM (`_SAMPLING_EPS`): dividing logits by a
# near-zero temperature overflows to inf, and the limit of sampling is the argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
# `seed` is a 64-bit unsigned integer (a uint64 field on the wire).
MAX_SEED = 2**64 - 1
# presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's and
# vLLM's range).
MAX_PENALTY = 2.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One sequence's sampling parameters; validated on construction (ValueError)."""

    # Softmax temperature, >= 0; 0 (or below GREEDY_TEMPERATURE_EPS) = greedy: the argmax of the
    # penalized logits, and top_k, top_p, min_p and seed are then irrelevant.
    temperature: float = 1.0
    # Keep the k most likely tokens (all tokens tied with the k-th are kept); 0 or -1 = off.
    top_k: int = 0
    # Keep the smallest set of most likely tokens whose probability reaches top_p (plus any token
    # tied with the least likely one kept), measured after top_k; in (0, 1]; 1.0 = off.
    top_p: float = 1.0
    # Keep tokens whose probability is at least min_p times the most likely token's; in [0, 1];
    # 0 = off.
    min_p: float = 0.0
    # transformers' repetition penalty: a token already in the prompt or the output has its logit
    # divided by the penalty if positive, multiplied if negative (once, however often it
    # occurred); > 0; 1.0 = off; > 1 discourages repetition, < 1 encourages it.
    repetition_penalty: float = 1.0
    # OpenAI's and vLLM's presence penalty: subtracted once from the logit of every token the
    # sequence generated (its output only, not the prompt); in [-2, 2]; 0 = off; > 0
    # discourages repeating a token, < 0 encourages it. vLLM's order: the repetition penalty,
    # then frequency and presence, all on the raw logits before temperature.
    presence_penalty: float = 0.0
    # OpenAI's and vLLM's frequency penalty: subtracted from a token's logit once per time the
    # sequence generated it (output only): logit -= frequency_penalty * count
    # + presence_penalty * (count > 0); in [-2, 2]; 0 = off.
    frequency_penalty: float = 0.0
    # Makes sampling reproducible: the randomness of a step depends only on (seed, number of
    # tokens generated so far), not on the batch; in [0, 2**64); None = not reproducible.
    seed: int | None = None
    # Token ids that finish the sequence when sampled (the stop token is part of the output).
    stop_token_ids: tuple[int, ...] = ()
    # Most tokens to generate, >= 1 (vLLM's default is 16 as well).
    max_tokens: int = 16
    # None = no logprobs; k >= 0 = the sampled token's logprob plus the k most likely tokens'
    # logprobs (k = 0: the sampled token's only). Logprobs are of the raw model distribution.
    logprobs: int | None = None
    # Outputs returned per request (parallel samples, or the best beams), >= 1.
    n: int = 1
    # Samples generated per request, of which the n with the highest cumulative logprob are
    # returned; None = n. The prompt is computed once and forked.
    best_of: int | None = None
    # Beam search with this many beams (0 = off): the rules of transformers'
    # `generate(num_beams=beam_width, do_sample=False)`; needs temperature 0 and n <= beam_width.
    beam_width: int = 0
    # Beam search: a hypothesis scores sum(logprobs) / generated_length ** length_penalty.
    length_penalty: float = 1.0
    # Beam search: True stops once beam_width hypotheses are finished; False stops when no
    # running beam can still beat them (transformers' heuristic); "never" checks exactly.
    early_stopping: bool | Literal["never"] = False
    # vLLM's ignore_eos: the model's end-of-sequence ids do not finish the sequence (benchmarks
    # use it so every request runs to max_tokens); max_tokens and stop_token_ids still do.
    ignore_eos: bool = False
    # vLLM's min_tokens: until the sequence generated this many tokens, its stop tokens (the
    # request's and the model's end-of-sequence ids) cannot be sampled; 0 = off; <= max_tokens.
    min_tokens: int = 0
    # What the output must match (JSON schema, regex, choice, grammar); None = free text.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 to turn it off, got {self.top_k}")
        check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name, penalty in (("presence_penalty", self.presence_penalty),
                              ("frequency_penalty", self.frequency_penalty)):
            check_float(name, penalty)
            if not -MAX_PENALTY <= penalty <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {penalty}")
        if self.seed is not None:
            check_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**64) or None, got {self.seed}")
        object.__setattr__(self, "stop_token_ids", token_ids("stop_token_ids",
                                                             self.stop_token_ids))
        check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if (self.structured_outputs is not None
                and not isinstance(self.structured_outputs, StructuredOutputs)):
            raise ValueError("structured_outputs must be a StructuredOutputs or None")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(
                    f"logprobs must be >= 0 (number of top logprobs) or None, got {self.logprobs}")
        self._check_request_fields()

    def _check_request_fields(self) -> None:
        check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None:
            check_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        check_int("beam_width", self.beam_width)
        if self.beam_width < 0:
            raise ValueError(f"beam_width must be >= 1, or 0 for no beam search, got "
                             f"{self.beam_width}")
        check_float("length_penalty", self.length_penalty)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got "
                             f"{self.early_stopping!r}")
        if self.beam_width:
            if not self.is_greedy:
                raise ValueError("beam search needs temperature=0 (transformers' do_sample=False)"
                                 f", got temperature={self.temperature}")
            if self.n > self.beam_width or self.best_of is not None:
                raise ValueError(f"beam search returns n <= beam_width ({self.beam_width}) beams"
                                 f" and takes no best_of, got n={self.n}, best_of={self.best_of}")
            # The beams grow from the raw top logprobs, which no mask touches (sampling.py).
            if self.structured_outputs is not None or self.min_tokens:
                raise ValueError("beam search takes no structured_outputs and no min_tokens: "
                                 "its beams are chosen from the raw logprobs, which neither "
                                 "constrains")

    @property
    def num_samples(self) -> int:
        """Sequences sampled per request without beam search: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax (temperature 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def is_stop(self, token_id: int) -> bool:
        """Whether sampling `token_id` finishes the sequence (max_tokens aside)."""
        return token_id in self.stop_token_ids

