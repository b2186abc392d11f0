"""Where the KV tier on disk keeps a block (``--kv-offload-dir``): the one naming rule the
scheduler (which owns the index: ``scheduler/kv_tier_index.py``) and the worker (which moves
the bytes: ``worker/kv_tier.py``) share. Torch-free.

    <--kv-offload-dir>/<namespace>/tp<rank>of<size>/<key[:2]>/<key>-g<group>.kv

``namespace`` digests everything else that changes a block's bytes (the worker's
``kv_tier_namespace``); ``key`` is the block's prefix key in hex (``scheduler/prefix_keys.py``,
16 bytes); ``group`` its KV cache group. The two-character fan-out keeps folders small.
A file being written has a temporary name (``TMP_SUFFIX`` after a unique part) and is renamed
into place when complete, so a reader never sees a half-written file under a block's name.
"""

from __future__ import annotations

import os

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


def block_path(rank_dir: str, group: int, key: bytes) -> str:
    """The file of the block of prefix ``key`` in KV cache ``group`` under ``rank_dir`` (a
    rank's folder: ``GetWorkerInfoResponse.kv_offload_path``)."""
    h = key.hex()
    return os.path.join(rank_dir, h[:2], f"{h}-g{group}{SUFFIX}")


def parse_block_name(name: str) -> tuple[int, bytes] | None:
    """(group, key) of a block file's base name, or None for any other name (a temporary
    file, a stray)."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[:-len(SUFFIX)]
    h, sep, g = stem.rpartition("-g")
    if not sep or not g.isdigit() or len(h) != 32:
        return None
    try:
        return int(g), bytes.fromhex(h)
    except ValueError:
        return None
