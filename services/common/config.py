"""Command-line flags with ``PAGEDSERVE_*`` environment-variable equivalents.

Every service flag ``--max-num-seqs`` can also be set as ``PAGEDSERVE_MAX_NUM_SEQS`` so that
containers need no wrapper scripts; an explicit flag wins over the environment.
"""

from __future__ import annotations

import argparse
import os
import re

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


def env_name(flag: str) -> str:
    """``--max-num-seqs`` -> ``PAGEDSERVE_MAX_NUM_SEQS``."""
    return "PAGEDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default (ours are set from the environment when present)."""


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    """``parser.add_argument`` whose default comes from the flag's environment variable.

    Boolean switches (``action="store_true"`` or ``argparse.BooleanOptionalAction``) read the
    variable as 1/true/yes/on.
    """
    env = os.environ.get(env_name(flag))
    if env is not None:
        if kwargs.get("action") in ("store_true", argparse.BooleanOptionalAction):
            kwargs["default"] = env.strip().lower() in ("1", "true", "yes", "on")
        else:
            conv = kwargs.get("type", str)
            kwargs["default"] = conv(env)
    help_text = kwargs.get("help", "")
    kwargs["help"] = f"{help_text} [env {env_name(flag)}]".strip()
    parser.add_argument(flag, **kwargs)
