"""Model kernels: the KV-cache write, varlen paged attention, RMSNorm and rotary embedding.

Four implementations of each contract:

- ``reference``        plain torch in float64, the spec the others are tested against;
- ``torch_attention``  the CPU production path (batched, one SDPA call per group of rows);
- ``cpu_attention``    native C++ for the CPU (``csrc/``, built by ``cpu_build``; one OpenMP
                       varlen kernel walking K/V blocks through the block table);
- ``triton_attention`` the GPU production path (one @triton.jit kernel for decode and prefill).

and for the per-layer ops (``rms_norm``, ``fused_add_rms_norm`` = residual add + RMSNorm in one
pass, ``rotary_embedding`` = rotate-half RoPE of query and key in place):

- ``torch_ops``        the CPU production path, and the model's exact math (transformers' order);
- ``triton_norm_rope`` the GPU production path (one launch per norm, one per RoPE of q and k).

and ``copy_blocks`` (whole KV blocks copied inside the cache: copy-on-write of a block that
forked sequences share), one torch gather and scatter per cache tensor on every device; and
``triton_int4`` (a 4-bit-weight matmul for the CUDA backend, the codes converted in registers:
tested in the Triton interpreter only, not yet wired into the model).

This package imports nothing from ``services/``.

KV cache layout (one pair per layer; docs/architecture.md, "KV cache layout")::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot of a token = block_id * block_size + offset_in_block
    block id of token position p of sequence i = block_tables[i, p // block_size]

Any strides are accepted as long as ``head_dim`` is contiguous, so K and V may also be the two
halves of one combined tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``. The
native CPU kernels also take the ``"pairs"`` order of a block's values (``kv_layout``: bf16,
dense blocks), in which each (block, KV head) holds K^T and V in bf16 pairs.

The batch (one model step) and its index arithmetic::

    sequence i, this step:

        position  0                     context_len_i                 seq_len_i
                  |<---- context_len --->|<------ query_len ------->|
                  [ cached K/V (earlier   | this step's tokens: their |
                  |  steps or prefix hit) | K/V were just written by  |
                  |                       | reshape_and_cache         |
                  |<------------------- seq_len -------------------->|

        query_len_i   = query_start_loc[i + 1] - query_start_loc[i] (1 = decode, >1 = prefill chunk)
        seq_len_i     = seq_lens[i]                                  (includes the query tokens)
        context_len_i = seq_len_i - query_len_i                      (0 = first prefill chunk)

    query token j (0-based in its chunk) sits at position p = context_len_i + j and attends to
    the key positions 0 .. p inclusive (causal).

    sliding window (every paged attention's trailing ``sliding_window: int = 0``; 0 = the full
    causal attention above): with W > 0 the query at position p attends only the W positions
    max(0, p - W + 1) .. p (itself included; transformers' sliding mask ``kv_idx > q_idx - W``):

        position  0               first        context_len_i              seq_len_i
                  |<-- unneeded -->|<-- W - 1 -->|<-------- query_len -------->|
                  first = max(0, context_len_i - W + 1): query j sees p - W + 1 .. p,
                  so no query sees a key before first; blocks wholly there are skipped

    logical block j of sequence i lies wholly before EVERY query's window when
    (j + 1) * block_size <= context_len_i - W + 1; its block-table entry may hold any int32
    (-1 after the scheduler freed it, or an id >= num_blocks): no kernel reads it, which is
    also the speed-up (O(W) keys per query, not O(p)).

    flat query rows, sequences concatenated in batch order:

        query: [ seq 0: q0 q1 q2 q3 q4 | seq 1: q0 | seq 2: q0 q1 | ... ]
        query_start_loc:  0              5          6              8 ...

Algorithms: RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019); RoPE (Su
et al., "RoFormer", 2021; Meta's Llama 3.1 frequency scaling is folded into ``inv_freq`` by the
model); PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023) for the block-table KV cache; FlashAttention-2 (Dao,
"FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023) for
the online softmax of the Triton kernel; sliding-window attention as in Longformer (Beltagy,
Peters and Cohan, "Longformer: The Long-Document Transformer", 2020) and Mistral 7B (Jiang et
al., "Mistral 7B", 2023).
"""

from kernels.copy_blocks import copy_blocks
from kernels.cpu_attention import cpu_paged_attention, cpu_reshape_and_cache
from kernels.reference import (
    reference_paged_attention,
    reference_reshape_and_cache,
    reference_rms_norm,
    reference_rotary_embedding,
)
from kernels.torch_attention import torch_paged_attention, torch_reshape_and_cache
from kernels.torch_ops import torch_fused_add_rms_norm, torch_rms_norm, torch_rotary_embedding
from kernels.triton_attention import triton_paged_attention, triton_reshape_and_cache
from kernels.triton_norm_rope import (
    triton_fused_add_rms_norm,
    triton_rms_norm,
    triton_rotary_embedding,
)

__all__ = [
    "copy_blocks",
    "cpu_paged_attention",
    "cpu_reshape_and_cache",
    "reference_paged_attention",
    "reference_reshape_and_cache",
    "reference_rms_norm",
    "reference_rotary_embedding",
    "torch_fused_add_rms_norm",
    "torch_paged_attention",
    "torch_reshape_and_cache",
    "torch_rms_norm",
    "torch_rotary_embedding",
    "triton_fused_add_rms_norm",
    "triton_paged_attention",
    "triton_reshape_and_cache",
    "triton_rms_norm",
    "triton_rotary_embedding",
]
