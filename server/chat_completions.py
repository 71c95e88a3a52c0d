"""POST /v1/chat/completions: a conversation in, the assistant's reply out, whole or streamed.

The messages go through the tokenizer's chat template (chat.py) into one prompt; the reply is
generated as a completion of it (generation.py), so stop strings, logprobs and usage work as in
/v1/completions; only the wire shape differs (messages and deltas, chat logprobs). With tools,
each choice's text goes through the tool choice's reader (server/tools/): what it finds as
calls becomes `message.tool_calls` (or `delta.tool_calls` pieces), the rest `content`.
"""

import contextlib
import time
from typing import Any

from aiohttp import web

from pagedkv.server.access_log import ACCESS
from pagedkv.server.backend import Backend
from pagedkv.server.chat import render_chat
from pagedkv.server.completions import usage
from pagedkv.server.errors import ApiError, from_value_error
from pagedkv.server.generation import PromptRun, TokenInfo, collect, merged
from pagedkv.server.protocol import ChatRequest, Limits, read_chat
from pagedkv.server.sse import Envelope, done, errors_as_event, open_stream, send
from pagedkv.server.structured import check_compiles
from pagedkv.server.text import token_bytes, token_text
from pagedkv.server.tools.calls import CallReader, Parsed, tool_calls


async def create_chat_completion(request: web.Request, backend: Backend, body: dict[str, Any],
                                 limits: Limits) -> web.StreamResponse:
    chat = read_chat(body, limits)
    backend.check_model(chat.sampling.model)
    if backend.tokenizer is None:
        raise ApiError(400, f"chat needs a tokenizer, but {backend.no_tokenizer}: use "
                            "/v1/completions with token ids", "messages")
    await check_compiles(*chat.tools.schemas, chat.sampling.constraint)
    try:
        prompt_ids = render_chat(backend.tokenizer, chat.messages,
                                 add_generation_prompt=chat.add_generation_prompt,
                                 continue_final_message=chat.continue_final_message,
                                 tools=chat.tools.tools, template_kwargs=chat.template_kwargs)
    except ValueError as exc:
        kwargs = frozenset(f"chat_template_kwargs.{key}" for key in chat.template_kwargs)
        raise from_value_error(exc, kwargs) from exc
    backend.check_prompt(prompt_ids, "messages")
    backend.admit()
    access = request[ACCESS]
    run = PromptRun(backend, prompt_ids, chat.sampling, await backend.caller(request),
                    access.request_id)
    access.runs = [run]
    reply = _Reply(chat, backend, run, access.request_id)
    return await (reply.stream(request) if chat.sampling.stream else reply.whole())


class _Reply:
    """One chat request's choices, as the whole answer or its stream."""

    def __init__(self, chat: ChatRequest, backend: Backend, run: PromptRun,
                 request_id: str) -> None:
        self.chat = chat
        self.backend = backend
        self.run = run
        self.id = f"chatcmpl-{request_id}"  # the request's (access_log.py), as vLLM names it
        self.created = int(time.time())

    def _fields(self, obj: str) -> dict[str, Any]:
        """What the answer (`obj` chat.completion) or a chunk (chat.completion.chunk) names
        before its choices."""
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.chat.sampling.model}

    def _chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._fields(obj), "choices": choices}

    async def whole(self) -> web.Response:
        choices = []
        for (_, index), whole in sorted((await collect([self.run])).items()):
            reader = self.chat.tools.reader()
            parsed = Parsed(whole.text) if reader is None else reader.parse(whole.text)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.calls:
                message.update(content=parsed.content or None,
                               tool_calls=tool_calls(parsed.calls))
            choices.append({"index": index, "message": message,
                            "logprobs": self._logprobs(whole.tokens),
                            "finish_reason": self.chat.tools.finish_reason(
                                whole.finish_reason, bool(parsed.calls))})
        return web.json_response({**self._chunk("chat.completion", choices),
                                  "usage": usage([self.run])})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = await open_stream(request)
        started: set[int] = set()
        # Per choice: its reader of tool calls (none: text only), and whether it made a call.
        readers: dict[int, CallReader | None] = {}
        called: set[int] = set()
        obj = "chat.completion.chunk"
        envelope = Envelope(self._fields(obj))
        async with errors_as_event(response):
            # Closed at once however the loop ends (a client gone, an error): its
            # requests are aborted now, not when the generator is collected.
            async with contextlib.aclosing(merged([self.run])) as updates_of_runs:
                async for _, updates in updates_of_runs:
                    for update in updates:
                        if update.index not in started:  # OpenAI's first delta names the role
                            started.add(update.index)
                            await envelope.send(response, [{
                                "index": update.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}])
                        reader = readers.setdefault(update.index, self.chat.tools.reader())
                        delta = _delta(reader, update.text, update.finish_reason is not None)
                        if "tool_calls" in delta:
                            called.add(update.index)
                        logprobs = self._logprobs(update.tokens)
                        if not (delta or logprobs or update.finish_reason):
                            continue  # nothing to say yet (a UTF-8 character incomplete)
                        await envelope.send(response, [{
                            "index": update.index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": self.chat.tools.finish_reason(
                                update.finish_reason, update.index in called)}])
            if self.chat.sampling.include_usage:
                await send(response, {**self._chunk(obj, []), "usage": usage([self.run])})
            await done(response)
        return response

    def _logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: per token its text, bytes, logprob and top alternatives."""
        if self.chat.sampling.logprobs is None:
            return None
        tokenizer = self.backend.tokenizer
        assert tokenizer is not None, "a chat request needs one (checked on arrival)"

        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            return {"token": token_text(tokenizer, token_id), "logprob": logprob,
                    "bytes": list(token_bytes(tokenizer, token_id))}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, p) for i, p in t.top.items()]}
                            for t in tokens]}


def _delta(reader: CallReader | None, text: str, last: bool) -> dict[str, Any]:
    """A stream delta's content and tool call pieces for a choice's new text."""
    parsed = Parsed(text) if reader is None else reader.feed(text)
    if reader is not None and last:
        parsed.add(reader.finish())
    delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
    if parsed.calls:
        delta["tool_calls"] = [piece.delta() for piece in parsed.calls]
    return delta
