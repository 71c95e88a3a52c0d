"""`pagedkv daemon|plan|model|runner|generate|serve`: the product's one command, on top of every
part.

    pagedkv daemon ...     the daemon, as `pagedkvd` (daemon/process/cli.py)
    pagedkv plan ...       how many blocks and sequences fit a device (daemon/memory/planner.py)
    pagedkv model ...      list the daemon's models, put one to sleep or wake it (model_cmd.py)
    pagedkv ready ...      wait until a daemon and a runner serve (ready_cmd.py)
    pagedkv example-model DIR   a small random model folder with a tokenizer (llm/example_model.py)
    pagedkv runner ...     the model runner next to the daemon (model_runner/process/cli.py)
    pagedkv generate ...   completions for prompts with a local model (llm/cli.py)
    pagedkv serve ...      the OpenAI-compatible HTTP server (server/cli.py)

`runner`, `generate` and `serve` parse their own flags (`pagedkv serve --help`) and are
imported only when asked for, so `pagedkv daemon` and `pagedkv plan` never load model code.
The exit code is the subcommand's (2 for a bad setting: systemd's units do not restart on it).
"""

import argparse
import sys
from collections.abc import Callable

from pagedkv.cli.model_cmd import add_model_arguments, run_model
from pagedkv.cli.ready_cmd import add_ready_arguments, run_ready
from pagedkv.daemon.memory.planner import add_plan_arguments, run_plan
from pagedkv.daemon.process.cli import run_serve
from pagedkv.daemon.process.settings_sources import add_serve_arguments


def run_runner(argv: list[str]) -> int:
    """`pagedkv runner ...`: the runner process (it loads torch and the model code)."""
    from pagedkv.model_runner.process.cli import main

    return main(argv)


def run_generate(argv: list[str]) -> int:
    """`pagedkv generate ...`: offline generation with the `LLM` (it starts its own daemon and
    runner unless told where they are)."""
    from pagedkv.llm.cli import main

    return main(argv)


def run_server(argv: list[str]) -> int:
    """`pagedkv serve ...`: the OpenAI-compatible HTTP server (it starts or connects to a
    daemon and a runner, as `generate` does)."""
    from pagedkv.server.cli import main

    return main(argv)


def run_example_model(argv: list[str]) -> int:
    """`pagedkv example-model DIR`: write a small random model folder (it loads torch)."""
    from pagedkv.llm.example_model import main

    return main(argv)


# Subcommands with command lines of their own: the rest of the line is theirs.
PROGRAMS: dict[str, Callable[[list[str]], int]] = {"runner": run_runner,
                                                   "generate": run_generate,
                                                   "serve": run_server,
                                                   "example-model": run_example_model}


def parser() -> argparse.ArgumentParser:
    """The `pagedkv` parser: daemon's and plan's flags; the others listed for --help."""
    command = argparse.ArgumentParser(prog="pagedkv", description="Paged KV-cache service tools.")
    commands = command.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("daemon", help="run the daemon (as pagedkvd)"))
    add_plan_arguments(commands.add_parser("plan", help="how many blocks and sequences fit"))
    add_model_arguments(commands.add_parser("model", help="list the daemon's models, put one "
                                                          "to sleep or wake it"))
    add_ready_arguments(commands.add_parser("ready", help="wait until a daemon and a runner "
                                                          "serve"))
    commands.add_parser("example-model", help="write a small random-initialized model folder "
                                              "with a tokenizer (pagedkv example-model --help)")
    commands.add_parser("runner", help="run the model runner next to the daemon "
                                       "(pagedkv runner --help)")
    commands.add_parser("generate", help="generate completions for prompts with a local model "
                                         "(pagedkv generate --help)")
    commands.add_parser("serve", help="run the OpenAI-compatible HTTP server "
                                      "(pagedkv serve --help)")
    return command


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named first in `argv` (default: the process's arguments)."""
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] and args_in[0] in PROGRAMS:
        return PROGRAMS[args_in[0]](args_in[1:])
    args = parser().parse_args(args_in)
    if args.command == "daemon":
        return run_serve(args, "pagedkv daemon")
    if args.command == "model":
        return run_model(args)
    if args.command == "ready":
        return run_ready(args)
    return run_plan(args)
