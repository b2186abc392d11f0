"""SmolLM2-135M-Instruct (the packaged GGUF, float32) with a random PEFT adapter on every
targeted projection: the worker's greedy tokens of adapter rows mixed with base rows equal
transformers + PEFT exactly."""

from __future__ import annotations

import pytest
import torch

from services.common.lora import LoRARequest
from services.common.model_files import resolve_model
from services.worker.lora import LoRAConfig
from services.worker.model_runner import ModelRunner
from tests.worker.lora_driver import run_batch

PROMPTS = [[1, 9690, 314, 260, 3575, 282, 4649, 47], [504, 3458, 5945, 28, 253, 6550]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_smol():
    from transformers import AutoModelForCausalLM

    src = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file,
                                                dtype=torch.float32).eval()


def _greedy(model, prompts) -> list[list[int]]:
    """transformers' greedy tokens, past EOS as the worker samples them (generate's
    ``min_new_tokens`` would mask EOS instead, SmolLM2's first token of prompt 0)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def test_smollm2_adapter_and_base_rows_equal_peft(hf_smol, tmp_path):
    from peft import LoraConfig, get_peft_model

    want_base = _greedy(hf_smol, PROMPTS)
    torch.manual_seed(0)
    peft = get_peft_model(hf_smol, LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"])).eval()
    peft.save_pretrained(str(tmp_path / "adapter"))
    want_lora = _greedy(peft, PROMPTS)
    assert want_lora != want_base
    runner = ModelRunner(None, dtype="float32", device="cpu", kv_cache_memory=64 << 20,
                         max_num_seqs=8, max_num_batched_tokens=256, enforce_eager=True,
                         lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    adapter = LoRARequest(1, "smol", str(tmp_path / "adapter"))
    got = run_batch(runner, PROMPTS * 2, [adapter, adapter, None, None], NEW_TOKENS)
    assert got == want_lora + want_base
