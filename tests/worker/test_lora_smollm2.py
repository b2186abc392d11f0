"""SmolLM2-135M-Instruct (the packaged GGUF, float32) with a random PEFT adapter on every
targeted projection: the worker's greedy tokens of adapter rows mixed with base rows equal
transformers + PEFT exactly."""

from __future__ import annotations

from services.common.lora import LoRARequest
from services.worker.config import WorkerConfig
from services.worker.lora import LoRAConfig
from services.worker.model_runner import ModelRunner
from tests.worker.lora_driver import run_batch, smollm2_lora_reference

PROMPTS = [[1, 9690, 314, 260, 3575, 282, 4649, 47], [504, 3458, 5945, 28, 253, 6550]]
NEW_TOKENS = 8


def test_smollm2_adapter_and_base_rows_equal_peft(tmp_path):
    want_base, want_lora = smollm2_lora_reference(tmp_path / "adapter", PROMPTS, NEW_TOKENS)
    assert want_lora != want_base
    runner = ModelRunner(WorkerConfig(model=None, dtype="float32", device="cpu",
                                      kv_cache_memory=64 << 20, max_num_seqs=8,
                                      max_num_batched_tokens=256, enforce_eager=True,
                                      lora=LoRAConfig(max_loras=1, max_lora_rank=8)))
    adapter = LoRARequest(1, "smol", str(tmp_path / "adapter"))
    got = run_batch(runner, PROMPTS * 2, [adapter, adapter, None, None], NEW_TOKENS)
    assert got == want_lora + want_base
