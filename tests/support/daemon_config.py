"""A DaemonConfig from `pagedkvd` flags, as the daemon's command line builds it (its serve
arguments, then defaults <- TOML <- flags), with an environment given instead of the process's."""

import argparse

from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.settings_sources import add_serve_arguments, config_from_args


def parse(argv: list[str], env: dict[str, str] | None = None) -> DaemonConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(argv), env={} if env is None else env)
