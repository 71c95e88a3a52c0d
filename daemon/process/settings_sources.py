"""Where the daemon's settings come from: built-in defaults, then a TOML file, then flags.

The TOML reader and the flags of `pagedkvd` (and `pagedkv daemon`) are derived from one table,
`SETTINGS` (settings.py): a key or a flag exists because a setting does, and is read as that
setting's kind says. A flag not given leaves the TOML value; a layer that sizes the pool (one of
`SIZING_KEYS`) replaces the sizing of the layers below it.
"""

import argparse
import os
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from pagedkv.daemon.process.config import SIZING_KEYS, DaemonConfig, default_listen
from pagedkv.daemon.process.settings import SETTINGS, ConfigError, check_setting, flag_name
from pagedkv.daemon.service.limits import LIMITS


def load_toml(path: Path) -> dict[str, Any]:
    """The settings in a TOML file, converted to the fields' types."""
    try:
        with path.open("rb") as file:
            raw = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from exc
    if "shm_mode" in raw:
        raise ConfigError(f"config: shm_mode in {path} is gone: the pool file is mode 0o600, or "
                          "0o660 for runner_group alone (set runner_group to share it with "
                          "runners of another user)")
    unknown = sorted(set(raw) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"config: unknown key(s) {', '.join(unknown)} in {path}; "
                          f"known: {', '.join(SETTINGS)}")
    return {key: check_setting(SETTINGS[key].kind.toml, value, f"{key} in {path}")
            for key, value in raw.items()}


def merge_layers(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers override earlier ones; a layer that sizes the pool replaces the sizing."""
    merged: dict[str, Any] = {}
    for layer in layers:
        sizing = [key for key in SIZING_KEYS if key in layer]
        if len(sizing) > 1:
            raise ConfigError(f"{' and '.join(sizing)} both given; size the pool with one")
        if sizing:
            merged.update(dict.fromkeys(SIZING_KEYS))
        merged.update(layer)
    return merged


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagedkvd` / `pagedkv daemon`; each overrides the TOML key of the same name."""
    parser.add_argument("--config", type=Path, help="TOML file with any of the settings below")
    settings = parser.add_argument_group("settings (override the TOML file)")
    limits = parser.add_argument_group("limits on what clients may ask (override the TOML file)")
    defaults = {item.name: item.default for item in fields(DaemonConfig)
                if item.default is not MISSING}
    for name, setting in SETTINGS.items():
        if setting.help is None:
            continue
        keywords = dict(setting.kind.flag)
        if setting.choices is not None:
            keywords["choices"] = setting.choices
        group = limits if name in LIMITS else settings
        # SUPPRESS: a flag not given leaves no attribute, so it cannot override the TOML file.
        group.add_argument(flag_name(name, setting), dest=name, default=argparse.SUPPRESS,
                           help=setting.help.format(default=defaults.get(name)), **keywords)


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> DaemonConfig:
    """Defaults <- the --config TOML file <- the flags given."""
    flags = {key: value for key, value in vars(args).items() if key in SETTINGS}
    if "listen" in flags:
        flags["listen"] = tuple(flags["listen"])
    toml = load_toml(args.config) if getattr(args, "config", None) is not None else {}
    defaults = {"listen": default_listen(os.environ if env is None else env)}
    return DaemonConfig(**merge_layers(defaults, toml, flags))
