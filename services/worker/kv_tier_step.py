"""The KV tier on disk around a model runner's step: which tier a runner gets (its folder is
named by everything that changes its blocks' bytes) and what a step does with it.

    execute_step(step) with a tier (``run_with_kv_tier``):
        start step.kv_loads (a reader thread)
        copy every load read by now into its block    <- before the forward (and the copies)
        run the step (its LoRA wrapper included)
        queue step.kv_stores for writing              <- after the forward; not the blocks of
                                                         requests the step left out
        copy the loads read during the forward        <- so this step's result reports them,
                                                         a step earlier than the next one's
        report this rank's loads done / failed in the output (every rank its own)

``worker/kv_tier.py`` moves the bytes; the scheduler decides the transfers
(``scheduler/kv_tier.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.common.model_files import resolve_model
from services.common.step import StepInput, StepOutput
from services.worker.kv_tier import KVTier, kv_tier_namespace, model_files_digest, rank_dir

log = logging.getLogger(__name__)

# NOTE: ``runner`` below is a ``ModelRunner`` (not imported: it imports this module)

POLL_WAIT_S = 0.02  # a step that computes nothing (the scheduler's poll) waits for a load


def kv_tier_description(runner: Any) -> dict:
    """Everything that changes a KV block's bytes on ``runner``'s rank, JSON-able: the model's
    files (``model_files_digest``), dtypes, quantization, the cache's layout and the parallel
    shape (``kv_tier_namespace`` digests it).

    NOTE: the attention backend, device type and ``batch_invariant`` are in too: a later
    layer's K/V depends on the earlier layers' attention outputs, whose kernels differ in their
    last bits. Rather a miss than a block that differs from what this rank computes.
    """
    ps = runner.parallel
    tensors = unique_tensors(runner)
    return {
        "model": model_files_digest(resolve_model(runner.config.model).path),
        "dtype": runner.dtype_name, "kv_cache_dtype": str(runner.kv_cache_dtype),
        "kv_cache_dtype_name": runner.kv_cache_dtype_name, "kv_layout": runner.kv_layout,
        "quantization": [runner.config.quantization, runner.weights_quantization],
        "block_size": runner.block_size, "num_kv_heads": runner.num_kv_heads,
        "kv_row": runner.kv_row, "num_kv_pairs": runner.num_kv_pairs,
        "tensors": [[list(t.shape[1:]), str(t.dtype)] for t in tensors],
        "layer_pairs": list(runner._layer_pairs), "layer_groups": list(runner.layer_groups),
        "groups": [[g.sliding_window, list(g.layer_ids)] for g in runner.kv_cache_groups],
        "tensor_parallel_size": ps.config.tensor_parallel_size if ps else 1,
        "pipeline_parallel_size": ps.config.pipeline_parallel_size if ps else 1,
        "attention_backend": runner.attention_backend_name, "device": runner.device.type,
        "batch_invariant": runner.batch_invariant,
    }


def unique_tensors(runner: Any) -> list:
    """The rank's K/V cache tensors, each once, in pair order (a block's bytes are each one's
    ``[block_id]``, in this order)."""
    return list({id(t): t for kv in runner.kv_caches for t in kv}.values())


def build_kv_tier(runner: Any, offload_dir: str) -> KVTier | None:
    """The KV tier of ``runner``'s rank under ``offload_dir`` (None when ""), over its cache
    tensors (``unique_tensors``), with the start-up log line.

    Raises:
        ValueError: a pooling model (``--runner auto`` resolved to it).
        OSError: the rank's folder cannot be made.
    """
    if not offload_dir:
        return None
    if runner.pooler is not None:
        raise ValueError("--kv-offload-dir is not supported with a pooling model "
                         "(--runner pooling, or auto on an embedding checkpoint)")
    ps = runner.parallel
    rank, size = (ps.config.rank, ps.config.tensor_parallel_size) if ps else (0, 1)
    namespace = kv_tier_namespace(kv_tier_description(runner))
    tier = KVTier(rank_dir(offload_dir, namespace, rank, size), namespace,
                  unique_tensors(runner))
    log.info("KV tier on disk: %s (namespace %s), %d bytes per block file",
             tier.rank_dir, namespace, tier.block_bytes)
    return tier


def run_with_kv_tier(tier: KVTier, step: StepInput, run: Callable[[StepInput], StepOutput],
                     lora: Any = None) -> StepOutput:
    """``run(step)`` with the tier's work around it (the module docstring): loads copied in
    before, stores queued after, this rank's load reports in the output. ``lora``: the
    runner's LoRA manager (its ``failed`` requests are left out on every rank), or None."""
    tier.start_loads(step.kv_loads)
    done, failed = tier.apply_ready(POLL_WAIT_S if step.total_num_scheduled_tokens == 0
                                    else 0.0)
    out = run(step)
    if step.kv_stores:
        left_out = set(out.failed_request_ids) | (lora.failed if lora is not None else set())
        tier.store(step.kv_stores, blocks_of(step, left_out))
    # NOTE: a load's block is no request's until it is reported, so it may be written between
    # two steps as well as before a forward; a forward is long enough to read most loads
    more_done, more_failed = tier.apply_ready(0.0)
    out.kv_loads_done, out.kv_loads_failed = done + more_done, failed + more_failed
    return out


def blocks_of(step: StepInput, request_ids: set[str]) -> set[int]:
    """The block ids ``step`` gives the requests ``request_ids`` (those it left out: their
    K/V was never computed)."""
    if not request_ids:
        return set()
    blocks = {b for r in step.new_requests if r.request_id in request_ids for b in r.block_ids}
    blocks.update(b for c in step.cached_requests if c.request_id in request_ids
                  for b in c.new_block_ids)
    return blocks
