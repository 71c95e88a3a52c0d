"""What the HTTP handlers generate with: the engine, the tokenizer, the served name, the limits.

    backend = Backend(engine, tokenizer, "my-model", "why there is no tokenizer", config)
    prompt_ids = backend.encode(prompt, "prompt")        # ApiError 400 naming the field
    async for outputs in backend.stream(prompt_ids, params):   # admitted, metrics kept
        ...

One `Engine` serves every HTTP request (one daemon session, continuous batching across them),
on the server's event loop. Admission is bounded: a request arriving while `max_waiting`
requests already wait for room in the pool is refused with 429 and Retry-After instead of
queueing without limit; a draining server refuses new requests with 503, and so does one whose
daemon or runner is down (`down`, kept by server/recovery.py), instead of queueing requests that
wait for nothing. A request that fails because the daemon or the runner went away gets a
retryable 503 too, one that can never fit the pool a 400 (errors.py maps the causes). A request
whose client goes away is aborted (its stream is closed), which frees its blocks.
"""

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace

from aiohttp import web

from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.client.pool.errors import PagedKVError
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.llm.tokenizer import Tokenizer
from pagedkv.server.errors import ApiError, bad_request, engine_status
from pagedkv.server.key_engines import API_KEY, ApiKey, Caller, KeyEngines
from pagedkv.server.metrics import ServerMetrics
from pagedkv.vocab.token_ids import check_vocabulary

# Seconds a refused client is told to wait (Retry-After) when the queue is full or we drain.
RETRY_AFTER_S = 1


def unavailable(reason: str) -> ApiError:
    """A 503 the client may retry after RETRY_AFTER_S: nothing of the request is kept."""
    return ApiError(503, f"{reason}: retry the request",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The server's own bounds (the pool's are the daemon's)."""

    # The name clients send as `model` (GET /v1/models lists it), and the server goes by.
    model_name: str
    # Requests waiting for room beyond which a new one gets 429 (0: no bound).
    max_waiting: int = 256
    # Most choices (prompts x n) one request computes.
    max_choices: int = 64
    # Most top logprobs per token.
    max_logprobs: int = 20
    # More names clients may send as `model` (repeated --served-model-name), listed after it.
    other_names: tuple[str, ...] = ()
    # The parser of tool_choice "auto" (--tool-call-parser, with --enable-auto-tool-choice);
    # None: "auto" is refused, as vLLM refuses it without them.
    auto_tool_parser: str | None = None

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the server answers to, model_name first."""
        return (self.model_name, *self.other_names)


class Backend:
    """The engine and the tokenizer, behind the server's admission rules."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, no_tokenizer: str,
                 config: ServeConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        # None for a preset (random weights, token ids only); `no_tokenizer` says why.
        self.tokenizer = tokenizer
        self.no_tokenizer = no_tokenizer
        self.config = config
        self.metrics = metrics
        # When the server started (Unix seconds): the `created` of the model it lists.
        self.started = int(time.time())
        # Set once SIGTERM arrived: new requests get 503, running streams finish.
        self.draining = False
        # Requests admitted and not yet finished (the drain waits for none to be left).
        self.active = 0
        # With API keys: each cache group's engine and the turns of their requests; None: every
        # request goes to `engine`, first in first out.
        self.key_engines: KeyEngines | None = None
        # Why no request can be served now (a child restarting, the engine reopening; None:
        # they can), kept by server/recovery.py: new requests get 503, /health says it.
        self.down: str | None = None

    def check_model(self, name: str) -> None:
        if name not in self.config.model_names:
            served = ", ".join(f"`{served}`" for served in self.config.model_names)
            raise ApiError(404, f"The model `{name}` does not exist: this server serves "
                                f"{served}", "model")

    def encode(self, prompt: str | Sequence[int], param: str) -> list[int]:
        """A prompt's token ids, checked against the vocabulary and the model's positions."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request(param, f"{param} is text, but {self.no_tokenizer}: send token "
                                         "ids")
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = list(prompt)
        self.check_prompt(token_ids, param)
        return token_ids

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request(param, f"{param} has no tokens")
        try:
            check_vocabulary(token_ids, self.engine.vocab_size, f"{param}:")
        except ValueError as exc:
            raise bad_request(param, str(exc)) from exc
        limit = self.engine.max_model_len
        if limit and len(token_ids) >= limit:
            raise bad_request(param, f"{param} has {len(token_ids)} tokens; the model takes at "
                                     f"most {limit} positions, prompt and completion together")

    def unhealthy(self) -> str | None:
        """Why the server cannot serve a request now (None: it can): /health's 503."""
        if self.draining:
            return "draining"
        return self.down or self.engine.failure()

    def admit(self) -> None:
        """Refuse a new request when draining or down (503), or when the queue is full (429)."""
        if self.draining:
            raise unavailable("the server is shutting down")
        if self.down is not None:
            raise unavailable(self.down)
        waiting = len(self.engine.scheduler.waiting)
        if self.config.max_waiting and waiting >= self.config.max_waiting:
            self.metrics.refused()
            raise ApiError(429, f"{waiting} requests are waiting for room in the KV pool (the "
                                f"server's bound is {self.config.max_waiting}): retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    async def caller(self, request: web.Request) -> Caller:
        """Whose request it is (the API key app.py matched) and the engine of its cache group;
        429 when its key has as many requests waiting as it may."""
        key = request.get(API_KEY)
        if self.key_engines is None or not isinstance(key, ApiKey):
            return Caller("", self.engine)
        return await self.key_engines.caller(key)

    def max_tokens_for(self, params: SamplingParams, prompt_len: int,
                       given: bool) -> SamplingParams:
        """`params` with max_tokens at most the positions the prompt leaves (an explicit
        max_tokens that does not fit is refused, as vLLM refuses it)."""
        limit = self.engine.max_model_len
        if not limit or prompt_len + params.max_tokens <= limit:
            return params
        if given:
            raise bad_request("max_tokens", f"max_tokens {params.max_tokens} + the prompt's "
                                            f"{prompt_len} tokens exceed the model's {limit} "
                                            "positions")
        return replace(params, max_tokens=limit - prompt_len)

    async def stream(self, prompt_ids: list[int], params: SamplingParams, every_step: bool,
                     caller: Caller, request_id: str) -> AsyncGenerator[RequestOutput]:
        """The request's outputs from the caller's engine: each step's new tokens when
        `every_step` (delta outputs), else the final output with every token (so each output
        carries only tokens not seen before, either way); closing the iterator early aborts
        the request and frees its blocks.
        `request_id`: the HTTP request's (access_log.py), which the runner and the daemon log
        with its sequences."""
        self.active += 1
        self.metrics.arrived(len(prompt_ids))
        outputs = (caller.engine.stream(prompt_ids, params, key=caller.name,
                                        client_request_id=request_id, delta=True) if every_step
                   else _final(caller, prompt_ids, params, request_id))
        try:
            async for output in outputs:
                yield output
        except PagedKVError as exc:  # its cause's status (errors.py); else a 500, logged
            status = engine_status(exc)
            if status == 503:
                raise unavailable(f"the KV cache service failed the request ({exc})") from exc
            if status == 500:  # a bug: the error middleware logs it
                raise
            raise ApiError(status, f"the KV cache service refused the request: {exc}") from exc
        finally:  # closed early (a stop string, a client gone): the engine aborts it now
            await outputs.aclose()
            self.active -= 1


async def _final(caller: Caller, prompt_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncGenerator[RequestOutput]:
    yield await caller.engine.generate(prompt_ids, params, key=caller.name,
                                       client_request_id=request_id)
