"""`pagedkv serve` over HTTP against the offline `LLM` on the same model, prompts, lengths and
batch, on two models, and the server's TTFT and ITL at 1, 8 and 32 concurrent streams (issue 32).

Both start their daemon and runner the production way (`pagedkv serve` as a subprocess,
serve_process.py; the `LLM` with its own children) on the same model folder and the same pool:
a random Llama with a byte-level BPE tokenizer (gpu_check.make_model_dir; no end-of-sequence
token). Two models, each with its own LLM and server, all up for the whole run:
- "small" (the headline figures): 4 layers of hidden 512, GQA 8/2 heads of 64, MLP 1408
  (about 11M parameters): about 0.6 ms of CPU a token offline, six times the tiny model.
  A served model costs more still (milliseconds a token on a CPU for the smallest real ones),
  so the HTTP path weighs less there; this is the largest model whose rounds fit the run's
  time on 2 cores, not one chosen to pass: its requests generate 128 tokens, not 256, for that.
- "tiny" (`_tiny` figures): 2 layers of hidden 128, about 0.1 ms a token: the HTTP path's cost
  (tens of microseconds a token) shows at its largest.
Every round of every side alternates (small LLM, small serve, tiny LLM, tiny serve, ...), so that
other work on the machine weighs on all alike. Every request asks `ignore_eos` and a fixed
max_tokens, as `vllm bench serve` does: each must finish with "length" after exactly max_tokens
tokens, or the benchmark fails.

    llm_tok_s               generated tokens / s of LLM.generate(BATCH prompts) (median round)
    serve_tok_s             the same BATCH prompts as concurrent streamed /v1/completions
    serve_vs_llm_tok_s      serve / llm (target: at least 0.9)
    llm_cpu_us_per_tok      CPU time per generated token of every process of the run (this
    serve_cpu_us_per_tok    one, the LLMs' children, the servers and their children) during the
                            LLM's rounds, and during the server's (the streaming client's
                            included): on a machine whose cores are busy, tokens / s follow it
    server_cpu_us_per_tok   the `pagedkv serve` process's own CPU time per token (its HTTP path
                            and its engine; not its daemon and runner)
    (each with _tiny)       the same on the tiny model
    serve_ttft_p50_ms_cC    median time to first token at C concurrent streams (tiny model)
    serve_itl_p50_ms_cC     median inter-token latency at C concurrent streams (tiny model)

TTFT and ITL are measured as `vllm bench serve` measures them (its
async_request_openai_completions): TTFT from just before the request is sent to the first
chunk carrying choices; ITL the gaps between successive such chunks, every request's gaps
pooled; the medians of those. C concurrent streams: REQUESTS_PER_STREAM requests per stream,
at most C in flight (its --max-concurrency). One request per model goes through the real
`openai` client too, to check that the stream it parses carries the same answer.

Usage: python benchmarks/bench_serve.py [--rounds 7] [--device cpu] [--quick]
"""

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp
import openai
from e2e import add_quick_flag, figure
from gpu_check import make_model_dir
from serve_process import Server, served

from pagedkv.client import SamplingParams
from pagedkv.llm.llm import LLM

# Prompts stepped together.
BATCH = 32
# The models (gpu_check's tiny Llama, with these sizes instead): figure suffix, config sizes,
# and tokens each request generates (the small model's fewer, to fit the run's time).
MODELS: tuple[tuple[str, Mapping[str, int], int], ...] = (
    ("", {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}, 128),
    ("_tiny", {}, 256),
)
# The pool of both stacks: room for every sequence at once (no preemption on either side).
NUM_BLOCKS = 1024
ROUNDS = 7
CONCURRENCY = (1, 8, 32)
# Latency runs: requests per stream, and tokens each generates.
REQUESTS_PER_STREAM = 4
LATENCY_TOKENS = 64
# Words the prompts are made of (gpu_check's tokenizer is trained on them).
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park", "quick", "brown",
         "fox", "jumps", "over", "lazy"]


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    # time.perf_counter() just before the request was sent.
    sent_s: float
    # When each chunk carrying choices arrived.
    chunk_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # The usage chunk's completion tokens.
    completion_tokens: int = 0
    text: str = ""

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]


def prompts(count: int, salt: int) -> list[str]:
    """`count` distinct prompts of 12 words (about 20 tokens); `salt` makes another set, so no
    round finds the one before it in the prefix cache."""
    return [" ".join(WORDS[(i * 7 + salt * 5 + j * j) % len(WORDS)] for j in range(12))
            + f" {salt} {i}" for i in range(count)]


