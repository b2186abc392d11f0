"""The prefix-cache key of a full KV block, shared by the scheduler (which caches blocks under
it: ``scheduler/prefix_keys.py``) and the router (which predicts a replica's prefix hits from
its KV events: ``router/kv_index.py``).

The K/V of a token depends only on the tokens up to it, so a FULL block is identified by its
token ids and everything before it. Block ``j`` of a request gets the chained key

    hash_j = blake2b(hash_{j-1} || token ids of block j || extra keys)       (hash_{-1} = b"")

where the extra keys are what else the K/V depends on (a LoRA adapter: ``lora_extra_key``).
KV events (vLLM's ``BlockStored`` / ``BlockRemoved``) name a block by a 64-bit integer, the
last 8 bytes of its key (``external_block_hash``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """The chained key of one full block: blake2b-128 of (parent key, token ids, extra keys).

    Args:
        parent: the previous block's key (``b""`` for the first block).
        token_ids: the block's ``block_size`` token ids (each < 2**31).
        extra_keys: anything else the K/V depends on (e.g. a LoRA adapter); ``b""`` for none.

    Returns:
        16 bytes. A cryptographic hash, so prompts cannot be crafted to collide (a hit also
        re-checks the tokens).
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("i", token_ids).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


def lora_extra_key(name: str, path: str) -> bytes:
    """The extra key of a block computed with a LoRA adapter: its name and folder, not an
    engine-wide id, so the key is the same in another process (the KV tier on disk, a router
    that predicts hits from KV events)."""
    return b"\x00lora:" + name.encode() + b"\x00" + path.encode()


def external_block_hash(key: BlockHash) -> int:
    """The 64-bit block hash KV events carry for a key (vLLM's ``ExternalBlockHash`` as an
    int): the key's last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(key[-8:], "big")


def chain_hashes(token_ids: Sequence[int], block_size: int, extra_keys: bytes = b"",
                 max_blocks: int | None = None) -> list[BlockHash]:
    """The keys of the full blocks of ``token_ids`` (at most ``max_blocks``), first first.

    Args:
        token_ids: a prompt's token ids.
        block_size: tokens per KV block (>= 1).
        extra_keys: as in ``hash_block``.
        max_blocks: stop after this many blocks; None: every full block.
    """
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    keys: list[BlockHash] = []
    parent = b""
    for j in range(n):
        parent = hash_block(parent, token_ids[j * block_size:(j + 1) * block_size], extra_keys)
        keys.append(parent)
    return keys
