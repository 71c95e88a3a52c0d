"""One prompt's generation as the HTTP endpoints see it: per choice, new text, new tokens with
their logprobs, and a finish reason, whatever the endpoint's wire shape.

    run = PromptRun(backend, prompt_ids, sampling, caller, access.request_id)
    async for updates in run.updates():          # one list per engine step that changed it
        for update in updates: ...                # ChoiceUpdate: index, text, tokens, finish
    run.prompt_tokens, run.cached_tokens, run.completion_tokens   # usage

Stop strings are the server's to judge (the runner has no tokenizer): each choice's text goes
through a `TextStream`, which holds back text that may still become a stop string and cuts the
completion before one. A choice that met a stop string ends there ("stop"); once every choice
has ended, the request is closed, which aborts it in the engine: its sequences are released and
the tokens computed past the stop are never shown (the runner certifies only K/V it computed for
tokens it sampled, so nothing uncomputed is ever cached). Streaming goes step by step;
best_of > n and beam search choose their outputs at the end, so they run to the end and go
through the same cut once.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from pagedkv.client.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.llm.tokenizer import Tokenizer
from pagedkv.server.backend import Backend
from pagedkv.server.key_engines import Caller
from pagedkv.server.protocol import Sampling
from pagedkv.server.text import TextStream, token_text


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """A generated token and, when asked, its logprob and the top logprobs at its position."""

    token_id: int
    logprob: float | None
    top: dict[int, float]


@dataclass(slots=True)
class ChoiceUpdate:
    """What one step added to one choice."""

    # The choice's index among its prompt's choices.
    index: int
    text: str
    tokens: list[TokenInfo]
    # "stop", "length", or None while it goes on.
    finish_reason: str | None = None


@dataclass(slots=True)
class _Choice:
    """One completion being cut into text."""

    # Its index among its prompt's choices.
    index: int
    # Its text as it comes (None without a tokenizer: token ids only).
    stream: TextStream | None
    # Generated tokens read so far.
    read: int = 0
    # Tokens kept (up to the stop string, when one was met).
    kept: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def token_string(tokenizer: Tokenizer | None, token_id: int) -> str:
    """A token as logprobs show it: its text, or its id without a tokenizer (a preset)."""
    return str(token_id) if tokenizer is None else token_text(tokenizer, token_id)


class PromptRun:
    """One prompt's request in the engine, read as choice updates."""

    def __init__(self, backend: Backend, prompt_ids: list[int], sampling: Sampling,
                 caller: Caller, request_id: str) -> None:
        self.backend = backend
        # Whose request it is, and the engine of its cache group (key_engines.py).
        self.caller = caller
        # The HTTP request's id (access_log.py): its sequences carry it to the runner and the
        # daemon, which log it (the prompts of one request share it).
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.params = backend.max_tokens_for(sampling.params, len(prompt_ids),
                                             sampling.max_tokens_given)
        self._choices: dict[int, _Choice] = {}
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        # When its first token came (time.monotonic()), None before: the access log's TTFT.
        self.first_token_at: float | None = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.kept) for choice in self._choices.values())

    @property
    def finish_reasons(self) -> list[str | None]:
        """Each choice's finish reason, by index (None: it has not finished, or was aborted)."""
        return [self._choices[index].finish_reason for index in sorted(self._choices)]

    @property
    def texts(self) -> dict[int, list[int]]:
        """Each choice's kept token ids, by index."""
        return {index: choice.kept for index, choice in self._choices.items()}

    async def updates(self) -> AsyncGenerator[list[ChoiceUpdate]]:
        """Each step's updates; the last carries every choice's finish reason."""
        started = last = time.monotonic()
        output: RequestOutput | None = None
        every_step = self.params.num_samples == self.params.n and not self.params.beam_width
        outputs = self.backend.stream(self.prompt_ids, self.params, every_step, self.caller,
                                      self.request_id)
        try:
            async for output in outputs:
                now = time.monotonic()
                self.cached_tokens = output.num_cached_tokens
                updates = [u for completion in output.outputs
                           if (u := self._update(completion, output.finished)) is not None]
                new = sum(len(u.tokens) for u in updates)
                if new:
                    if last == started:
                        self.first_token_at = now
                        self.backend.metrics.first_token(now - started)
                    self.backend.metrics.tokens(new, None if last == started else now - last)
                    last = now
                if updates:
                    yield updates
                if all(c.finish_reason for c in self._choices.values()) and \
                        len(self._choices) >= self.params.n:
                    break  # every choice ended (a stop string may end it before the engine)
        finally:
            await outputs.aclose()  # aborts the request if the engine still runs it
            if output is not None:
                reasons = [c.finish_reason or "abort" for c in self._choices.values()]
                self.backend.metrics.done(output, reasons, time.monotonic() - started)

    def _update(self, completion: CompletionOutput, finished: bool) -> ChoiceUpdate | None:
        """The choice's new text and tokens, cut at a stop string: `completion` carries only
        tokens not read before (Backend.stream: delta outputs, or the one final output)."""
        choice = self._choices.get(completion.index)
        if choice is None:
            choice = self._choices[completion.index] = _Choice(
                completion.index, self._text_stream())
        if choice.finish_reason is not None:
            return None
        new = completion.token_ids
        first = choice.read
        choice.read += len(new)
        text = ""
        keep = len(new)
        if choice.stream is not None:
            text = choice.stream.add(new)
            if choice.stream.stopped:
                keep = choice.stream.num_tokens - first
                choice.finish_reason = "stop"
        choice.kept.extend(new[:keep])
        if choice.finish_reason is None and (completion.finish_reason or finished):
            choice.finish_reason = completion.finish_reason or "length"
            if choice.stream is not None:
                text += choice.stream.finish()
        tokens = self._tokens(completion, keep)
        if not text and not tokens and choice.finish_reason is None:
            return None
        return ChoiceUpdate(completion.index, text, tokens, choice.finish_reason)

    def _text_stream(self) -> TextStream | None:
        tokenizer = self.backend.tokenizer
        sampling = self.sampling
        return None if tokenizer is None else TextStream(
            tokenizer, sampling.stop, prompt_ids=self.prompt_ids,
            skip_special_tokens=sampling.skip_special_tokens, include_stop=sampling.include_stop,
            min_tokens=sampling.params.min_tokens)

    def _tokens(self, completion: CompletionOutput, keep: int) -> list[TokenInfo]:
        """The first `keep` tokens of `completion`, with their logprobs."""
        ids = completion.token_ids
        logprobs = completion.logprobs
        tops = completion.top_logprobs
        return [TokenInfo(ids[i], logprobs[i] if logprobs is not None else None,
                          tops[i] if tops is not None else {})
                for i in range(keep)]


