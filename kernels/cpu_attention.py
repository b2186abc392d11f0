"""Paged attention and KV-cache write in native C++: the fast CPU path.

Same contracts as ``torch_attention`` (the readable CPU reference; ``kernels/__init__.py`` draws
the index arithmetic), computed by the torch custom ops of ``kernels/csrc/cpu_paged_attention.cpp``
(``torch.ops.pagedserve.paged_attention`` / ``reshape_and_cache``), which ``kernels.cpu_build``
compiles once into the cache and this module loads on first use.

One varlen kernel serves decode, chunked prefill and prefix-hit tails: work items of
(sequence, query tile, KV head, KV split) run in one OpenMP loop. An item holds the G query
heads of its KV head for every token of its tile (GQA: one K/V load for all of them) and walks
its keys through the block table (no gather of the context, no padding) in 512-key chunks, each
as two small matrix products, ``S = Q K^T`` and ``acc += P V``, with a float32 online softmax
between them (FlashAttention-2, Dao 2023): for bf16, AMX tiles through ATen's
``cpublas::brgemm`` on a CPU with AMX, ``vdpbf16ps`` on AVX512-BF16; float32 FMA tiles
otherwise; over an int8 ``"pairs"`` cache, integer products on the int8 values as stored (Q and
P as int16, each row's scale in the epilogue: ``csrc/cpu_attention_i8.h``); over a float8
``"pairs"`` cache, the ``vdpbf16ps`` products on its pairs widened in registers. With a sliding
window an item's keys start at the block of its first row's window, so out-of-window blocks are
skipped (never read). Long contexts are split over KV ranges cut at fixed positions (every
``split_keys`` keys) and merged (flash-decoding, Dao et al. 2023). The block-table cache is
PagedAttention (Kwon et al., SOSP 2023). ``kernels/csrc/cpu_paged_attention.cpp`` has the
details.

Row invariance: a row's chunks and splits sit at fixed positions and each of its sums runs in a
fixed order over its own keys, whatever tile or step it falls in, so a row's output is bitwise
the same after a prefix-cache hit, at another chunk size or in another batch.

Instruction sets: the float32 body is compiled for AVX-512, AVX2+FMA and the baseline, the bf16
bodies for AVX512-BF16 (and AMX through oneDNN), and the best the CPU has runs;
``PAGEDSERVE_CPU_ISA=scalar|avx2|avx512|avx512_bf16|amx|auto`` forces a lower step of the ladder
(read at every call), ``cpu_isa()`` names the one in use.
"""

from __future__ import annotations

import torch

from kernels.kv_layout import layout_code
from kernels.kv_quant import is_quantized

# Environment variable that forces a lower instruction-set path (tests, debugging).
ISA_ENV = "PAGEDSERVE_CPU_ISA"


def _ops():
    from kernels import cpu_build  # NOTE: lazy, so `python -m kernels.cpu_build` runs cleanly

    cpu_build.load()
    return torch.ops.pagedserve


def cpu_isa() -> str:
    """The instruction-set step the native kernels take now: ``"amx"``, ``"avx512_bf16"``,
    ``"avx512"``, ``"avx2"`` or ``"scalar"`` (the best this CPU supports, unless
    ``PAGEDSERVE_CPU_ISA`` asks for a lower one).

    Raises:
        ValueError: ``PAGEDSERVE_CPU_ISA`` is unknown or above what the CPU supports.
    """
    return _ops().cpu_isa()


def cpu_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 accepted)
    kv_layout: str = "rows",
) -> None:
    """Write each token's K/V into its slot ``block_id * block_size + offset``; slot < 0 = skip.

    Values are cast to the cache dtype, or quantized for an int8 / float8 cache
    (``kernels.kv_quant``: an int8 cache is ``[..., head_dim + 1]``, each row's scale code in
    its last byte; ``key`` / ``value`` then stay float32 / bfloat16 / float16). Slots
    must be unique (the scheduler guarantees it). The caches may have any strides with
    ``head_dim`` contiguous (e.g. halves of one combined K/V tensor); offsets are 64-bit.
    ``kv_layout="pairs"`` (bfloat16, dense blocks) stores them in the pair order of
    ``kernels.kv_layout``.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
        IndexError: a slot past ``num_blocks * block_size``.
    """
    dtype = key.dtype if is_quantized(k_cache.dtype) else k_cache.dtype
    if key.dtype != dtype or key.stride(-1) != 1:
        key = key.to(dtype).contiguous()
    if value.dtype != dtype or value.stride(-1) != 1:
        value = value.to(dtype).contiguous()
    _ops().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping.long().contiguous(),
                             layout_code(kv_layout))


