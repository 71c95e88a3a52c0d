"""`pagedkv generate` (also `python -m pagedkv.llm`): prompts in, completions printed.

    pagedkv generate --model /models/qwen2.5-0.5b "Hello, my name is" "The sky is"
    pagedkv generate --model /models/qwen2.5-0.5b --prompts-file prompts.txt --max-tokens 64
    pagedkv generate --model /models/qwen2.5-0.5b --daemon unix:///run/pagedkv/pagedkvd.sock \
        --runner unix:///run/pagedkv-runner/pagedkv-runner.sock "Hello"
    pagedkv generate --model /models/qwen-ft --daemon unix:///run/pagedkv/pagedkvd.sock \
        --model-name qwen-ft "Hello"        # the runner that registered qwen-ft
    pagedkv generate --model tiny-llama --max-model-len 256 --seed 7 --no-enable-prefix-caching

The engine's flags are `LLMConfig`'s, as `pagedkv serve` and `LLM(...)` take them (vLLM's
names). The model is given with --model only: the positional arguments are the prompts, so a
prompt that happens to name a folder or a preset is never read as a model.

Each prompt's completions are printed as Python string literals (a newline stays on its line):

    Prompt 0: 'Hello, my name is'
      [0] ' John and I' (length)

With more than one prompt a progress bar is drawn on stderr when it is a terminal. Exit codes:
0, 2 for bad input (a flag, a prompt, a model directory), 1 when generation failed.
"""

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.client.pool.errors import PagedKVError
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.llm import LLM
from pagedkv.process.launch import NoNotification

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
PROG = "pagedkv generate"


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog=PROG, description="Generate completions for prompts "
                                  "with a local model (starts a daemon and a runner unless "
                                  "--daemon names a running one, with --runner or "
                                  "--model-name).")
    cli.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    cli.add_argument("--prompts-file", metavar="FILE",
                     help="more prompts, one per line (empty lines skipped; - for stdin)")
    cli.add_argument("--max-tokens", type=int, default=16, help="tokens per completion "
                                                                "(default 16)")
    cli.add_argument("--temperature", type=float, default=None,
                     help="default 1.0; 0 is greedy (the default with --beam-width)")
    cli.add_argument("--top-p", type=float, default=1.0, help="default 1.0 (off)")
    cli.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    cli.add_argument("--beam-width", type=int, default=0,
                     help="beam search with this many beams (default 0: off)")
    cli.add_argument("--model-name", help="with --daemon: the model to generate with, as its "
                                          "runner registered it (that runner is used)")
    LLMConfig.add_cli_args(cli)
    return cli


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of the command line, then those of --prompts-file."""
    prompts = list(args.prompts)
    if args.prompts_file == "-":
        prompts += [line for line in sys.stdin.read().splitlines() if line.strip()]
    elif args.prompts_file is not None:
        with open(args.prompts_file) as file:
            prompts += [line for line in file.read().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: give them as arguments or with --prompts-file")
    return prompts


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    greedy_default = 0.0 if args.beam_width else 1.0
    temperature = greedy_default if args.temperature is None else args.temperature
    return SamplingParams(temperature=temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                          n=args.n, beam_width=args.beam_width)


def print_outputs(outputs: Sequence[RequestOutput]) -> None:
    for index, output in enumerate(outputs):
        print(f"Prompt {index}: {output.prompt!r}")
        for completion in output.outputs:
            print(f"  [{completion.index}] {completion.text!r} ({completion.finish_reason})")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        prompts = read_prompts(args)
        params = sampling_params(args)
        config = LLMConfig.from_cli_args(args, model_name=args.model_name)
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with LLM(**dataclasses.asdict(config)) as llm:
            print_outputs(llm.generate(prompts, params))
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (NoNotification, PagedKVError) as exc:
        print(f"{PROG}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return 0
