"""KV-cache write (torch and Triton) against the per-token reference: exact copies."""

import pytest
import torch

from kernels import reference_reshape_and_cache, torch_reshape_and_cache, triton_reshape_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = {"torch": torch_reshape_and_cache, "triton": triton_reshape_and_cache}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def run_both(backend, key, value, cache_shape, slot_mapping, cache_dtype):
    """Write with ``backend`` and with the reference into equal random caches; return both."""
    k_cache = torch.randn(cache_shape, device=DEVICE).to(cache_dtype)
    v_cache = torch.randn(cache_shape, device=DEVICE).to(cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    BACKENDS[backend](key, value, k_cache, v_cache, slot_mapping)
    reference_reshape_and_cache(key, value, k_ref, v_ref, slot_mapping)
    return (k_cache, v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_writes_slots_and_skips_padding(backend, dtype, num_kv_heads, block_size):
    num_blocks, head_dim, num_tokens = 7, 64, 23
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[3, 11, 22]] = -1  # padding tokens
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    value = torch.randn_like(key)

    got, expected = run_both(
        backend, key, value, (num_blocks, block_size, num_kv_heads, head_dim), slots, dtype
    )

    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    written = slots[slots >= 0]
    assert torch.equal(got[0].flatten(0, 1)[written], key[slots >= 0])


# NOTE: the Triton interpreter truncates float32 -> bfloat16 instead of rounding to nearest even
# as compiled Triton and torch do, so under it the cast is checked into a float16 cache.
CAST_DTYPE = {"torch": torch.bfloat16,
              "triton": torch.bfloat16 if DEVICE == "cuda" else torch.float16}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_strided_key_value_views_and_cast_to_cache_dtype(backend):
    """K and V as column slices of a fused QKV projection output, written into a 16-bit cache."""
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 9, 6, 2, 64, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    _, key, value = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.arange(40, 40 + num_tokens, device=DEVICE)

    got, expected = run_both(
        backend, key, value, (4, block_size, num_kv_heads, head_dim), slots, CAST_DTYPE[backend]
    )

    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_combined_kv_cache_halves(backend):
    """K and V caches as the halves of one [num_blocks, 2, block_size, H, D] tensor."""
    num_kv_heads, head_dim, block_size = 2, 64, 16
    kv_cache = torch.zeros(5, 2, block_size, num_kv_heads, head_dim, device=DEVICE)
    key = torch.randn(6, num_kv_heads, head_dim, device=DEVICE)
    value = torch.randn_like(key)
    slots = torch.tensor([70, 71, 15, -1, 16, 0], device=DEVICE)

    BACKENDS[backend](key, value, kv_cache[:, 0], kv_cache[:, 1], slots)

    k_ref, v_ref = torch.zeros_like(kv_cache[:, 0]), torch.zeros_like(kv_cache[:, 1])
    reference_reshape_and_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(kv_cache[:, 0], k_ref) and torch.equal(kv_cache[:, 1], v_ref)
