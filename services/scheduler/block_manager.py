"""The paged KV cache's bookkeeping: which physical blocks are free, who holds the rest, and
which full blocks hold a known prefix (automatic prefix caching).

Pure Python, no torch (DESIGN.md §3): the worker owns the K/V tensors, the scheduler owns the
block ids. A block holds ``block_size`` consecutive tokens of one request; a request's block
table (``Request.block_ids``) lists its blocks in logical order, so token ``i`` lives in slot
``block_ids[i // block_size] * block_size + i % block_size``.

    num_computed_tokens + num_new_tokens = 21, block_size = 8  ->  ceil(21 / 8) = 3 blocks
    logical block:   0          1          2
    block_ids:     [ 7 ]      [ 2 ]      [ 5 ]       (physical ids, any order)
    tokens:        0 .. 7     8 .. 15    16 .. 20 (+3 free slots for later tokens)

Prefix caching (vLLM V1's automatic prefix caching; Kwon et al., "Efficient Memory Management
for Large Language Model Serving with PagedAttention", SOSP 2023, §4.4 shared prefixes): the
K/V of a token depends only on the tokens up to it, so a FULL block is identified by its token
ids and everything before it. Block ``j`` of a request gets the chained key

    hash_j = blake2b(hash_{j-1} || token ids of block j || extra keys)       (hash_{-1} = b"")

and, once its slots are scheduled to be written, is registered under that key. A later request
whose block ``j`` has the same key reuses the physical block (ref_count + 1) instead of
computing it. A hit re-checks the stored token ids and parent key, so even a hash collision
cannot hand out wrong K/V. Blocks that no request references go back to the free list with their
key; the free list is in LRU order (freed last = evicted last), so a cached block is reused
until allocation has to evict it.

    free list (LRU -> MRU):  [3] [9] [4*] [1*] [6*]        * = still holds a cached prefix
    allocate() takes from the left; a taken cached block loses its key (eviction).
    a hit on [4*] takes it out of the free list without evicting it.

With prefix caching off, only the n choices of one request (``Request.parent_request_id``) share
blocks: their keys also hash the parent id, so no other request can match them, and a block
loses its key the moment no request holds it (nothing is kept for later requests).

NOTE: blocks are registered when they are ALLOCATED for a step, before the worker has written
them. That is safe because (a) the worker writes every token's K/V of a layer before any
attention of that layer reads the cache, so a request that hits a block registered earlier in
the same step reads it after it is written; (b) the scheduler never preempts a request it
already scheduled in the same step, so a registered block is always computed; (c) after a worker
failure every request is aborted and ``reset_prefix_cache`` forgets all keys.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.scheduler.request import Request

BlockHash = bytes


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


@dataclass(slots=True)
class Block:
    """One physical KV block.

    Attributes:
        block_id: index into the worker's KV tensors.
        ref_count: number of block tables that list it.
        block_hash: its prefix key while it is in the prefix cache, else None.
        token_ids: the tokens it holds while cached (re-checked on every hit).
        parent_hash: the key of the block before it while cached (re-checked on every hit).
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: BlockHash | None = None


