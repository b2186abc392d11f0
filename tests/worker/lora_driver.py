"""Helpers of the LoRA tests, free of pytest imports (the TP test runs ``tp_rank`` in spawned
processes): transformers + PEFT's greedy tokens (a tiny model's, SmolLM2's with a random
adapter), and a minimal scheduler that runs requests (each with its adapter or none) through a
``ModelRunner``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from services.common.lora import LoRARequest
from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput

GREEDY = EngineSamplingParams(temperature=0.0)


def reference_greedy(base: Path, adapter: Path | None, prompts: list[list[int]],
                     max_new_tokens: int) -> list[list[int]]:
    """transformers (+ PEFT with ``adapter``, None = the base model) greedy tokens at
    float32, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def greedy_past_eos(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``model``'s (transformers or PEFT) greedy tokens, past EOS as the worker samples them
    with ``ignore_eos`` (generate's ``min_new_tokens`` would mask EOS instead, SmolLM2's first
    token of some prompts): one whole forward per token, one prompt at a time."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(new_tokens):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def smollm2_lora_reference(adapter_dir: Path, prompts: list[list[int]], new_tokens: int,
                           r: int = 8, lora_alpha: int = 16
                           ) -> tuple[list[list[int]], list[list[int]]]:
    """Write a random PEFT LoRA adapter (rank ``r``, seed 0, every projection) of SmolLM2
    (the packaged GGUF, float32) into ``adapter_dir``; return (the base model's, the
    adapter's) greedy tokens of ``prompts`` (``greedy_past_eos``), by transformers + PEFT.

    NOTE: transformers loads the worker's float32 conversion of the GGUF (``convert_gguf``:
    transformers' own GGUF load, saved as safetensors), not the GGUF itself: the same weights
    in ~1 s instead of ~15 s of dequantizing. tests/stack/test_smollm2.py checks the
    conversion against transformers' GGUF load."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from services.common.lora import LORA_MODULES
    from services.common.model_files import resolve_model
    from services.worker.checkpoint import convert_gguf

    model = AutoModelForCausalLM.from_pretrained(convert_gguf(resolve_model(None)),
                                                 dtype=torch.float32).eval()
    want_base = greedy_past_eos(model, prompts, new_tokens)
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, init_lora_weights=False,
                                            target_modules=list(LORA_MODULES))).eval()
    peft.save_pretrained(str(adapter_dir))
    return want_base, greedy_past_eos(peft, prompts, new_tokens)


def run_batch(runner, prompts: list[list[int]], loras: list[LoRARequest | None],
              max_new_tokens: int, step_id: int = 0, tag: str = "r",
              failed: dict[str, str] | None = None) -> list[list[int]]:
    """Prefill every prompt in one step, then decode them together for ``max_new_tokens``
    tokens; each request's blocks are given up front and freed at the end. Returns each
    request's tokens (empty lists on a rank that does not sample, and for a request the
    runner failed: its id and error go into ``failed``)."""
    bs = runner.block_size
    free = list(range(runner.num_kv_blocks))
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    new = []
    for rid, p, lora in zip(ids, prompts, loras, strict=True):
        n = -(-(len(p) + max_new_tokens) // bs) * len(runner.kv_cache_groups)
        blocks = [free.pop() for _ in range(n)]  # (one table per KV cache group, concatenated)
        new.append(NewRequest(rid, list(p), GREEDY, blocks, 0, len(p), lora))
    outputs: list[list[int]] = [[] for _ in prompts]

    def collect(out) -> None:
        for rid, token in zip(out.request_ids, out.sampled_token_ids, strict=True):
            outputs[ids.index(rid)].append(token)
        if failed is not None:
            failed.update(zip(out.failed_request_ids, out.failed_messages, strict=True))

    collect(runner.execute_step(StepInput(step_id, new, [], [])))
    for k in range(1, max_new_tokens):
        cached = [CachedRequest(rid, [], [], False, len(p) + k - 1, 1)
                  for rid, p in zip(ids, prompts, strict=True)]
        collect(runner.execute_step(StepInput(step_id + k, [], cached, [])))
    runner.execute_step(StepInput(step_id + max_new_tokens, [], [], ids))
    return outputs


def tp_rank(rank: int, port: int, model: str, prompts, loras, max_new_tokens: int,
            results, unreadable: str = "") -> None:
    """Rank ``rank`` of a TP=2 group (spawned): run ``run_batch`` with LoRA on; the driver
    puts its tokens and its failed requests (id -> error) in ``results``. Rank 1 cannot load
    the adapter named ``unreadable`` (as if its files were unreadable on its host). (``run_batch``
    sends no new token ids, which a pipeline stage before the last would need.)"""
    from services.worker.config import WorkerConfig
    from services.worker.lora import LoRAConfig, LoRALoadError, manager
    from services.worker.model_runner import ModelRunner
    from services.worker.parallel.distributed import (
        ParallelConfig,
        destroy_distributed,
        init_distributed,
    )

    if unreadable and rank == 1:
        load = manager.load_adapter

        def refuse(lora, *args):
            if lora.name == unreadable:
                raise LoRALoadError(f"LoRA adapter {lora.name!r} ({lora.path}): cannot read "
                                    "adapter_model.safetensors: Permission denied")
            return load(lora, *args)

        manager.load_adapter = refuse
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ps = init_distributed(ParallelConfig(2, 1, rank), torch.device("cpu"), timeout_s=60)
    runner = ModelRunner(WorkerConfig(model=model, dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, max_num_seqs=8,
                                      max_num_batched_tokens=256,
                                      lora=LoRAConfig(max_loras=2, max_lora_rank=16)), ps)
    failed: dict[str, str] = {}
    out = run_batch(runner, prompts, loras, max_new_tokens, failed=failed)
    if ps.config.is_driver:
        results.put((out, failed))
    destroy_distributed()
