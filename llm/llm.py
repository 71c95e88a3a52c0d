"""`LLM`: vLLM's offline API over a pagedkv daemon and runner.

    with LLM(model="/models/qwen2.5-0.5b", dtype="float16") as llm:
        for out in llm.generate(["Hello, my name is", "The capital of France is"],
                                SamplingParams(temperature=0.7, max_tokens=150)):
            print(out.prompt, out.outputs[0].text)

By default it starts its own daemon, with the pool planned for the model (pool_budget.py), and
a runner next to it, as child processes (services.py), and stops both on close(), on leaving
the `with` block, when the object is collected, or at interpreter exit; or it uses running ones
(`LLM(model=..., daemon="unix:///...", runner="unix:///...")`, or `model_name=NAME` instead of
`runner`: the runner that registered NAME with the daemon; the model directory then only for
its tokenizer). A process killed outright (SIGKILL) cannot stop its children: they keep
running until stopped (their command lines name the LLM's private folder).

Text goes in and comes out through the model directory's tokenizer; token-id prompts need
none, so a preset (`LLM(model="tiny-llama")`, random weights) serves token ids only.
Generation stops at max_tokens, a stop token, or the model's end-of-sequence ids, which the
runner reports.

The client engine is async; the LLM runs it on a private event loop thread (loop_thread.py), so
generate() is a plain blocking call and all prompts of one call are batched together.
"""

import asyncio
import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.client.engine.runner_link import RESTART_WAIT_S
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.loop_thread import LoopThread
from pagedkv.llm.model_ref import ModelRef, resolve_model
from pagedkv.llm.progress import Progress
from pagedkv.llm.prompts import EncodedPrompt, Prompts, encode_prompts
from pagedkv.llm.services import start_services
from pagedkv.llm.tokenizer import TOKENIZER_FILES, Tokenizer, decode, load_tokenizer

# The name of the LLM's daemon session (shows in the daemon's logs and metrics).
CLIENT_NAME = "pagedkv-llm"


class LLM:
    """Offline generation: prompts in, completions out. Options: `LLMConfig`'s fields."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = LLMConfig(model=model, **options)
        model_ref = resolve_model(model) if model is not None else None
        if model_ref is not None:
            model_ref.check_max_model_len(self.config.max_model_len)
        self.tokenizer, self._no_tokenizer = tokenizer_for(self.config, model_ref)
        # Everything to undo, newest first: the engine, the loop, the children.
        self._resources = contextlib.ExitStack()
        self._finalizer = weakref.finalize(self, self._resources.close)
        try:
            self.daemon_target, self.runner_target = self._services(model_ref)
            # A runner this LLM started is not restarted by anyone: a step it leaves unanswered
            # fails at once instead of waiting for a restart.
            restart_wait_s = RESTART_WAIT_S if self._connected_to_services else 0.0
            self._loop = LoopThread("pagedkv-llm")
            self._resources.callback(self._loop.close)
            self._engine = self._loop.run(Engine.connect(
                self.daemon_target, self.runner_target, model=self.config.model_name or "",
                config=self.config.scheduler(),
                client_name=CLIENT_NAME, runner_restart_wait_s=restart_wait_s))
            self._resources.callback(_close_engine, self._loop, self._engine)
            self._check_tokenizer()
        except BaseException:
            self.close()
            raise

    @property
    def _connected_to_services(self) -> bool:
        """Whether this LLM uses a running daemon and runner (else it starts its own)."""
        return self.config.daemon is not None

    def _services(self, model: ModelRef | None) -> tuple[str, str | None]:
        """The daemon's and the runner's targets: the given ones (no runner: the one serving
        `model_name`), or those of children."""
        if self._connected_to_services:
            assert self.config.daemon is not None
            return self.config.daemon, self.config.runner
        assert model is not None, "LLMConfig requires a model when starting the services"
        services = start_services(self.config, model, self._resources)
        return services.daemon_target, services.runner_target

    def _check_tokenizer(self) -> None:
        vocab_size = self._engine.vocab_size
        if self.tokenizer is not None and len(self.tokenizer) > vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens, more than the "
                             f"model's vocabulary ({vocab_size}): it is not this model's")

    # ------------------------------------------------------------------ generating

    def generate(self, prompts: Prompts,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = True) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order, with the prompt's text (when
        it came as text) and each completion's text (when there is a tokenizer). One
        SamplingParams for every prompt, or one per prompt. `progress`: a progress bar on
        stderr when it is a terminal and there is more than one prompt."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed")
        encoded = encode_prompts(prompts, self.tokenizer, self._engine.vocab_size,
                                 self._no_tokenizer, self._engine.max_model_len)
        params = _params_per_prompt(sampling_params, len(encoded))
        return self._loop.run(self._generate(encoded, params, progress))

    async def _generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams],
                        progress: bool) -> list[RequestOutput]:
        bar = Progress.on_terminal(len(prompts), progress)

        async def one(prompt: EncodedPrompt, sampling: SamplingParams) -> RequestOutput:
            output = await self._engine.generate(prompt.token_ids, sampling)
            bar.advance()
            return self._with_text(output, prompt.text)

        tasks = [asyncio.create_task(one(p, s)) for p, s in zip(prompts, params, strict=True)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:  # one failed (or Ctrl-C): abort the others, which frees them
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            bar.close()

    def _with_text(self, output: RequestOutput, prompt: str | None) -> RequestOutput:
        completions = output.outputs
        if self.tokenizer is not None:
            completions = [replace(c, text=decode(self.tokenizer, c.token_ids))
                           for c in completions]
        return replace(output, prompt=prompt, outputs=completions)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close the engine's session, stop the loop, stop the children. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _close_engine(loop: LoopThread, engine: Engine) -> None:
    # A function of its own: the exit stack must not hold the LLM (its finalizer would keep it
    # alive), only what it closes.
    loop.run(engine.close())


def tokenizer_for(config: LLMConfig, model: ModelRef | None) -> tuple[Tokenizer | None, str]:
    """The tokenizer, or None and why there is none (for the error a text prompt gets)."""
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(Path(config.tokenizer))
        if tokenizer is None:
            raise ValueError(f"no tokenizer in {config.tokenizer!r} (none of "
                             f"{', '.join(TOKENIZER_FILES)})")
        return tokenizer, ""
    if model is None:
        return None, "no model directory or tokenizer was given"
    if model.path is None:
        return None, f"the preset {model.name!r} has random weights and no tokenizer"
    tokenizer = load_tokenizer(model.path)
    return tokenizer, f"{model.name!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                       num_prompts: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts: give one "
                         "for all, or one per prompt")
    return list(params)
