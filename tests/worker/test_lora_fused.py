"""The fused LoRA layers (``services/worker/lora/layers.py``) on the native packed linear:
the shrink a packed layer, B in the base weight's extra columns (written into the packed
layout), SwiGLU's gate still in the epilogue. Each row against a float64 reference of
``x W^T + scale (x A^T) B^T`` at float32 and bfloat16, base rows bitwise the same as without
LoRA; a bf16 runner's greedy tokens of adapters mixed with base rows equal each alone (the
kernels are row invariant), eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.common.lora import LoRARequest
from services.worker.config import WorkerConfig
from services.worker.lora import LoRAConfig
from services.worker.lora.layers import LoRALinear, wrap_lora_layers
from services.worker.model_runner import ModelRunner
from services.worker.models.llama import LlamaConfig, LlamaForCausalLM
from services.worker.packed_linear import PackedLinear, pack_model_linears
from tests.helpers import make_peft_lora
from tests.worker.lora_driver import run_batch

SLOTS, RANK = 3, 4
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 1.6e-2)}  # (test_cpu_linear's)


def _slot_weights(module: LoRALinear, gen: torch.Generator, rank: int):
    """Random ``(A [rank, in], B [out_i, rank])`` of each slice of ``module``."""
    return [(torch.randn(rank, module.in_features, generator=gen) / 4,
             torch.randn(out, rank, generator=gen) / 4) for out in module.slices]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_match_float64(dtype, fuse):
    """Fused (every float model) and unfused (the path of quantized bases, here on plain packed
    ones): each row its own slot's update, or none."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg, None).to(dtype).eval().requires_grad_(False)
    model = LlamaForCausalLM(cfg, None).to(dtype).eval().requires_grad_(False)
    model.load_state_dict(plain.state_dict())
    ctx = wrap_lora_layers(model, SLOTS, RANK, dtype, fuse=fuse)
    weights = {name: (model.layers[0].get_submodule(name).base.weight[:, :64].double(),
                      getattr(plain.layers[0].get_submodule(name), "weight").double())
               for name in ("attn.qkv_proj", "mlp.gate_up_proj")}
    pack_model_linears(model, lm_head=False, decoder=True)
    pack_model_linears(plain, lm_head=False, decoder=True)
    layer = model.layers[0]
    for name in ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        m = layer.get_submodule(name)
        assert m.fused == fuse and isinstance(m.base, PackedLinear)
        assert isinstance(m.lora_shrink, PackedLinear) if fuse else m.lora_b is not None
    assert layer.mlp.gate_up_proj.base.silu_mul == fuse
    assert isinstance(layer.mlp.act, nn.Identity) == fuse
    gen = torch.Generator().manual_seed(1)
    scales = {0: 0.5, 2: 2.0}  # slot 1 stays empty; slot 2 of a smaller rank
    adapters = {}
    for name in ("attn.qkv_proj", "mlp.gate_up_proj"):
        m = layer.get_submodule(name)
        for slot, rank in ((0, RANK), (2, RANK - 2)):
            adapters[name, slot] = _slot_weights(m, gen, rank)
            for index, (a, b) in enumerate(adapters[name, slot]):
                m.write_slot(slot, index, a.to(dtype), b.to(dtype))
    row_slots = [0, None, 2, 0, None, 2, 2]  # per row: its slot, None = the base model
    mask = torch.zeros(len(row_slots), SLOTS * RANK)
    for t, slot in enumerate(row_slots):
        if slot is not None:
            mask[t, slot * RANK:(slot + 1) * RANK] = scales[slot]
    ctx.mask = mask.to(dtype)
    x = torch.randn(len(row_slots), 64, generator=gen).to(dtype)
    for name in ("attn.qkv_proj", "mlp.gate_up_proj"):
        w = weights[name][0]
        assert torch.equal(w, weights[name][1])  # (the widened weight starts with W)
        want = x.double() @ w.T
        for t, slot in enumerate(row_slots):
            if slot is not None:
                want[t] += scales[slot] * torch.cat([
                    (x[t].double() @ a.to(dtype).double().T) @ b.to(dtype).double().T
                    for a, b in adapters[name, slot]])
        if name == "mlp.gate_up_proj" and fuse:
            gate, up = want.chunk(2, dim=-1)
            want = F.silu(gate) * up
        got = layer.get_submodule(name)(x)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
        if name == "mlp.gate_up_proj" and not fuse:
            continue  # (the plain layer applies the SiLU the unfused one leaves to ``act``)
        base_rows = [t for t, slot in enumerate(row_slots) if slot is None]
        assert torch.equal(got[base_rows], plain.layers[0].get_submodule(name)(x)[base_rows])
        adapter_rows = [t for t, slot in enumerate(row_slots) if slot is not None]
        assert not torch.allclose(got[adapter_rows],
                                  plain.layers[0].get_submodule(name)(x)[adapter_rows])


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_bf16_runner_adapter_rows_mixed_equal_alone(tiny_llama, tmp_path_factory, eager):
    """bf16 (the default dtype on CPUs with native bf16): the packed, fused path through the
    runner; a row's tokens do not depend on the adapters and base rows beside it."""
    root = tmp_path_factory.mktemp("fused-adapters")
    adapters = [LoRARequest(1, "four", make_peft_lora(tiny_llama, root / "four", 4, 1,
                                                      lora_alpha=8)),
                LoRARequest(2, "eight", make_peft_lora(tiny_llama, root / "eight", 8, 2,
                                                       lora_alpha=16, use_rslora=True))]
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="bfloat16", device="cpu",
                                      kv_cache_memory=4 << 20, max_num_seqs=16,
                                      max_num_batched_tokens=256, enforce_eager=eager,
                                      lora=LoRAConfig(max_loras=2, max_lora_rank=8)))
    qkv = runner.model.layers[0].attn.qkv_proj
    assert qkv.fused and isinstance(qkv.base, PackedLinear)
    prompts = [[5, 17, 300, 2, 9], [44, 3, 8, 120, 7, 7, 61, 2, 90, 11, 4]]
    alone = {a: run_batch(runner, prompts, [a] * 2, 5, tag=f"{a and a.name}-")
             for a in (None, *adapters)}
    assert alone[adapters[0]] != alone[None] and alone[adapters[1]] != alone[None]
    cases = [(p, a) for p in range(2) for a in (adapters[1], None, adapters[0])]
    got = run_batch(runner, [prompts[p] for p, _ in cases], [a for _, a in cases], 5,
                    tag="mixed-")
    assert got == [alone[a][p] for p, a in cases]
    if not eager:
        assert runner.forward.source in ("compiled", "loaded", "memory")  # (not a fallback)
