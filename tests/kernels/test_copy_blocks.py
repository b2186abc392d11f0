"""Block copy (copy-on-write of shared KV blocks) against copying the pairs one by one."""

import pytest
import torch

from kernels import copy_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                  seed: int) -> list[torch.Tensor]:
    """``2 * num_layers`` random caches (each layer's K and V) of ``shape``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(2 * num_layers)]


def reference(caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Copies of ``caches`` with each ``(src, dst)`` of ``pairs`` copied in order, block by
    block."""
    out = [c.clone() for c in caches]
    for cache in out:
        for src, dst in pairs:
            cache[dst] = cache[src].clone()
    return out


def random_pairs(num_blocks: int, n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` pairs: distinct destinations, none of them a source (sources may repeat: one
    block shared by several forks)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    sources, dst = perm[:max(1, n // 2)], perm[num_blocks - n:]
    src = [sources[i] for i in torch.randint(len(sources), (n,), generator=g).tolist()]
    return list(zip(src, dst, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_layers, n", [(1, 1), (3, 5), (4, 17)])
def test_equals_copying_block_by_block(dtype, num_layers, n):
    num_blocks, shape_tail = 40, (16, 2, 8)  # [block_size, num_kv_heads, head_dim]
    caches = random_caches(num_layers, (num_blocks, *shape_tail), dtype, seed=n)
    pairs = random_pairs(num_blocks, n, seed=n)
    expected = reference(caches, pairs)
    src, dst = (torch.tensor(c, dtype=torch.int64, device=DEVICE) for c in zip(*pairs, strict=True))
    copy_blocks(caches, src, dst)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


def test_halves_of_a_combined_kv_tensor_and_no_pairs():
    """K and V as views of one ``[num_blocks, 2, block_size, heads, head_dim]`` tensor (the
    other layout the kernels accept); an empty copy changes nothing."""
    combined = torch.randn(10, 2, 4, 1, 8, device=DEVICE)
    k, v = combined.unbind(1)
    expected = reference([k, v], [(2, 7), (2, 9), (0, 1)])
    copy_blocks([k, v], torch.tensor([2, 2, 0], device=DEVICE),
                torch.tensor([7, 9, 1], device=DEVICE))
    assert torch.equal(k, expected[0]) and torch.equal(v, expected[1])
    before = combined.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_blocks([k, v], empty, empty)
    assert torch.equal(combined, before)