def cpu_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context + query tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    plan: object = None,
    split_keys: int = 0,
    sliding_window: int = 0,
    kv_layout: str = "rows",
) -> torch.Tensor:
    """Causal paged attention of each sequence's query tokens over its context.

    Query token ``j`` of sequence ``i`` sits at position ``p = seq_lens[i] - query_len_i + j``
    and attends to key positions ``0 .. p`` (``sliding_window`` 0), or ``max(0, p - W + 1) ..
    p`` for a sliding window ``W > 0`` (Beltagy et al. 2020, "Longformer"; Jiang et al. 2023,
    "Mistral 7B"; transformers' ``kv_idx > q_idx - W``), read through ``block_tables[i]``.

    Returns ``out: [num_tokens, num_heads, head_dim]`` in ``query.dtype`` (float32, bfloat16 or
    float16; the caches must have the same dtype, or be int8 / float8 (``kernels.kv_quant``),
    read as their dequantized values rounded to ``query.dtype``; softmax and accumulation in
    float32). Rows of
    tokens past ``query_start_loc[-1]`` (padding) are zero.

    Args:
        scale: multiplies ``q . k`` (usually ``head_dim ** -0.5``).
        plan: ignored (the torch backend's per-step plan; this kernel plans in C++ per call).
        split_keys: keys per KV split: each query's keys are cut at the multiples of it
            (rounded down to whole 512-key chunks, or to whole blocks below one chunk; at least
            one block) and the parts merged; 0 = the default, 512. Fixed positions, not a
            count per call, so a row's result never depends on the batch.
        max_query_len, max_seq_len: accepted for the common signature; the kernel reads the
            lengths themselves.
        sliding_window: 0 = full causal attention; ``W > 0`` = each query sees its last W
            positions (itself included), and only the blocks holding them are read.
        kv_layout: how the caches order a block's values (``kernels.kv_layout``): ``"rows"``
            or ``"pairs"`` (bfloat16; the AMX / AVX512-BF16 bodies copy its rows straight
            into their tiles, the float32 body unpacks them).

    Requires every ``seq_len >= query_len >= 0`` and ``block_tables.shape[1] * block_size >=
    seq_len``; table entries past a sequence's last block, and (with a sliding window) those of
    blocks wholly before every query's window (block ``j`` with ``(j + 1) * block_size <=
    context_len - W + 1``), may hold anything: -1, an id past the cache (never read).

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, mismatched shapes or
            dtypes, ``query_len > seq_len``, ``split_keys < 0``, ``sliding_window < 0``.
        IndexError: a used block-table entry outside ``[0, num_blocks)``, or a table too short
            for ``seq_len``.
    """
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _ops().paged_attention(
        out, query, k_cache, v_cache, _int32(block_tables), _int32(seq_lens),
        _int32(query_start_loc), float(scale), int(split_keys), int(sliding_window),
        layout_code(kv_layout))
    return out


def cpu_rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``kernels.torch_ops.torch_rotary_embedding`` in one native pass over q and k
    (``kernels/csrc/cpu_rotary.cpp``): bitwise torch's result at float32, rounded once (from
    float32 products) at 16 bits. ``cos_sin``: the step's ``torch_rope_cos_sin`` table, or None
    to compute it here. A compiled forward ran the torch version as an Inductor loop of ~0.1 ms
    a layer on SmolLM2's steps (docs/benchmarks.md, issue 31).

    Raises:
        ValueError: ``2 * len(inv_freq)`` is not ``head_dim``, or shapes / dtypes the op
            refuses.
    """
    from kernels.torch_ops import torch_rope_cos_sin

    head_dim = query.shape[-1]
    if 2 * inv_freq.shape[0] != head_dim or key.shape[-1] != head_dim:
        raise ValueError(f"inv_freq [{inv_freq.shape[0]}] does not fit head_dim "
                         f"{head_dim} (query) / {key.shape[-1]} (key)")
    cos, sin = cos_sin if cos_sin is not None else torch_rope_cos_sin(positions, inv_freq)
    _ops().rotary_embedding(query, key, cos, sin)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous-rows int32 (a no-op for the model runner's tensors)."""
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()
