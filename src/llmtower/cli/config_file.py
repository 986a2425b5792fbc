"""``--config FILE``: flags of a subcommand read from a YAML mapping (vLLM's form).

Each key is a flag name with or without its dashes (``max-num-seqs``, ``max_num_seqs``,
``--max-num-seqs``); values become the parser's defaults, so flags given on the command line
still win. Unknown keys and values outside a flag's choices are errors that name the key.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse exposes no public list of its actions
        for opt in action.option_strings:
            out[opt.lstrip("-").replace("_", "-")] = action
        if not action.option_strings and action.dest != "help":
            out[action.dest.replace("_", "-")] = action
    return out


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Set ``parser``'s defaults from the YAML file at ``path``."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must be a mapping of flag: value, not a "
                         f"{type(data).__name__}")
    options = _options(parser)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        action = options.get(str(key).lstrip("-").replace("_", "-"))
        if action is None or key == "config":
            raise ValueError(f"--config {path}: unknown flag {key!r}; see --help for the flags")
        convert = action.type if callable(action.type) else str
        is_switch = isinstance(action, argparse.BooleanOptionalAction) or (
            isinstance(action.const, bool) and action.nargs == 0)
        if is_switch:
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} must be true or false, not {value!r}")
        elif isinstance(value, list):
            if action.nargs not in ("+", "*"):
                raise ValueError(f"--config {path}: {key} takes one value, not a list")
            value = [convert(str(v)) for v in value]
        elif isinstance(value, dict):  # a JSON-valued flag written as a YAML mapping
            value = json.dumps(value)
        elif value is not None:
            # A string default is converted by argparse with the flag's own type.
            value = str(value)
            if action.nargs in ("+", "*"):
                value = [convert(value)]
        if action.choices is not None and value is not None and not isinstance(value, list) \
                and value not in action.choices:
            raise ValueError(f"--config {path}: {key}={value!r} is not one of "
                             f"{', '.join(map(str, action.choices))}")
        defaults[action.dest] = value
    parser.set_defaults(**defaults)