class BlockManager:
    """Allocates KV blocks to requests from an LRU free list, sharing cached prefixes.

    Invariant (``check_invariants``): every block is either on the free list with
    ``ref_count == 0`` or off it with ``ref_count > 0``, so
    ``num_free_blocks + #{blocks with ref_count > 0} == num_blocks`` at all times; and every
    key in the prefix cache maps to a block that carries that key.

    Args:
        num_blocks: physical blocks in the KV cache (the minimum over worker ranks).
        block_size: tokens per block.
        enable_prefix_caching: share full blocks of identical prefixes (default on).

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is < 1.
    """

    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # NOTE: an OrderedDict, not a deque: a prefix hit takes a block out of the MIDDLE of the
        # free list in O(1). Left = least recently freed = allocated (evicted) first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[BlockHash, Block] = {}  # prefix key -> block holding it

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by a request, counted from ref counts (O(num_blocks); for stats and
        leak checks, independent of the free list)."""
        return sum(1 for b in self.blocks if b.ref_count > 0)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a registered prefix, referenced or not."""
        return len(self.cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0.0 (empty) .. 1.0 (full). Cached blocks
        that nobody references count as free: allocation may evict them."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------
    def block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """``request.block_hashes`` extended to at least ``num_full_blocks`` keys (each block
        is hashed once in a request's life; tokens are append-only).

        Raises:
            ValueError: the request has fewer than ``num_full_blocks * block_size`` tokens.
        """
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            bs = self.block_size
            if num_full_blocks * bs > request.num_tokens:
                raise ValueError(f"request {request.request_id} has {request.num_tokens} tokens, "
                                 f"fewer than {num_full_blocks} full blocks of {bs}")
            tokens = request.token_ids_from(len(hashes) * bs)
            parent = hashes[-1] if hashes else b""
            extra = request.extra_keys
            if not self.enable_prefix_caching:  # only the choices of one parent may match
                extra += b"\x00parent:" + request.parent_request_id.encode()
            for j in range(num_full_blocks - len(hashes)):
                parent = hash_block(parent, tokens[j * bs:(j + 1) * bs], extra)
                hashes.append(parent)
        return hashes

    def shares_blocks(self, request: Request) -> bool:
        """Whether ``request`` takes part in block sharing: always with prefix caching on;
        with it off, only the choices of an n > 1 request (``parent_request_id`` set)."""
        return self.enable_prefix_caching or bool(request.parent_request_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of ``request``: block ids and their token count.

        At least one token is always left to compute (the step that computes it samples the
        next token), so at most ``(num_tokens - 1) // block_size`` blocks are returned. Each hit
        re-checks the block's stored tokens and parent key. Nothing is reserved: pass the
        blocks to ``allocate`` in the same scheduling pass (the scheduler counts the lookup:
        ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``).

        Returns:
            (block ids in logical order, number of tokens they hold = len * block_size).
        """
        if not self.shares_blocks(request):
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hits: list[int] = []
        if max_blocks > 0 and self.cached_blocks:
            hashes = self.block_hashes(request, max_blocks)
            parent = b""
            for j in range(max_blocks):
                block = self.cached_blocks.get(hashes[j])
                if block is None or block.parent_hash != parent or block.token_ids != tuple(
                        request.token_ids_slice(j * bs, (j + 1) * bs)):
                    break
                hits.append(block.block_id)
                parent = hashes[j]
        return hits, len(hits) * bs

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every full block among the first ``num_tokens`` tokens not yet registered.

        A block whose key is already cached (another physical block got there first) stays
        private: the existing entry is kept, as in vLLM.
        """
        num_full = num_tokens // self.block_size
        start = request.num_cached_blocks
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        bs = self.block_size
        tokens = request.token_ids_slice(start * bs, num_full * bs)
        for j in range(start, num_full):
            key = hashes[j]
            if key not in self.cached_blocks:
                block = self.blocks[request.block_ids[j]]
                if block.block_hash is None:
                    block.block_hash = key
                    off = (j - start) * bs
                    block.token_ids = tuple(tokens[off:off + bs])
                    block.parent_hash = hashes[j - 1] if j else b""
                    self.cached_blocks[key] = block
        request.num_cached_blocks = num_full

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = block.token_ids = block.parent_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. the workers restarted with empty KV caches).
        Blocks that requests still hold stay theirs."""
        for block in self.cached_blocks.values():
            block.block_hash = block.token_ids = block.parent_hash = None
        self.cached_blocks.clear()

    # ---- allocation -----------------------------------------------------------------------
    def _num_blocks_to_take(self, request: Request, num_new_tokens: int,
                            computed_block_ids: Sequence[int]) -> int:
        """Blocks ``allocate`` would take off the free list: the missing ones plus hits that
        nobody references (they sit on the free list too)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not computed_block_ids:
            needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
            return max(0, needed - len(request.block_ids))
        if request.block_ids:
            raise ValueError(f"request {request.request_id} already holds blocks")
        needed = self.num_blocks_needed(len(computed_block_ids) * self.block_size + num_new_tokens)
        blocks = self.blocks
        num_free_hits = sum(1 for b in computed_block_ids if blocks[b].ref_count == 0)
        return max(0, needed - len(computed_block_ids)) + num_free_hits

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_block_ids: Sequence[int] = ()) -> bool:
        """Whether ``allocate`` with the same arguments would succeed.

        Raises:
            ValueError: as ``allocate``.
        """
        return self._num_blocks_to_take(request, num_new_tokens, computed_block_ids) <= len(
            self.free_block_ids)

    def allocate(self, request: Request, num_new_tokens: int,
                 computed_block_ids: Sequence[int] = ()) -> list[int]:
        """Grow ``request.block_ids`` to cover ``request.num_computed_tokens + num_new_tokens``
        slots, and register the full blocks among them in the prefix cache.

        ``computed_block_ids`` is a prefix hit from ``get_computed_blocks`` for a request that
        holds no blocks yet: they are prepended to the table (ref_count + 1), the slots count
        from their end, and the caller sets ``num_computed_tokens`` to their token count.

        Returns:
            The newly allocated block ids (empty if the table already covers the slots).

        Raises:
            RuntimeError: not enough free blocks (call ``can_allocate`` first); nothing changes.
            ValueError: ``num_new_tokens`` < 0, or hit blocks for a request that holds blocks.
        """
        num_take = self._num_blocks_to_take(request, num_new_tokens, computed_block_ids)
        if num_take > len(self.free_block_ids):
            raise RuntimeError(
                f"request {request.request_id} needs {num_take} more KV blocks but only "
                f"{len(self.free_block_ids)} are free"
            )
        blocks = self.blocks
        for block_id in computed_block_ids:
            block = blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                num_take -= 1
            block.ref_count += 1
        if computed_block_ids:
            request.block_ids.extend(computed_block_ids)
            request.num_cached_blocks = len(computed_block_ids)
            num_computed = len(computed_block_ids) * self.block_size
        else:
            num_computed = request.num_computed_tokens
        new_block_ids = []
        for _ in range(num_take):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = blocks[block_id]
            assert block.ref_count == 0, f"free block {block_id} has refs"
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            new_block_ids.append(block_id)
        request.block_ids.extend(new_block_ids)
        num_tokens = min(num_computed + num_new_tokens, request.num_tokens)
        if self.shares_blocks(request):
            self._cache_full_blocks(request, num_tokens)
        else:  # NOTE: nothing to register, but the scheduler's fast path reads the count
            request.num_cached_blocks = num_tokens // self.block_size
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release every block of ``request`` and clear its block table. Cached blocks keep
        their prefix key on the free list until allocation evicts them (with prefix caching
        off, a block nobody holds any more loses its key at once).

        Calling it twice is harmless (the table is empty the second time).

        Raises:
            AssertionError: a block in the table was already free (a double free elsewhere).
        """
        # NOTE: free the tail first, so the free list gets the request's last blocks before its
        # first: a shared prefix's first blocks are evicted last.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if not self.enable_prefix_caching and block.block_hash is not None:
                    self._evict(block)  # NOTE: without prefix caching nothing outlives its users
        # NOTE: a new list, not .clear(): messages already sent may hold the old list object.
        request.block_ids = []
        request.num_cached_blocks = 0

    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        """Assert the exact accounting (O(num_blocks); for tests and debugging).

        With ``requests`` (every request that holds blocks), also assert that each block's
        ``ref_count`` equals the number of block tables that list it.

        Raises:
            AssertionError: with a message naming the inconsistency.
        """
        free = self.free_block_ids
        num_used = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
            if block.block_id in free:
                assert block.ref_count == 0, f"free block {block.block_id} has refs"
            else:
                assert block.ref_count > 0, f"block {block.block_id} leaked (no refs, not free)"
                num_used += 1
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, (
                    f"block {block.block_id} has a key that the cache maps elsewhere")
        assert self.num_free_blocks + num_used == self.num_blocks
        for key, block in self.cached_blocks.items():
            assert block.block_hash == key, f"cache key of block {block.block_id} is stale"
        if requests is not None:
            refs = [0] * self.num_blocks
            for request in requests:
                assert len(set(request.block_ids)) == len(request.block_ids), (
                    f"request {request.request_id} lists a block twice")
                for block_id in request.block_ids:
                    refs[block_id] += 1
            for block in self.blocks:
                assert refs[block.block_id] == block.ref_count, (
                    f"block {block.block_id}: ref_count {block.ref_count} but "
                    f"{refs[block.block_id]} block tables list it"
                )
