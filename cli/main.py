"""`pagedkv serve|plan|runner|generate`: the product's one command, on top of every part.

    pagedkv serve ...      the daemon, as `pagedkvd` (daemon/process/cli.py)
    pagedkv plan ...       how many blocks and sequences fit a device (daemon/memory/planner.py)
    pagedkv runner ...     the model runner next to the daemon (model_runner/process/cli.py)
    pagedkv generate ...   completions for prompts with a local model (llm/cli.py)

`runner` and `generate` parse their own flags (`pagedkv runner --help`) and are imported only
when asked for, so `pagedkv serve` and `pagedkv plan` never load model code. The exit code is
the subcommand's (2 for a bad setting: systemd's units do not restart on it).
"""

import argparse
import sys
from collections.abc import Callable

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


# Subcommands with command lines of their own: the rest of the line is theirs.
PROGRAMS: dict[str, Callable[[list[str]], int]] = {"runner": run_runner,
                                                   "generate": run_generate}


def parser() -> argparse.ArgumentParser:
    """The `pagedkv` parser: serve's and plan's flags; runner and generate listed for --help."""
    command = argparse.ArgumentParser(prog="pagedkv", description="Paged KV-cache service tools.")
    commands = command.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the daemon (as pagedkvd)"))
    add_plan_arguments(commands.add_parser("plan", help="how many blocks and sequences fit"))
    commands.add_parser("runner", help="run the model runner next to the daemon "
                                       "(pagedkv runner --help)")
    commands.add_parser("generate", help="generate completions for prompts with a local model "
                                         "(pagedkv generate --help)")
    return command


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named first in `argv` (default: the process's arguments)."""
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] and args_in[0] in PROGRAMS:
        return PROGRAMS[args_in[0]](args_in[1:])
    args = parser().parse_args(args_in)
    if args.command == "serve":
        return run_serve(args, "pagedkv serve")
    return run_plan(args)
