"""The prefix-cache keys of a request's full KV blocks (automatic prefix caching:
``block_manager.py``), chained as ``common/block_hash.py`` says. A request's extra keys are
``Request.extra_keys``, the LoRA adapter it runs with (``lora_key``, so two adapters, or an
adapter and the base model, never share K/V of the same text) and, with prefix caching off, its
``parent_request_id`` (so only the n choices of one request match).
The block manager caches a block under (KV cache group, key): ``CacheKey``.
"""

from __future__ import annotations

from services.common.block_hash import BlockHash, hash_block, lora_extra_key
from services.scheduler.request import Request

CacheKey = tuple[int, BlockHash]  # (KV cache group, block hash)

__all__ = ["BlockHash", "CacheKey", "block_hashes", "lora_key"]


def lora_key(request: Request) -> bytes:
    """The extra key of a request that runs with a LoRA adapter: its name and folder, not its
    engine-wide id, so the key is the same in another process (the KV tier on disk outlives
    this one and is shared by replicas).

    NOTE: an adapter whose files change in place under the same name and folder keeps its
    keys; the engine forgets the blocks of an adapter that failed to load
    (``Engine._fail_requests``).
    """
    assert request.lora is not None
    return lora_extra_key(request.lora.name, request.lora.path)


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
