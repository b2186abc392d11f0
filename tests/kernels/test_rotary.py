"""Rotary embedding (torch and Triton) against the float64 reference.

Query and key are views into one fused qkv tensor, as in the model (token stride > heads *
head_dim), and are rotated in place. ``inv_freq`` comes from the model's ``rope_inv_freq``, so
the default, linear and Meta Llama 3.1 ("llama3") scalings are all covered; positions reach 8191.
On CPU the Triton kernel runs under TRITON_INTERPRET=1 (conftest.py).
"""

import pytest
import torch

from kernels import reference_rotary_embedding, torch_rotary_embedding, triton_rotary_embedding
from services.worker.models.llama import LlamaConfig, rope_inv_freq
from tests.kernels.test_paged_attention import TOLERANCES

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

BACKENDS = {"torch": torch_rotary_embedding, "triton": triton_rotary_embedding}
# NOTE: the Triton interpreter computes bfloat16 arithmetic on the raw bits (see
# test_paged_attention.py), so Triton bfloat16 runs on CUDA only.
DTYPE_PARAMS = [
    pytest.param(backend, dtype, id=f"{backend}-{str(dtype)[6:]}")
    for backend in BACKENDS
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    if backend == "torch" or dtype != torch.bfloat16 or CUDA
]
ROPE_SCALINGS = {
    "default": (10000.0, None),
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3": (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# (num_heads, num_kv_heads) per head_dim: GQA ratios of SmolLM2 (9/3), Llama 3 (32/8 -> 8/2), MQA
HEADS = {64: (9, 3), 128: (8, 2), 256: (4, 1)}
MAX_POSITION = 8192


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_inv_freq(head_dim: int, scaling: str) -> torch.Tensor:
    theta, rope_scaling = ROPE_SCALINGS[scaling]
    cfg = LlamaConfig(vocab_size=8, hidden_size=head_dim, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=head_dim,
                      rope_theta=theta, rope_scaling=rope_scaling)
    return rope_inv_freq(cfg).to(DEVICE)  # [head_dim // 2] float32


def make_qk(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """query [T, H, D] and key [T, K, D] as views into a fused qkv [T, (H + 2K) * D], like the
    model's split of ``qkv_proj``'s output."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)


def make_positions(num_tokens: int) -> torch.Tensor:
    edges = torch.tensor([0, 1, MAX_POSITION - 1])
    return torch.cat([edges, torch.randint(0, MAX_POSITION, (num_tokens - 3,))]).to(DEVICE)


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
@pytest.mark.parametrize("head_dim", sorted(HEADS))
@pytest.mark.parametrize("backend,dtype", DTYPE_PARAMS)
def test_rotary_embedding(backend, dtype, head_dim, scaling):
    num_heads, num_kv_heads = HEADS[head_dim]
    query, key = make_qk(7, num_heads, num_kv_heads, head_dim, dtype)
    positions, inv_freq = make_positions(7), make_inv_freq(head_dim, scaling)
    expected_q = reference_rotary_embedding(positions, query, inv_freq)
    expected_k = reference_rotary_embedding(positions, key, inv_freq)
    assert BACKENDS[backend](positions, query, key, inv_freq) is None  # in place
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(query.double(), expected_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(key.double(), expected_k, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_table_made_once_gives_the_same_rotation(dtype):
    """The models compute cos/sin once per step (``AttentionBackend.rotary_table``) and every
    layer applies them: bitwise what each layer computing its own gives."""
    from services.worker.attention import AttentionBackend

    query, key = make_qk(11, 9, 3, 64, dtype)
    q2, k2 = query.clone(), key.clone()
    positions, inv_freq = make_positions(11), make_inv_freq(64, "llama3")
    torch_rotary_embedding(positions, query, key, inv_freq)
    backend = AttentionBackend("torch")
    rope = backend.rotary_table(positions, inv_freq)
    assert rope.cos_sin is not None and rope.cos_sin[0].dtype == torch.float32
    backend.rotary_embedding(rope, q2, k2)
    assert torch.equal(query, q2) and torch.equal(key, k2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_torch_path(dtype):
    """The CUDA path against the CPU production path, and only q/k of the qkv buffer change."""
    query, key = make_qk(9, 9, 3, 64, dtype)
    qkv = query.as_strided((9, query.stride(0)), (query.stride(0), 1))  # the whole fused row
    v_before = qkv[:, 15 * 64:].clone()
    q2, k2 = query.clone(), key.clone()
    positions, inv_freq = make_positions(9), make_inv_freq(64, "llama3")
    triton_rotary_embedding(positions, query, key, inv_freq)
    torch_rotary_embedding(positions, q2, k2, inv_freq)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(query, q2, atol=atol, rtol=rtol)
    torch.testing.assert_close(key, k2, atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, 15 * 64:], v_before)


def test_position_zero_is_identity_and_int32_positions():
    query, key = make_qk(4, 4, 2, 128, torch.float32)
    q0, k0 = query.clone(), key.clone()
    triton_rotary_embedding(torch.zeros(4, dtype=torch.int32, device=DEVICE), query, key,
                            make_inv_freq(128, "default"))
    assert torch.equal(query, q0) and torch.equal(key, k0)


def test_empty_batch():
    query, key = make_qk(0, 4, 2, 64, torch.float32)
    triton_rotary_embedding(make_positions(3)[:0], query, key, make_inv_freq(64, "default"))


def test_rejects_bad_inputs():
    query, key = make_qk(3, 4, 2, 64, torch.float32)
    positions, inv_freq = make_positions(3), make_inv_freq(64, "default")
    with pytest.raises(ValueError, match="inv_freq"):
        triton_rotary_embedding(positions, query, key, inv_freq[:16])
    with pytest.raises(ValueError, match="inv_freq"):
        torch_rotary_embedding(positions, query, key, inv_freq[:16])
    with pytest.raises(ValueError, match="float32"):
        triton_rotary_embedding(positions, query, key, inv_freq.double())
    with pytest.raises(ValueError, match="dtypes"):
        triton_rotary_embedding(positions, query, key.half(), inv_freq)
    with pytest.raises(ValueError, match="num_tokens"):
        triton_rotary_embedding(positions[:2], query, key, inv_freq)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.randn(3, 4, 128, device=DEVICE)[:, :, ::2]  # [3, 4, 64], stride 2
        triton_rotary_embedding(positions, strided, key, inv_freq)


@pytest.mark.skipif(CUDA, reason="the native CPU op; this run's tensors are on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", sorted(HEADS))
def test_native_cpu_rotary_matches_float64_and_torch(isa, dtype, head_dim):
    """``kernels.cpu_attention.cpu_rotary_embedding`` (the cpu backend's RoPE), on every
    instruction-set path this CPU runs: within the dtype's tolerance of the float64
    reference; at float32 bitwise torch's eager result (no fused multiply-add); at 16 bits one
    rounding of the float32 result, at least as accurate as torch's."""
    from kernels.cpu_attention import cpu_rotary_embedding

    num_heads, num_kv_heads = HEADS[head_dim]
    query, key = make_qk(37, num_heads, num_kv_heads, head_dim, dtype)
    positions, inv_freq = make_positions(37), make_inv_freq(head_dim, "llama3")
    expected_q = reference_rotary_embedding(positions, query, inv_freq)
    expected_k = reference_rotary_embedding(positions, key, inv_freq)
    q2, k2 = query.clone(), key.clone()
    assert cpu_rotary_embedding(positions, query, key, inv_freq) is None  # in place
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(query.double(), expected_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(key.double(), expected_k, atol=atol, rtol=rtol)
    torch_rotary_embedding(positions, q2, k2, inv_freq)
    if dtype == torch.float32:
        assert torch.equal(query, q2) and torch.equal(key, k2)
    else:  # one rounding: at least as close to float64 as torch's three
        for ours, theirs, exact in ((query, q2, expected_q), (key, k2, expected_k)):
            assert ((ours.double() - exact).abs().max()
                    <= (theirs.double() - exact).abs().max())


@pytest.mark.skipif(CUDA, reason="the native CPU op")
def test_native_cpu_rotary_refuses_bad_input():
    from kernels.cpu_attention import cpu_rotary_embedding
    from kernels.torch_ops import torch_rope_cos_sin

    query, key = make_qk(3, 9, 3, 64, torch.float32)
    positions, inv_freq = make_positions(3), make_inv_freq(64, "default")
    with pytest.raises(ValueError, match="inv_freq"):
        cpu_rotary_embedding(positions, query, key, inv_freq[:16])
    with pytest.raises(ValueError, match="share float32"):
        cpu_rotary_embedding(positions, query, key.half(), inv_freq)
    cos, sin = torch_rope_cos_sin(positions[:2], inv_freq)
    with pytest.raises(ValueError, match="cos and sin must be"):
        cpu_rotary_embedding(positions, query, key, inv_freq, cos_sin=(cos, sin))
    assert cpu_rotary_embedding(positions[:0], query[:0], key[:0], inv_freq) is None