def body(server: Server, prompt: str, max_tokens: int) -> dict[str, object]:
    """A greedy streamed completion running to max_tokens, with its usage at the end."""
    return {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def stream(http: aiohttp.ClientSession, server: Server, prompt: str,
                 max_tokens: int) -> Stream:
    """One request, read to its end; each chunk timed as it arrives."""
    seen = Stream(time.perf_counter())
    async with http.post(f"{server.url}/v1/completions",
                         json=body(server, prompt, max_tokens)) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            data = line.strip().removeprefix(b"data: ")
            if not data or data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("choices"):
                seen.chunk_s.append(time.perf_counter())
                choice = chunk["choices"][0]
                seen.text += choice["text"]
                seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
            elif chunk.get("usage"):
                seen.completion_tokens = chunk["usage"]["completion_tokens"]
    check(seen.finish_reason, seen.completion_tokens, max_tokens, prompt)
    return seen


def check(finish_reason: str | None, tokens: int, max_tokens: int, prompt: str) -> None:
    """Every request runs to max_tokens (ignore_eos honoured), or the figures mean nothing."""
    if finish_reason != "length" or tokens != max_tokens:
        raise SystemExit(f"bench_serve: {prompt!r} ended with {finish_reason!r} after {tokens} "
                         f"tokens, not 'length' after {max_tokens}: ignore_eos not honoured")


async def streams(server: Server, batch: Sequence[str], concurrency: int,
                  max_tokens: int) -> tuple[list[Stream], float]:
    """Every prompt of `batch` streamed, at most `concurrency` at once; and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def one(prompt: str) -> Stream:
            async with gate:
                return await stream(http, server, prompt, max_tokens)

        began = time.perf_counter()
        done = await asyncio.gather(*(one(prompt) for prompt in batch))
        return done, time.perf_counter() - began


def llm_tokens(llm: LLM, batch: list[str], max_tokens: int) -> int:
    """The tokens one LLM.generate of `batch` generated."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(batch, params, progress=False)
    for prompt, output in zip(batch, outputs, strict=True):
        completion = output.outputs[0]
        check(completion.finish_reason, len(completion.token_ids), max_tokens, prompt)
    return sum(len(output.outputs[0].token_ids) for output in outputs)


def serve_tokens(server: Server, batch: list[str], max_tokens: int) -> int:
    """The tokens `batch` generated as concurrent streams, all at once."""
    done, _ = asyncio.run(streams(server, batch, len(batch), max_tokens))
    return sum(seen.completion_tokens for seen in done)


@dataclass(frozen=True)
class Round:
    """One batch generated."""

    tokens: int
    wall_s: float
    # CPU time (user + system) of this process and every process under it (every stack, the
    # idle ones included: they cost next to nothing).
    cpu_s: float
    # CPU time of the `pagedkv serve` process alone (its HTTP path and engine, not its daemon
    # and runner); 0 for an LLM round.
    server_cpu_s: float = 0.0


def timed(generate: Callable[[], int], server: Server | None = None) -> Round:
    """`generate` (it returns the tokens it generated) timed by the clock and by CPU time."""
    server_pid = server.launched.process.pid if server is not None else None
    server_cpu = own_cpu_s(server_pid) if server_pid is not None else 0.0
    cpu, began = tree_cpu_s(os.getpid()), time.perf_counter()
    tokens = generate()
    wall_s, cpu_s = time.perf_counter() - began, tree_cpu_s(os.getpid()) - cpu
    server_cpu_s = own_cpu_s(server_pid) - server_cpu if server_pid is not None else 0.0
    return Round(tokens, wall_s, cpu_s, server_cpu_s)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds that process `pid` and its descendants (any thread's children) have used."""
    total, pids = 0.0, [pid]
    while pids:
        current = pids.pop()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # gone meanwhile
            total += own_cpu_s(current)
            for children in Path(f"/proc/{current}/task").glob("*/children"):
                pids += [int(child) for child in children.read_text().split()]
    return total


def own_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) that process `pid` itself has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@dataclass
class Model:
    """One model's offline LLM and server, and their rounds."""

    # Its figures' suffix: "" (the representative model) or "_tiny".
    suffix: str
    llm: LLM
    server: Server
    # Tokens each request generates.
    max_tokens: int
    offline: list[Round] = field(default_factory=list)
    online: list[Round] = field(default_factory=list)

    def round(self, index: int, batch: int) -> None:
        """One LLM round, then one serve round, each on prompts of its own."""
        self.offline.append(timed(partial(llm_tokens, self.llm, prompts(batch, 2 * index),
                                          self.max_tokens)))
        self.online.append(timed(partial(serve_tokens, self.server,
                                         prompts(batch, 2 * index + 1), self.max_tokens),
                                 self.server))

    def report(self) -> None:
        """The median tokens / s of each side and their ratio; the CPU time each side spent
        per token over all its rounds, and the server process's own."""
        llm_median, serve_median = (statistics.median(r.tokens / r.wall_s for r in side)
                                    for side in (self.offline, self.online))
        figure(f"llm_tok_s{self.suffix}", llm_median, "tok/s", 0)
        figure(f"serve_tok_s{self.suffix}", serve_median, "tok/s", 0)
        figure(f"serve_vs_llm_tok_s{self.suffix}", serve_median / llm_median, "ratio", 2)
        for name, side in (("llm", self.offline), ("serve", self.online)):
            cpu_us = per_token_us(side, lambda r: r.cpu_s)
            figure(f"{name}_cpu_us_per_tok{self.suffix}", cpu_us, "us", 1)
        server_us = per_token_us(self.online, lambda r: r.server_cpu_s)
        figure(f"server_cpu_us_per_tok{self.suffix}", server_us, "us", 1)


def per_token_us(rounds: list[Round], seconds: Callable[[Round], float]) -> float:
    """The `seconds` of `rounds` summed, per token they generated, in microseconds."""
    return sum(seconds(r) for r in rounds) / sum(r.tokens for r in rounds) * 1e6


async def through_openai(server: Server, prompt: str, max_tokens: int) -> str:
    """The real `openai` client's streamed completion of `prompt`: its text (checked to run to
    max_tokens)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    text, finish_reason, tokens = "", None, 0
    async with client:
        chunks = await client.completions.create(
            model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    check(finish_reason, tokens, max_tokens, prompt)
    return text


def throughput(models: list[Model], rounds: int, batch: int) -> None:
    """Every model's LLM and serve rounds, alternating (so that other work on the machine
    weighs on each alike); then each model's figures."""
    for index in range(rounds):
        for model in models:
            model.round(index, batch)
    for model in models:
        model.report()


