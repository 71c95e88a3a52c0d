"""Structured outputs in the runner: each constraint compiled once for the model's tokenizer, and
each constrained sequence's matcher.

    grammars = Grammars(tokenizer_folder, vocab_size=runner.vocab_size, eos_token_ids=eos)
    compiled = await grammars.compile(requests)    # before the step changes anything
    state = GrammarState(constraint, compiled[constraint])        # kept as SeqState.grammar
    # on the forward thread, at each sampling of the sequence (masks.py, sampling.py):
    state.sync(output_token_ids); state.fill(bitmask, row); ...; ended = state.accept(token)

The engine is xgrammar (vLLM's default): a `GrammarCompiler` built from the model's tokenizer
(`TokenizerInfo.from_huggingface`, vocab_size the logits' width, so ids past the tokenizer are
never allowed), its compiled grammars kept in a bounded LRU keyed by the constraint. Compiling is
CPU work of up to seconds: it runs on one worker thread of its own, never on the event loop nor
on the forward thread; a step waits for it before its daemon calls, so a constraint that does
not compile is InvalidStep naming the field and changes nothing. The tokenizer is loaded on the
first constraint (a runner that never sees one never loads it).

A matcher is touched only on the forward thread. It follows the sequence's output tokens by
replaying them (`sync`): a new sequence starts empty, and a fork's child, a sequence resent with
its history, or one sampled again at a position (decode ahead with changed sampling) gets a
matcher rebuilt from its output tokens: simple and exact, at the cost of one replay.
"""

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xgrammar as xgr

from pagedkv.client import SeqStep, StructuredOutputs
from pagedkv.model_runner.engine.steps import InvalidStep, Unsupported

# Compiled grammars kept (least recently used dropped): a JSON schema's is a few hundred KiB.
MAX_CACHED_GRAMMARS = 64
# json_object: OpenAI's "one JSON object", of any schema.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's errors begin with its log line's time and source position: not the client's concern.
XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
# Files a Hugging Face tokenizer is saved as (llm/tokenizer.py's list).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")


@dataclass
class GrammarState:
    """One constrained sequence's matcher, kept with its sampling (SeqState.grammar)."""

    # The constraint, as the client sent it.
    constraint: StructuredOutputs
    # Its grammar, compiled for the runner's tokenizer.
    compiled: xgr.CompiledGrammar
    # The matcher, built on the forward thread at the sequence's first sampling.
    matcher: xgr.GrammarMatcher | None = None
    # The tokens the matcher accepted, in order: the sequence's output tokens so far, and the
    # token sampled last (accepted before the client appends it).
    accepted: list[int] = field(default_factory=list)
    # The matcher refused a token (a history the constraint does not accept): the sequence ends
    # at its next sampling.
    broken: bool = False

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's tokens the sequence's output tokens: accept the ones it lacks, or
        rebuild it and replay them all when it holds others (a fork, a resend, a resample)."""
        done = len(self.accepted)
        if self.matcher is None or list(output_token_ids[:done]) != self.accepted:
            self.matcher = self._new_matcher()
            self.accepted, self.broken = [], False
        for token in output_token_ids[len(self.accepted):]:
            self.accept(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` = the tokens the constraint allows next (a broken matcher's
        row is left all allowed: the sequence ends with whatever it samples)."""
        assert self.matcher is not None, "sync comes first"
        if not self.broken:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; whether the sequence ends here: the constraint is
        complete (its stop token accepted), or the token was refused."""
        assert self.matcher is not None, "sync comes first"
        if self.broken or not self.matcher.accept_token(token_id):
            self.broken = True
            return True
        self.accepted.append(token_id)
        return self.matcher.is_terminated()

    def _new_matcher(self) -> xgr.GrammarMatcher:
        # A tokenizer with no end-of-sequence token: the constraint ends once it is complete.
        no_stop = not self.compiled.tokenizer_info.stop_token_ids
        return xgr.GrammarMatcher(self.compiled, terminate_without_stop_token=no_stop)


class Grammars:
    """Compiles constraints for one model's tokenizer, on a worker thread, with an LRU cache."""

    def __init__(self, tokenizer: str | None, *, vocab_size: int,
                 eos_token_ids: Sequence[int] = ()) -> None:
        # The tokenizer's folder (the model's, or `pagedkv runner --tokenizer`); None: none.
        self.tokenizer = tokenizer
        # The logits' width: the bitmask covers it all.
        self.vocab_size = vocab_size
        # The model's end-of-sequence ids (its generation config): what a complete constraint
        # allows next; none: the tokenizer's own.
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        # constraint -> its compile (running or done), most recently used last.
        self._cache: OrderedDict[StructuredOutputs, asyncio.Future[xgr.CompiledGrammar]] = \
            OrderedDict()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-grammar")

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    async def compile(self, requests: Sequence[SeqStep]
                      ) -> dict[StructuredOutputs, xgr.CompiledGrammar]:
        """The compiled grammar of every constraint the requests send. Unsupported when the
        model has no tokenizer, InvalidStep naming the field of a constraint that does not
        compile; nothing changes either way."""
        wanted = {r.params.structured_outputs for r in requests
                  if r.params is not None and r.params.structured_outputs is not None}
        if wanted and self.tokenizer is None:
            raise Unsupported("structured_outputs needs the model's tokenizer, and this runner "
                              "has none (a random-init preset): start it with --tokenizer "
                              "FOLDER, or serve a model folder")
        return {constraint: await self._compiled(constraint) for constraint in wanted}

    async def _compiled(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        future = self._cache.get(constraint)
        if future is None:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(self._thread, self._compile, constraint)
            self._cache[constraint] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(constraint)
        try:
            return await asyncio.shield(future)
        except Exception:
            if self._cache.get(constraint) is future:  # a refusal is not kept
                del self._cache[constraint]
            raise

    def _compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """[grammar thread] The constraint's grammar; InvalidStep naming the field."""
        compiler = self._compiler or self._new_compiler()
        try:
            if constraint.json is not None:
                # No free whitespace: a model could spend max_tokens on spaces.
                return compiler.compile_json_schema(constraint.json, any_whitespace=False)
            if constraint.regex is not None:
                return compiler.compile_regex(constraint.regex)
            if constraint.choice is not None:
                return compiler.compile_grammar(choice_grammar(constraint.choice))
            if constraint.grammar is not None:
                return compiler.compile_grammar(constraint.grammar)
            return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, InvalidJSONError
            reason = XGRAMMAR_LOG_PREFIX.sub("", str(exc)).strip()[:200]
            raise InvalidStep(f"structured_outputs.{constraint.kind} does not compile: "
                              f"{reason}") from None

    def _new_compiler(self) -> xgr.GrammarCompiler:
        """[grammar thread] The compiler for the tokenizer (loaded once); Unsupported if the
        folder holds no tokenizer this model can use."""
        assert self.tokenizer is not None
        from transformers import AutoTokenizer

        folder = Path(self.tokenizer)
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise Unsupported(f"structured_outputs needs the model's tokenizer: {folder} holds "
                              "none (start the runner with --tokenizer FOLDER)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None)
        except Exception as exc:  # transformers and xgrammar raise many kinds
            raise Unsupported(f"structured_outputs: the tokenizer in {folder} is not usable "
                              f"for this model: {str(exc)[:200]}") from None
        # The runner's own LRU caches; the compiler's threads are the grammar thread's share.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose outputs are exactly `choices` (JSON string escapes are xgrammar's
    literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
