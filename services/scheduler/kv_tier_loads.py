"""The KV tier's loads as the scheduler's requests see them (``kv_tier.py`` has the tier, the
block manager the blocks): which requests a step's load reports release, and what a request
whose load failed does. Apart from ``kv_tier.py`` because they need the ``BlockManager``,
which needs the tier.
"""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_tier import tier_tokens
from services.scheduler.request import Request


def finish_loads(bm: BlockManager, done: list[int], failed: list[int]) -> list[Request]:
    """Apply loads back from every rank (``BlockManager.finish_load``); returns the requests
    whose last load this was (``kv_load_failed``: one of them failed), once each, in order.
    Loads of requests aborted, finished or preempted since count for nothing."""
    ready: dict[str, Request] = {}
    for block_id, ok in [(b, True) for b in done] + [(b, False) for b in failed]:
        load = bm.finish_load(block_id, ok)
        for request, epoch in load.waiters if load is not None else ():
            if request.epoch != epoch or not request.kv_loads_pending:
                continue  # (aborted, finished or preempted since: it let the block go)
            request.kv_loads_pending -= 1
            request.kv_load_failed |= not ok
            if ok:
                request.kv_loaded_blocks.append(block_id)
            if not request.kv_loads_pending:
                ready[request.request_id] = request
    return list(ready.values())


def look_up_again(bm: BlockManager, request: Request) -> None:
    """A load of running ``request``'s prefix hit failed and every other is back: it keeps its
    place and takes its prefix again. The blocks loaded meanwhile are RAM hits now and the
    failed one a miss (``KVTierIndex.discard``), so the new hit is shorter and fits in the
    blocks it just gave back; where it does not (a sliding window needs blocks the longer hit
    skipped), it computes from the start. Sets ``num_computed_tokens``, the tier's share of the
    hit (the blocks loaded for it count), and (if the workers never saw it) the usage's
    ``num_cached_tokens``."""
    loaded = set(request.kv_loaded_blocks)
    bm.free(request)
    request.num_computed_tokens = 0
    hit, num_hit = bm.get_computed_blocks(request)
    if not bm.can_allocate(request, 0, hit):
        hit, num_hit = [], 0
    bm.allocate(request, 0, hit)  # (none: empty tables; the next step allocates)
    request.num_computed_tokens = num_hit
    request.num_tier_hit_tokens = tier_tokens(
        hit, bm.block_size, loaded | set(bm.tier.in_flight if bm.tier is not None else ()))
    if request.num_tokens_sent == 0:
        request.num_cached_tokens = num_hit
