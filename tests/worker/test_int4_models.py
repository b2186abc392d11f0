"""4-bit AWQ and GPTQ checkpoints served as stored (``int4_checkpoints.py``), end to end on a
tiny random Llama: its decoder's linear layers quantized per group (asymmetric, min/max), packed
the way AutoAWQ (``WQLinear_GEMM``) and AutoGPTQ (``pack``) pack them, saved with their
``quantization_config`` as those libraries save it; the reference is transformers' float model
with each linear weight replaced by the checkpoint's dequantized values ``(q - z) * s``:

- detected from config.json (no flag) or named by ``--quantization awq|gptq``; each fused module
  a ``GroupQuantLinear`` on the 4-bit codes; greedy tokens at float32 through the runner
  (chunked prefill, late arrival, preemption) equal the reference's, and the logits within
  float32 rounding of it (the kernel takes the weights exactly);
- GPTQ act-order (``desc_act``: each layer's K permuted by group) and symmetric v1 zeros;
- a mismatched ``--quantization`` and a tensor of the wrong shape are refused, named.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from services.worker.config import WorkerConfig
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.quantized_linear import GroupQuantLinear
from tests.worker.test_int4_checkpoints import (
    pack_awq,
    pack_gptq_weight,
    pack_gptq_zeros,
    quantize,
)
from tests.worker.test_model import drive_greedy, hf_greedy, run_ours

NEW_TOKENS = 12
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_256(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-int4"), hidden_size=256,
                           intermediate_size=512, initializer_range=0.05)


def make_int4_checkpoint(dst, src, method: str, group: int, act_order: bool = False,
                         sym: bool = False):
    """``src`` (a float safetensors Llama) as a 4-bit ``method`` checkpoint in ``dst``; returns
    (``dst``, the reference float folder whose linear weights are the dequantized ones)."""
    state = load_file(src / "model.safetensors")
    out, ref = {}, {}
    gen = torch.Generator().manual_seed(1)
    perms: dict[tuple[str, int], torch.Tensor] = {}  # one act-order per input (shared by q/k/v)
    for name, w in state.items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module not in LINEARS:
            out[name] = ref[name] = w
            continue
        base = name.removesuffix(".weight")
        k = w.shape[1]
        g = k if group == -1 else group
        g_idx = torch.arange(k) // g
        if act_order:  # q/k/v (and gate/up) read the same input: the same order
            key = (base.rsplit(".", 2)[0], k)
            if key not in perms:
                perms[key] = torch.randperm(k, generator=gen)
            g_idx = g_idx[perms[key]]
        q, z, s = quantize(w.float(), g_idx, k // g, sym=sym)  # q [K, N], z / s [K/G, N]
        ref[name] = ((q - z[g_idx]).float() * s.float()[g_idx]).t().contiguous()
        if method == "awq":
            out[f"{base}.qweight"] = pack_awq(q)
            out[f"{base}.qzeros"] = pack_awq(z)
        else:
            out[f"{base}.qweight"] = pack_gptq_weight(q)
            out[f"{base}.qzeros"] = pack_gptq_zeros(z)
            out[f"{base}.g_idx"] = g_idx.to(torch.int32)
        out[f"{base}.scales"] = s
    config = json.loads((src / "config.json").read_text())
    dst.mkdir(parents=True)
    ref_dir = dst.parent / f"{dst.name}-reference"
    shutil.copytree(src, ref_dir)
    save_file(ref, ref_dir / "model.safetensors")
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                         "version": "gemm", "zero_point": True}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4,
                                         "group_size": group, "desc_act": act_order,
                                         "sym": sym, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, dst / "model.safetensors")
    return dst, ref_dir


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 9, 40, 100)]


CASES = [("awq", 128, False, False), ("awq", 32, False, False), ("gptq", 64, False, False),
         ("gptq", 128, True, False), ("gptq", -1, False, True)]


@pytest.mark.parametrize(("method", "group", "act_order", "sym"), CASES)
def test_int4_checkpoint_logits_and_greedy_equal_the_dequantized_reference(
        tiny_256, tmp_path, method, group, act_order, sym, one_torch_thread, caplog):
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    path, ref_dir = make_int4_checkpoint(tmp_path / "ckpt", tiny_256, method, group,
                                         act_order, sym)
    ours, _, info = load_model(str(path), torch.float32, "cpu")
    assert info.quantization == method
    assert (f"of 12 {method.upper()} int4, group {group}"
            f"{', act-order' if act_order else ''} as stored (4-bit codes") in caplog.text
    layer = ours.layers[1]
    for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
              layer.mlp.down_proj):
        assert isinstance(m, GroupQuantLinear) and m.packed.dtype == torch.uint8
        assert (m.perm is not None) == act_order
    reference, _, _ = load_model(str(ref_dir), torch.float32, "cpu", batch_invariant=True)
    prompt = _prompts()[2]
    torch.testing.assert_close(run_ours(ours, prompt), run_ours(reference, prompt),
                               atol=1e-4, rtol=1e-4)
    runner = ModelRunner(WorkerConfig(model=str(path), dtype="float32", device="cpu",
                                      kv_cache_memory=8 << 20))
    prompts = _prompts()
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64,
                           arrivals=[3, 0, 0, 0], preempt=(8, 2))
    hf = HFLlamaForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert outputs == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_int4_flag_and_bad_tensors_are_refused(tiny_256, tiny_llama, tmp_path):
    path, _ = make_int4_checkpoint(tmp_path / "ckpt", tiny_256, "awq", 128)
    with pytest.raises(ValueError, match="is a 4-bit awq checkpoint: --quantization int8"):
        load_model(str(path), torch.float32, "cpu", quantization="int8")
    with pytest.raises(ValueError, match=r"--quantization gptq: .* is not a 4-bit gptq"):
        load_model(str(path), torch.float32, "cpu", quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization awq: .* says nothing"):
        load_model(str(tiny_llama), torch.float32, "cpu", quantization="awq")
    _, _, info = load_model(str(path), torch.bfloat16, "cpu", quantization="awq")
    assert info.quantization == "awq"
    state = load_file(path / "model.safetensors")
    name = "model.layers.2.mlp.down_proj.scales"
    state[name] = state[name][:-1].clone()  # a group short
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.down_proj: .*scales"):
        load_model(str(path), torch.float32, "cpu")