def latency(server: Server, concurrency: int, max_tokens: int) -> None:
    """TTFT and ITL medians of REQUESTS_PER_STREAM requests per stream, `concurrency` streams."""
    batch = prompts(concurrency * REQUESTS_PER_STREAM, 100 + concurrency)
    done, _ = asyncio.run(streams(server, batch, concurrency, max_tokens))
    ttft = statistics.median(seen.ttft_s for seen in done)
    itl = statistics.median(gap for seen in done for gap in seen.itl_s)
    figure(f"serve_ttft_p50_ms_c{concurrency}", ttft * 1000, "ms", 1)
    figure(f"serve_itl_p50_ms_c{concurrency}", itl * 1000, "ms", 2)


@contextlib.contextmanager
def stacks(folder: Path, name: str, sizes: Mapping[str, int], device: str) -> Iterator[
        tuple[LLM, Server]]:
    """An LLM and a server on one model (`sizes` over gpu_check's tiny Llama), saved in
    `folder`/name, with the same pool."""
    model = folder / name
    make_model_dir(model, "llama", sizes)
    with LLM(model=str(model), device=device, num_blocks=NUM_BLOCKS) as llm, \
            served(folder, str(model), "--device", device, "--num-blocks",
                   str(NUM_BLOCKS)) as server:
        yield llm, server


def check_streams(llm: LLM, server: Server, max_tokens: int) -> None:
    """One request through the real openai client and through aiohttp gives the same text
    (greedy), and the LLM is warm."""
    warm = prompts(2, 999)
    text = asyncio.run(through_openai(server, warm[0], max_tokens))
    seen, _ = asyncio.run(streams(server, warm[:1], 1, max_tokens))
    if seen[0].text != text:
        raise SystemExit(f"bench_serve: the openai client read {text!r}, aiohttp "
                         f"{seen[0].text!r}")
    llm_tokens(llm, warm, max_tokens)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--rounds", type=int, default=ROUNDS)
    cli.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    add_quick_flag(cli)
    args = cli.parse_args()
    if args.rounds < 1:
        cli.error(f"--rounds must be at least 1, got {args.rounds}")
    batch, latency_tokens = (4, 8) if args.quick else (BATCH, LATENCY_TOKENS)
    with tempfile.TemporaryDirectory(prefix="bsv-") as name, contextlib.ExitStack() as stack:
        models = []
        for suffix, sizes, max_tokens in MODELS:
            max_tokens = 8 if args.quick else max_tokens
            llm, server = stack.enter_context(stacks(Path(name), f"model{suffix}", sizes,
                                                     args.device))
            check_streams(llm, server, max_tokens)
            models.append(Model(suffix, llm, server, max_tokens))
        throughput(models, 1 if args.quick else args.rounds, batch)
        tiny = next(model for model in models if model.suffix == "_tiny")
        for concurrency in (1, 2) if args.quick else CONCURRENCY:
            latency(tiny.server, concurrency, latency_tokens)


if __name__ == "__main__":
    main()
