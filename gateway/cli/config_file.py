"""`--config FILE`: flags from a YAML file, as `vllm serve --config` reads them.

Each key is a flag's name without its dashes (`max-model-len: 1024`; underscores work too).
The file's flags go in right after the command, so any given on the command line come later
and win. `true` sets a switch, `false` turns off one that has a `--no-` form, a list gives the
flag several values, and a mapping is passed as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Collection

import yaml


class ConfigFileError(ValueError):
    """The file cannot be read, or does not hold a mapping of flags."""


def expand_config(argv: list[str], option_strings: Collection[str]) -> list[str]:
    """`argv` (command first) with the flags of its `--config FILE`, if any, inserted after
    the command; `option_strings` are the command's flags, for `false` switches."""
    path = _config_path(argv)
    if path is None:
        return argv
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"--config {path}: {exc}") from None
    if values is None:
        return argv
    if not isinstance(values, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values")
    flags = []
    for key, value in values.items():
        flags += _flag_args(str(key), value, option_strings, path)
    return [argv[0], *flags, *argv[1:]]


def _config_path(argv: list[str]) -> str | None:
    for index, arg in enumerate(argv):
        if arg == "--":
            return None
        if arg == "--config":
            return argv[index + 1] if index + 1 < len(argv) else None  # argparse reports it missing
        if arg.startswith("--config="):
            return arg.removeprefix("--config=")
    return None


def _flag_args(key: str, value: object, option_strings: Collection[str], path: str) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if flag == "--config":
        raise ConfigFileError(f"--config {path}: a config file cannot name another one")
    if value is True:
        return [flag]
    if value is False:
        negative = "--no-" + flag[2:]
        return [negative] if negative in option_strings else []  # a plain switch is off already
    if value is None:
        return []
    if isinstance(value, list):
        return [flag, *(str(item) for item in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
