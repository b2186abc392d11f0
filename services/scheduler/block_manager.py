"""The paged KV cache's bookkeeping: which physical blocks are free, who holds the rest.

Pure Python, no torch (DESIGN.md §3): the worker owns the K/V tensors, the scheduler owns the
block ids. A block holds ``block_size`` consecutive tokens of one request; a request's block
table (``Request.block_ids``) lists its blocks in logical order, so token ``i`` lives in slot
``block_ids[i // block_size] * block_size + i % block_size``.

    num_computed_tokens + num_new_tokens = 21, block_size = 8  ->  ceil(21 / 8) = 3 blocks
    logical block:   0          1          2
    block_ids:     [ 7 ]      [ 2 ]      [ 5 ]       (physical ids, any order)
    tokens:        0 .. 7     8 .. 15    16 .. 20 (+3 free slots for later tokens)

After nano-vllm's BlockManager, minus prefix caching. Reference counts are kept per block so that
prefix caching and parallel sampling (blocks shared between requests) can be added later without
changing the accounting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.request import Request


@dataclass(slots=True)
class Block:
    """One physical KV block. ``ref_count`` = number of block tables that list it."""

    block_id: int
    ref_count: int = 0


class BlockManager:
    """Allocates KV blocks to requests from a free list.

    Invariant (``check_invariants``): every block is either on the free list with
    ``ref_count == 0`` or off it with ``ref_count > 0``, so
    ``num_free_blocks + #{blocks with ref_count > 0} == num_blocks`` at all times.

    Args:
        num_blocks: physical blocks in the KV cache (the minimum over worker ranks).
        block_size: tokens per block.

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is < 1.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # NOTE: allocate from the left, free to the right: a freed block is reused last. That is
        # the LRU order prefix caching will want (recently freed blocks keep their content
        # longest).
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by a request, counted from ref counts (O(num_blocks); for stats and
        leak checks, independent of the free list)."""
        return sum(1 for b in self.blocks if b.ref_count > 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 (empty) .. 1.0 (full)."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether enough blocks are free for ``request`` to cover
        ``request.num_computed_tokens + num_new_tokens`` slots."""
        return self._num_missing_blocks(request, num_new_tokens) <= len(self.free_block_ids)

    def allocate(self, request: Request, num_new_tokens: int) -> list[int]:
        """Append blocks to ``request.block_ids`` until it covers
        ``request.num_computed_tokens + num_new_tokens`` slots.

        Returns:
            The newly added block ids (empty if the table already covers them).

        Raises:
            RuntimeError: not enough free blocks (call ``can_allocate`` first); nothing changes.
            ValueError: ``num_new_tokens`` < 0.
        """
        num_missing = self._num_missing_blocks(request, num_new_tokens)
        if num_missing > len(self.free_block_ids):
            raise RuntimeError(
                f"request {request.request_id} needs {num_missing} more KV blocks but only "
                f"{len(self.free_block_ids)} are free"
            )
        new_block_ids = []
        for _ in range(num_missing):
            block = self.blocks[self.free_block_ids.popleft()]
            assert block.ref_count == 0, f"free block {block.block_id} has refs"
            block.ref_count = 1
            new_block_ids.append(block.block_id)
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release every block of ``request`` and clear its block table.

        Calling it twice is harmless (the table is empty the second time).

        Raises:
            AssertionError: a block in the table was already free (a double free elsewhere).
        """
        # NOTE: free the tail first, so the free list gets the request's last blocks before its
        # first; with prefix caching the shared-prefix blocks are then evicted last.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        # NOTE: a new list, not .clear(): messages already sent may hold the old list object.
        request.block_ids = []

    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        """Assert the exact accounting (O(num_blocks); for tests and debugging).

        With ``requests`` (every request that holds blocks), also assert that each block's
        ``ref_count`` equals the number of block tables that list it.

        Raises:
            AssertionError: with a message naming the inconsistency.
        """
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        num_used = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
            if block.block_id in free:
                assert block.ref_count == 0, f"free block {block.block_id} has refs"
            else:
                assert block.ref_count > 0, f"block {block.block_id} leaked (no refs, not free)"
                num_used += 1
        assert self.num_free_blocks + num_used == self.num_blocks
        if requests is not None:
            refs = [0] * self.num_blocks
            for request in requests:
                for block_id in request.block_ids:
                    refs[block_id] += 1
            for block in self.blocks:
                assert refs[block.block_id] == block.ref_count, (
                    f"block {block.block_id}: ref_count {block.ref_count} but "
                    f"{refs[block.block_id]} block tables list it"
                )
