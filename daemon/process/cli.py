"""`pagedkvd [flags]` (also `python -m pagedkv.daemon`): the daemon's own command line. The
product's `pagedkv` command (cli/main.py) runs the same daemon as `pagedkv daemon`.

Exit codes: 0 after a clean shutdown, 2 for a bad setting (systemd's unit does not restart on
it: RestartPreventExitStatus=2), 1 when the daemon could not start or failed while running.
"""

import argparse
import asyncio
import sys

from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.process.settings_sources import add_serve_arguments, config_from_args
from pagedkv.process import log_setup
from pagedkv.process.standby import Standby

# A setting is wrong: restarting would fail the same way.
EXIT_BAD_CONFIG = 2
# Anything else that stops the daemon: worth a restart.
EXIT_FAILURE = 1


def run_serve(args: argparse.Namespace, prog: str) -> int:
    """Build the config from parsed flags, configure logging, run the daemon to its end."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    # A planned restart's standby (process/standby.py): descriptors 3, 4, ... held before
    # the imports open any.
    standby = Standby.from_env()
    # Imported only now: torch and grpc take seconds to load, `pagedkvd --help` and a bad
    # setting need neither.
    from pagedkv.daemon.process.server import serve
    from pagedkv.daemon.service.errors import MemoryFailed
    from pagedkv.process.grpc_server import StartupError

    if standby is not None:  # the current daemon stops now; its descriptors come then
        standby.wait_for_adoption()

    log_setup.configure(config.log_level, config.log_format)
    try:
        asyncio.run(serve(config))
    except ConfigError as exc:  # settings only the server can check (model, pool size)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (StartupError, OSError) as exc:
        print(f"{prog}: cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except MemoryFailed as exc:  # fail-stop: a restart gives a fresh pool
        print(f"{prog}: stopped: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    """`pagedkvd`: the daemon, configured by flags and an optional TOML file."""
    parser = argparse.ArgumentParser(
        prog="pagedkvd", description="Paged KV-cache block pool daemon (gRPC).")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv), "pagedkvd")