@dataclass(slots=True)
class WholeChoice:
    """One choice read to its end (the whole, non-streamed answer)."""

    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None


async def collect(runs: list[PromptRun]) -> dict[tuple[int, int], WholeChoice]:
    """Every choice of `runs` read to its end, by (run's position, choice's index)."""
    choices: dict[tuple[int, int], WholeChoice] = {}
    # Closed at once however the loop ends (a client gone, an error): its requests are aborted
    # now, not when the generator is collected.
    async with contextlib.aclosing(merged(runs)) as updates_of_runs:
        async for position, updates in updates_of_runs:
            for update in updates:
                choice = choices.setdefault((position, update.index), WholeChoice())
                choice.text += update.text
                choice.tokens.extend(update.tokens)
                choice.finish_reason = update.finish_reason
    return choices


async def merged(runs: list[PromptRun]) -> AsyncGenerator[tuple[int, list[ChoiceUpdate]]]:
    """Every run's updates as they come, tagged with the run's position; the first failure
    ends them all (their requests aborted). One run (a chat, most completions) is read in
    the caller's task: no task and queue between it and the engine."""
    if len(runs) == 1:
        async with contextlib.aclosing(runs[0].updates()) as steps:
            async for step in steps:
                yield 0, step
        return
    queue: asyncio.Queue[tuple[int, list[ChoiceUpdate] | BaseException | None]] = \
        asyncio.Queue()

    async def pump(position: int, run: PromptRun) -> None:
        try:
            async for updates in run.updates():
                queue.put_nowait((position, updates))
            queue.put_nowait((position, None))
        except Exception as exc:
            queue.put_nowait((position, exc))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        left = len(tasks)
        while left:
            position, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
