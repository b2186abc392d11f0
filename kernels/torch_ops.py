"""RMSNorm (with and without the residual add) and rotary embedding in plain torch.

The CPU production path, and the exact math of ``services/worker/models/llama.py`` (which matches
transformers' ``LlamaForCausalLM`` at float32): the Triton versions in ``kernels.triton_norm_rope``
are tested against a float64 reference, and the model runs these on the ``"torch"`` backend.

Algorithms: RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019); rotary
position embedding, rotate-half ("neox") layout (Su et al., "RoFormer: Enhanced Transformer with
Rotary Position Embedding", 2021). Frequency scalings (linear, Meta's Llama 3.1 "llama3") live in
``inv_freq``, computed by the model (``rope_inv_freq``); the ops here only apply it.
"""

import torch


def torch_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))``, normalised in float32, scaled in the weight's
    dtype (the model dtype).

    Returns a new ``[num_tokens, hidden_size]`` tensor in ``weight.dtype``; ``x`` may be wider
    (the float32 residual stream of a bfloat16 model, at the final norm). Math order
    (transformers' ``LlamaRMSNorm`` when ``x`` has the weight's dtype)::

        x32 = x.float();  x32 = x32 * rsqrt(mean(x32**2) + eps)
        out = weight * x32.to(weight.dtype)
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(weight.dtype)


def torch_fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size], the model dtype
    residual: torch.Tensor,  # [num_tokens, hidden_size], float32 or x's dtype
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block boundary: ``residual = x + residual``, then ``rms_norm(residual)``.

    Returns new tensors ``(out, residual_out)``, both ``[num_tokens, hidden_size]``:
    ``residual_out = x + residual`` in the wider of the two dtypes (the models keep the residual
    stream in float32, so a bfloat16 branch output is added without rounding the sum to
    bfloat16), ``out = torch_rms_norm(residual_out, weight, eps)`` in ``weight.dtype``. The
    inputs are not modified (vLLM's ``fused_add_rms_norm`` works in place; ours does not).
    """
    residual = x + residual
    return torch_rms_norm(residual, weight, eps), residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def torch_rope_cos_sin(
    positions: torch.Tensor,  # [num_tokens] int64
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(theta)`` and ``sin(theta)`` of rotate-half RoPE, each ``[num_tokens, 1, head_dim]``
    float32: ``theta = positions * inv_freq`` in float32, repeated over both halves of
    ``head_dim`` (``torch_rotary_embedding`` casts them to the query's dtype, transformers'
    order).

    A model computes them once per step and frequency set and hands them to every layer's
    ``torch_rotary_embedding`` (``cos_sin``). NOTE: a custom op, so that Inductor keeps it one
    kernel: as plain pointwise ops it inlined cos and sin into every layer's RoPE loop and
    evaluated them again for every layer, head and dim of q and k (2.0 s of compare.py's
    workload W on an AMD EPYC at bf16: docs/benchmarks.md, issue 31).
    """
    cos, sin = torch.ops.pagedserve_ops.rope_cos_sin(positions, inv_freq)
    return cos, sin


@torch.library.custom_op("pagedserve_ops::rope_cos_sin", mutates_args=())
def _rope_cos_sin(positions: torch.Tensor,
                  inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


@_rope_cos_sin.register_fake
def _(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], 1, 2 * inv_freq.shape[0])
    return (positions.new_empty(shape, dtype=torch.float32),
            positions.new_empty(shape, dtype=torch.float32))


def torch_rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate ``query`` and ``key`` in place by rotate-half RoPE at ``positions``.

    With ``D = head_dim``, ``x1, x2 = x[..., :D/2], x[..., D/2:]`` and
    ``theta = positions * inv_freq`` (float32; cos/sin computed in float32, then cast to
    ``query.dtype``)::

        x1' = x1 * cos(theta) - x2 * sin(theta)
        x2' = x2 * cos(theta) + x1 * sin(theta)      (in query.dtype: q*cos + rotate_half(q)*sin)

    ``cos_sin``: ``torch_rope_cos_sin(positions, inv_freq)`` computed beforehand (once per
    step for all layers); None computes it here.

    Raises ``ValueError`` if ``2 * len(inv_freq)`` is not ``head_dim`` of both tensors.
    """
    head_dim = query.shape[-1]
    if 2 * inv_freq.shape[0] != head_dim or key.shape[-1] != head_dim:
        raise ValueError(f"inv_freq [{inv_freq.shape[0]}] does not fit head_dim "
                         f"{head_dim} (query) / {key.shape[-1]} (key)")
    cos, sin = cos_sin if cos_sin is not None else torch_rope_cos_sin(positions, inv_freq)
    cos, sin = cos.to(query.dtype), sin.to(query.dtype)
    query.copy_(query * cos + _rotate_half(query) * sin)
    key.copy_(key * cos + _rotate_half(key) * sin)


_ONEDNN_LINEAR_OK = True  # cleared if this torch build's oneDNN linear op fails once


def torch_wide_linear(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [out_features, hidden_size], out_features large (the LM head)
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` without bias) for a wide weight such as the LM head.

    Returns ``[num_tokens, out_features]`` in ``out_dtype`` (default ``x.dtype``). On a CPU at
    float32 it calls oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, what Inductor's CPU
    freezing path uses) instead of ATen's MKL sgemm: for SmolLM2's LM head (``[M, 576] x
    [49152, 576]^T``) it was 1.3-2.5x faster for M = 1..256 on an AMD EPYC with AVX2
    (``docs/benchmarks.md``), where sgemm streams the 113 MB weight poorly. On CUDA with 16-bit
    inputs and a float32 ``out_dtype`` it asks cuBLAS for the float32 result (``torch.mm``'s
    ``out_dtype``), so logits are not rounded to the model dtype. Elsewhere, and if an op is
    missing from the build, it is plain ``F.linear`` (then cast: a 16-bit CPU model's LM head
    is ``services/worker/packed_linear.py``'s, which accumulates into float32 directly).
    """
    global _ONEDNN_LINEAR_OK
    if (_ONEDNN_LINEAR_OK and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()):
        try:
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "").to(
                out_dtype or x.dtype)
        except (RuntimeError, AttributeError, NotImplementedError):
            _ONEDNN_LINEAR_OK = False
    if (x.device.type == "cuda" and out_dtype == torch.float32
            and x.dtype in (torch.bfloat16, torch.float16)):
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # an older torch or cuBLAS: the rounded product below
    return torch.nn.functional.linear(x, weight).to(out_dtype or x.dtype)
