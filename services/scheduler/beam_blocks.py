"""The block manager's part for beam search (``beam_search_groups.py``): a child beam forks
its parent's block tables, and a beam that writes into a block another table still lists gets
a copy first (copy-on-write; Kwon et al., SOSP 2023, §4.4). Functions of a ``BlockManager``
(``block_manager.py``), whose free list and reference counts they use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.scheduler.request import Request

if TYPE_CHECKING:
    from services.scheduler.block_manager import BlockManager


def can_allocate_all(bm: BlockManager, writers: Sequence[tuple[Request, int]]) -> bool:
    """Whether ``copy_on_write`` then ``allocate`` for each (request, num_new_tokens) of
    ``writers`` in turn (requests that hold blocks: a beam group's step) would succeed."""
    num_take, skipped = num_copies_needed(bm, writers), []
    for request, num_new in writers:
        _, take, skip = bm._plan(request, num_new, ())
        num_take += take
        skipped += skip
    return num_take <= bm._room(skipped)


def fork(bm: BlockManager, dst: Request, src: Request) -> None:
    """Give ``dst`` a copy of ``src``'s block tables (beam search: a child beam takes its
    parent's KV): every listed block gains a reference, ``dst``'s own blocks lose theirs,
    and ``dst`` takes ``src``'s prefix-cache bookmark (its tokens must extend ``src``'s).
    A partial last block is then shared until one of them writes into it
    (``copy_on_write``).

    Cost: O(blocks of ``src`` + blocks of ``dst``).
    """
    blocks = bm.blocks
    tables = [list(t) for t in src.block_ids]
    for table in tables:
        for block_id in table:
            if block_id >= 0:
                blocks[block_id].ref_count += 1  # (listed by src: never on the free list)
    bm.free(dst)
    dst.block_ids = tables
    dst.num_cached_blocks = src.num_cached_blocks
    dst.block_hashes = list(src.block_hashes)


def _shared_writes(bm: BlockManager, request: Request, num_new_tokens: int
                   ) -> list[tuple[int, int]]:
    """The (group, j) table entries a step writing tokens ``num_computed_tokens ..
    + num_new_tokens - 1`` writes into while another table lists the same block."""
    bs, c = bm.block_size, request.num_computed_tokens
    if not request.block_ids or num_new_tokens <= 0:
        return []
    end = min(len(request.block_ids[0]), bm.num_blocks_needed(c + num_new_tokens))
    blocks = bm.blocks
    return [(g, j) for g, table in enumerate(request.block_ids) for j in range(c // bs, end)
            if table[j] >= 0 and blocks[table[j]].ref_count > 1]


def num_copies_needed(bm: BlockManager, writers: Sequence[tuple[Request, int]]) -> int:
    """Blocks ``copy_on_write`` takes when each (request, num_new_tokens) of ``writers`` is
    scheduled in turn: a shared block written by m of them costs m copies if some other
    table also lists it, else m - 1 (the last writer finds it its own)."""
    written: dict[int, int] = {}
    for request, num_new in writers:
        for g, j in _shared_writes(bm, request, num_new):
            block_id = request.block_ids[g][j]
            written[block_id] = written.get(block_id, 0) + 1
    blocks = bm.blocks
    return sum(m if blocks[b].ref_count > m else m - 1 for b, m in written.items())


def copy_on_write(bm: BlockManager, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
    """Before ``request`` writes its next ``num_new_tokens`` tokens: give it a private
    copy of every block in that range that another table still lists (a beam's partial
    last block after a fork). The new block replaces the entry; the shared one loses a
    reference. The workers must copy the K/V (the returned pairs) before the step's
    forward.

    Returns:
        (src, dst) block id pairs, in table order; [] when nothing is shared.

    Raises:
        RuntimeError: no free block for a copy (check ``num_copies_needed``); the copies
            made before it stay made.
    """
    pairs = []
    blocks = bm.blocks
    for g, j in _shared_writes(bm, request, num_new_tokens):
        if not bm.free_block_ids:
            raise RuntimeError(f"request {request.request_id} needs a block to copy "
                               "but none is free")
        block_id = bm._take_free().block_id
        table = request.block_ids[g]
        pairs.append((table[j], block_id))
        bm._release(blocks[table[j]])
        table[j] = block_id
    return pairs
