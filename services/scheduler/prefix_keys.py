"""The prefix-cache key of a full KV block (automatic prefix caching: ``block_manager.py``).

The K/V of a token depends only on the tokens up to it, so a FULL block is identified by its
token ids and everything before it. Block ``j`` of a request gets the chained key

    hash_j = blake2b(hash_{j-1} || token ids of block j || extra keys)       (hash_{-1} = b"")

where the extra keys are what else the K/V depends on (``Request.extra_keys``; the LoRA
adapter's name and folder when it runs with one, so two adapters, or an adapter and the base
model, never share K/V of the same text: ``lora_key``) and, with prefix caching off, the request's
``parent_request_id`` (so only the n choices of one request match).
The block manager caches a block under (KV cache group, key): ``CacheKey``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from services.scheduler.request import Request

BlockHash = bytes
CacheKey = tuple[int, BlockHash]  # (KV cache group, block hash)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """The chained key of one full block: blake2b-128 of (parent key, token ids, extra keys).

    Args:
        parent: the previous block's key (``b""`` for the first block).
        token_ids: the block's ``block_size`` token ids (each < 2**31).
        extra_keys: anything else the K/V depends on (e.g. a cache salt); ``b""`` for none.

    Returns:
        16 bytes. A cryptographic hash, so prompts cannot be crafted to collide (a hit also
        re-checks the tokens).
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("i", token_ids).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


def lora_key(request: Request) -> bytes:
    """The extra key of a request that runs with a LoRA adapter: its name and folder, not its
    engine-wide id, so the key is the same in another process (the KV tier on disk outlives
    this one and is shared by replicas).

    NOTE: an adapter whose files change in place under the same name and folder keeps its
    keys; the engine forgets the blocks of an adapter that failed to load
    (``Engine._fail_requests``).
    """
    assert request.lora is not None
    return b"\x00lora:" + request.lora.name.encode() + b"\x00" + request.lora.path.encode()


def block_hashes(request: Request, num_full_blocks: int, block_size: int,
                 enable_prefix_caching: bool) -> list[BlockHash]:
    """``request.block_hashes`` extended to at least ``num_full_blocks`` keys (each block
    is hashed once in a request's life; tokens are append-only).

    Raises:
        ValueError: the request has fewer than ``num_full_blocks * block_size`` tokens.
    """
    hashes = request.block_hashes
    if len(hashes) < num_full_blocks:
        bs = block_size
        if num_full_blocks * bs > request.num_tokens:
            raise ValueError(f"request {request.request_id} has {request.num_tokens} tokens, "
                             f"fewer than {num_full_blocks} full blocks of {bs}")
        tokens = request.token_ids_from(len(hashes) * bs)
        parent = hashes[-1] if hashes else b""
        extra = request.extra_keys
        if request.lora is not None:  # (its K/V differ from the base model's)
            extra += lora_key(request)
        if not enable_prefix_caching:  # only the choices of one parent may match
            extra += b"\x00parent:" + request.parent_request_id.encode()
        for j in range(num_full_blocks - len(hashes)):
            parent = hash_block(parent, tokens[j * bs:(j + 1) * bs], extra)
            hashes.append(parent)
    return hashes
