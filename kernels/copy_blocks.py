"""Copy whole KV blocks inside the paged cache: copy-on-write of a shared partial block.

Beam search forks a sequence's block table: two beams then read the same physical blocks.
Before one of them writes into a shared partial last block, the scheduler gives it a fresh
block and asks every rank to copy the shared block's contents there (vLLM's ``copy_blocks``)::

    before:  beam a  [b0 b1 b2]         beam b  [b0 b1 b2]        b2 partial, shared
    copy:    b2 -> b7 in every layer's K and V
    after:   beam a  [b0 b1 b2]         beam b  [b0 b1 b7]        each writes its own

This package imports nothing from ``services/``.
"""

from collections.abc import Iterable

import torch


def copy_blocks(
    caches: Iterable[torch.Tensor],  # each [num_blocks, ...] (a layer's K or V cache)
    src: torch.Tensor,  # [N] int64, block ids read
    dst: torch.Tensor,  # [N] int64, block ids written
) -> None:
    """``cache[dst[i]] = cache[src[i]]`` for every ``i`` and every tensor of ``caches``, in place.

    Shapes and dtypes: any cache tensor whose dim 0 is the block id (the KV cache layout,
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, or a view of one half of a combined
    K/V tensor), of any dtype; ``src``, ``dst`` on the caches' device. One gather
    (``index_select``) and one scatter (``index_copy_``) per tensor, whatever ``N``.

    The copies read every source before writing any destination, so they equal copying the
    pairs one by one in order only when no destination is also a source and every destination
    is distinct (what the scheduler guarantees and the worker checks, see
    ``services/worker/step_input.check_block_copies``).

    Raises:
        IndexError / RuntimeError: a block id outside ``[0, num_blocks)`` (from torch; on CUDA
            a device-side assert, so callers check ids first).
    """
    for cache in caches:
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            cache = cache.view(torch.uint8)  # (CPU index_copy_ has no float8 kernel)
        cache.index_copy_(0, dst, cache.index_select(0, src))
