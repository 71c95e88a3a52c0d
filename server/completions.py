"""POST /v1/completions: prompts in, text completions out, whole or as server-sent events.

Each prompt is one engine request; prompt p's choice k is choice p * n + k of the answer, as
OpenAI numbers them. Both shapes are built from the same choice updates (generation.py): the
whole answer accumulates them, the stream sends them as they come.
"""

import contextlib
import time
from typing import Any

from aiohttp import web

from pagedkv.server.access_log import ACCESS
from pagedkv.server.backend import Backend
from pagedkv.server.errors import ApiError
from pagedkv.server.generation import PromptRun, TokenInfo, collect, merged, token_string
from pagedkv.server.protocol import CompletionRequest, Limits, read_completion
from pagedkv.server.sse import Envelope, done, errors_as_event, open_stream, send
from pagedkv.server.structured import check_compiles


async def create_completion(request: web.Request, backend: Backend, body: dict[str, Any],
                            limits: Limits) -> web.StreamResponse:
    completion = read_completion(body, limits)
    backend.check_model(completion.sampling.model)
    await check_compiles(completion.sampling.constraint)
    _check_text(completion, backend)
    prompts = [backend.encode(p, "prompt" if len(completion.prompts) == 1 else f"prompt[{i}]")
               for i, p in enumerate(completion.prompts)]
    backend.admit()
    caller = await backend.caller(request)
    access = request[ACCESS]
    runs = [PromptRun(backend, ids, completion.sampling, caller, access.request_id)
            for ids in prompts]
    access.runs = runs
    answer = _Answer(completion, backend, runs, body.get("return_token_ids") is True,
                     access.request_id)
    if completion.sampling.stream:
        return await answer.stream(request)
    return await answer.whole()


def _check_text(completion: CompletionRequest, backend: Backend) -> None:
    if backend.tokenizer is None and completion.sampling.stop:
        raise ApiError(400, f"stop strings need a tokenizer, but {backend.no_tokenizer}: use "
                            "stop_token_ids", "stop")


class _Answer:
    """One request's choices, as the whole answer or its stream."""

    def __init__(self, completion: CompletionRequest, backend: Backend, runs: list[PromptRun],
                 token_ids: bool, request_id: str) -> None:
        self.completion = completion
        self.backend = backend
        self.runs = runs
        # vLLM's `return_token_ids`: each choice carries its token ids too.
        self.token_ids = token_ids
        # What the answer and each chunk name before their choices; the id is the request's
        # (access_log.py), as vLLM names it.
        self.fields = {"id": f"cmpl-{request_id}", "object": "text_completion",
                       "created": int(time.time()), "model": completion.sampling.model}
        self.n = completion.sampling.params.n

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.fields, "choices": choices}

    def _echo(self, position: int) -> str:
        if not self.completion.echo:
            return ""
        prompt = self.completion.prompts[position]
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.backend.tokenizer
        return "" if tokenizer is None else tokenizer.decode(prompt)

    async def whole(self) -> web.Response:
        choices = []
        for (position, index), whole in sorted((await collect(self.runs)).items()):
            echo = self._echo(position)
            choice = self._choice(position, index, echo + whole.text, whole.tokens,
                                  whole.finish_reason, offset=len(echo))
            if self.token_ids:
                choice["token_ids"] = self.runs[position].texts[index]
                choice["prompt_token_ids"] = self.runs[position].prompt_ids
            choices.append(choice)
        return web.json_response({**self._chunk(choices), "usage": usage(self.runs)})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = await open_stream(request)
        envelope = Envelope(self.fields)
        # Per choice, where its next token's text starts (text_offset counts from the start).
        offsets: dict[tuple[int, int], int] = {}
        async with errors_as_event(response):
            # Closed at once however the loop ends (a client gone, an error): its
            # requests are aborted now, not when the generator is collected.
            async with contextlib.aclosing(merged(self.runs)) as updates_of_runs:
                async for position, updates in updates_of_runs:
                    for update in updates:
                        key = (position, update.index)
                        prefix = "" if key in offsets else self._echo(position)
                        offset = offsets.get(key, len(prefix))
                        choice = self._choice(position, update.index, prefix + update.text,
                                              update.tokens, update.finish_reason, offset)
                        logprobs = choice["logprobs"]
                        offsets[key] = offset + (sum(map(len, logprobs["tokens"]))
                                                 if logprobs is not None else 0)
                        if self.token_ids:
                            choice["token_ids"] = [t.token_id for t in update.tokens]
                        await envelope.send(response, [choice])
            if self.completion.sampling.include_usage:
                await send(response, {**self._chunk([]), "usage": usage(self.runs)})
            await done(response)
        return response

    def _choice(self, position: int, index: int, text: str, tokens: list[TokenInfo],
                finish_reason: str | None, offset: int) -> dict[str, Any]:
        logprobs = (self._logprobs(tokens, offset)
                    if self.completion.sampling.logprobs is not None else None)
        return {"index": position * self.n + index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": None}

    def _logprobs(self, tokens: list[TokenInfo], offset: int) -> dict[str, Any]:
        """OpenAI's legacy completions logprobs: per token its text, logprob, top logprobs and
        where its text starts."""
        tokenizer = self.backend.tokenizer
        strings = [token_string(tokenizer, t.token_id) for t in tokens]
        offsets = []
        for string in strings:
            offsets.append(offset)
            offset += len(string)
        tops = [{token_string(tokenizer, i): p for i, p in t.top.items()} for t in tokens]
        return {"tokens": strings, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": tops if self.completion.sampling.logprobs else None,
                "text_offset": offsets}


def usage(runs: list[PromptRun]) -> dict[str, Any]:
    """OpenAI's usage, with the prefix cache's share of the prompt (cached_tokens)."""
    prompt = sum(run.prompt_tokens for run in runs)
    completion = sum(run.completion_tokens for run in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(run.cached_tokens for run in runs)}}

