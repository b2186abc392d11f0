"""Paged-attention kernels: the KV-cache write and varlen paged attention.

Three implementations of one contract:

- ``reference``        plain per-sequence torch loop in float64, the spec the others are tested against;
- ``torch_attention``  the CPU production path (batched, one SDPA call per group of rows);
- ``triton_attention`` the GPU production path (one @triton.jit kernel for decode and prefill).

This package imports nothing from ``services/``.

KV cache layout (one pair per layer, see DESIGN.md §3)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot of a token = block_id * block_size + offset_in_block
    block id of token position p of sequence i = block_tables[i, p // block_size]

Any strides are accepted as long as ``head_dim`` is contiguous, so K and V may also be the two
halves of one combined tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.

The batch (one model step) and its index arithmetic::

    sequence i, this step:

        position  0                     context_len_i                 seq_len_i
                  |<---- context_len --->|<------ query_len ------->|
                  [ cached K/V (earlier   | this step's tokens: their |
                  |  steps or prefix hit) | K/V were just written by  |
                  |                       | reshape_and_cache         |
                  |<------------------- seq_len -------------------->|

        query_len_i   = query_start_loc[i + 1] - query_start_loc[i]   (1 = decode, >1 = prefill chunk)
        seq_len_i     = seq_lens[i]                                    (includes the query tokens)
        context_len_i = seq_len_i - query_len_i                        (0 = first prefill chunk)

    query token j (0-based in its chunk) sits at position context_len_i + j and attends to the
    key positions 0 .. context_len_i + j inclusive (causal).

    flat query rows, sequences concatenated in batch order:

        query: [ seq 0: q0 q1 q2 q3 q4 | seq 1: q0 | seq 2: q0 q1 | ... ]
        query_start_loc:  0              5          6              8 ...

Algorithms: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023) for the block-table KV cache; FlashAttention-2 (Dao,
"FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023) for
the online softmax of the Triton kernel.
"""

from kernels.reference import reference_paged_attention, reference_reshape_and_cache
from kernels.torch_attention import torch_paged_attention, torch_reshape_and_cache
from kernels.triton_attention import triton_paged_attention, triton_reshape_and_cache

__all__ = [
    "reference_paged_attention",
    "reference_reshape_and_cache",
    "torch_paged_attention",
    "torch_reshape_and_cache",
    "triton_paged_attention",
    "triton_reshape_and_cache",
]
