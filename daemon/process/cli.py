"""Command lines: `pagedkvd [flags]` runs the daemon; `pagedkv serve|plan|runner|generate` is the
umbrella tool. `pagedkv runner` execs the runner process (`python -m pagedkv.model_runner`) and
`pagedkv generate` the offline generator (`python -m pagedkv.llm`): the daemon never imports
model code.

Exit codes: 0 after a clean shutdown, 2 for a bad setting (systemd's unit does not restart on
it: RestartPreventExitStatus=2), 1 when the daemon could not start or failed while running.
"""

import argparse
import asyncio
import os
import sys

from pagedkv.daemon.memory.planner import add_plan_arguments, run_plan
from pagedkv.daemon.process.config import ConfigError, add_serve_arguments, config_from_args
from pagedkv.process import log_setup

# A setting is wrong: restarting would fail the same way.
EXIT_BAD_CONFIG = 2
# Anything else that stops the daemon: worth a restart.
EXIT_FAILURE = 1
# Subcommands that are other programs (they load models): the module each execs.
EXEC_COMMANDS = {"runner": "pagedkv.model_runner", "generate": "pagedkv.llm"}


def run_serve(args: argparse.Namespace, prog: str) -> int:
    """Build the config from parsed flags, configure logging, run the daemon to its end."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    # Imported only now: torch and grpc take seconds to load, `pagedkv plan` and a bad
    # setting need neither.
    from pagedkv.daemon.process.server import StartupError, serve

    log_setup.configure(config.log_level, config.log_format)
    try:
        asyncio.run(serve(config))
    except ConfigError as exc:  # settings only the server can check (model, pool size)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (StartupError, OSError) as exc:
        print(f"{prog}: cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    """`pagedkvd`: the daemon, configured by flags and an optional TOML file."""
    parser = argparse.ArgumentParser(
        prog="pagedkvd", description="Paged KV-cache block pool daemon (gRPC).")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv), "pagedkvd")


def main(argv: list[str] | None = None) -> int:
    """`pagedkv serve ...` (the daemon), `pagedkv plan ...` (capacity planning),
    `pagedkv runner ...` (the model runner) and `pagedkv generate ...` (offline generation),
    the last two other processes."""
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] and args_in[0] in EXEC_COMMANDS:
        module = EXEC_COMMANDS[args_in[0]]
        os.execv(sys.executable, [sys.executable, "-m", module, *args_in[1:]])
    parser = argparse.ArgumentParser(prog="pagedkv", description="Paged KV-cache service tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the daemon (as pagedkvd)"))
    add_plan_arguments(commands.add_parser("plan", help="how many blocks and sequences fit"))
    commands.add_parser("runner", help="run the model runner next to the daemon "
                                       "(pagedkv runner --help)")
    commands.add_parser("generate", help="generate completions for prompts with a local model "
                                         "(pagedkv generate --help)")
    args = parser.parse_args(args_in)
    if args.command == "serve":
        return run_serve(args, "pagedkv serve")
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())
