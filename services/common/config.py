"""Command-line flags with ``PAGEDSERVE_*`` environment-variable equivalents.

Every service flag ``--max-num-seqs`` can also be set as ``PAGEDSERVE_MAX_NUM_SEQS`` so that
containers need no wrapper scripts; an explicit flag wins over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Collection
from typing import Any

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """Parse a memory size such as ``4GiB``, ``512MB`` or ``1073741824`` into bytes.

    Raises:
        argparse.ArgumentTypeError: unparsable text or a size <= 0.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 4GiB, 512MB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be > 0, got {text!r}")
    return value


def int_in(lo: int, hi: int | None = None):
    """An argparse ``type`` for an integer in ``[lo, hi]`` (``hi`` None = no upper bound).

    The returned converter raises ``argparse.ArgumentTypeError`` naming the range, which
    argparse prints after the flag's name: ``argument --block-size: must be >= 1, got 0``.
    """
    def convert(text: str | int) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    convert.__name__ = "int"  # argparse names the type in its own messages
    return convert


def float_in(lo: float, hi: float | None = None, *, lo_open: bool = False):
    """An argparse ``type`` for a float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    def convert(text: str | float) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value != value or (value <= lo if lo_open else value < lo) or (
                hi is not None and value > hi):
            left = "(" if lo_open else "["
            bound = f"in {left}{lo}, {hi}]" if hi is not None else (
                f"> {lo}" if lo_open else f">= {lo}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    convert.__name__ = "float"
    return convert


PORT = int_in(0, 65535)  # 0 = let the OS pick a free port
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(flag: str) -> str:
    """``--max-num-seqs`` -> ``PAGEDSERVE_MAX_NUM_SEQS``."""
    return "PAGEDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default once (ours are set from the environment when present):
    not where the help text already says what the default is, nor a meaningless ``None``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default" in text.lower():
            return text
        return super()._get_help_string(action) or ""  # typeshed: str | None; never None here


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    """``parser.add_argument`` whose default comes from the flag's environment variable.

    Boolean switches (``action="store_true"`` or ``argparse.BooleanOptionalAction``) read the
    variable as 1/true/yes/on or 0/false/no/off; a list flag (``nargs`` "+" or "*") reads its
    words (split on whitespace). A variable the flag's type or choices refuse ends the program
    with an argparse error naming the variable.
    """
    env = os.environ.get(env_name(flag))
    if env is not None:
        try:
            if kwargs.get("action") in ("store_true", argparse.BooleanOptionalAction):
                word = env.strip().lower()
                if word not in _TRUE + _FALSE:
                    raise argparse.ArgumentTypeError(f"must be one of {_TRUE + _FALSE}")
                kwargs["default"] = word in _TRUE
            elif kwargs.get("nargs") in ("+", "*"):  # a list: the words of the variable
                kwargs["default"] = [kwargs.get("type", str)(w) for w in env.split()]
            else:
                value = kwargs.get("type", str)(env)
                if "choices" in kwargs and value not in kwargs["choices"]:
                    raise argparse.ArgumentTypeError(f"must be one of {kwargs['choices']}")
                kwargs["default"] = value
        except (argparse.ArgumentTypeError, ValueError) as e:
            parser.error(f"environment variable {env_name(flag)}={env!r}: {e}")
    help_text = kwargs.get("help", "")
    kwargs["help"] = f"{help_text} [env {env_name(flag)}]".strip()
    parser.add_argument(flag, **kwargs)


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``: the one place a setting's default is
    written, read by the flag that sets it (``add_flag(..., default=field_default(...))``) and
    by whoever builds the config directly (tests, benchmarks).

    Raises:
        KeyError: ``cls`` has no such field, or it has no default.
    """
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def json_flag_object(text: str, flag: str, fields: Collection[str], example: str) -> dict:
    """The JSON object a flag such as ``--speculative-config`` takes, its keys among ``fields``.

    Raises:
        ValueError: not valid JSON, not an object (the message shows ``example``), or a key
            not in ``fields``; each message starts with ``flag``.
    """
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. {example}")
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise ValueError(f"{flag}: unknown field {unknown[0]!r} (fields: {', '.join(fields)})")
    return obj
