"""``LoRAManager``: which adapter each request runs with, the CPU-resident adapters, the
active slots, and each step's row -> slot mask (S-LoRA's adapter paging, Sheng et al. 2023).

- CPU: an LRU of at most ``--max-cpu-loras`` loaded adapters (``adapter.load_adapter``),
  loaded from its path the first time a request names its id; one evicted while requests
  still use it is loaded again when a step needs it (and is in no slot).
- Failures: a request whose adapter cannot be loaded (its folder vanished or changed since the
  router checked it) is left out of its step and of later ones until the scheduler finishes
  it; the rest of the step runs. Every rank of a parallel group leaves out the same requests.
- Slots: ``--max-loras`` of them in every ``LoRALinear``; a step's adapters are put in slots
  (a copy into the layers' buffers) before its forward, evicting the least recently used
  slots the step does not need. The scheduler admits at most ``--max-loras`` distinct
  adapters per step; a step with more is refused, naming both numbers.

Nothing is shared across adapters: a slot holds one adapter's weights, a row reads only its
own slot (the KV cache is the scheduler's to key by adapter).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn

from services.common.lora import LoRARequest
from services.common.step import StepInput, StepOutput
from services.worker.compiled import MIN_TOKENS
from services.worker.lora import LoRAConfig, LoRALoadError
from services.worker.lora.adapter import LoRAAdapter, SliceOf, load_adapter
from services.worker.lora.layers import SLICES, LoRAContext, LoRALinear

if TYPE_CHECKING:
    from services.worker.parallel.distributed import ParallelState

log = logging.getLogger(__name__)


class LoRAManager:
    """The worker's adapters (the module docstring).

    Args:
        model: this rank's model, wrapped by ``layers.wrap_lora_layers``.
        config: the limits.
        model_config: the base model's ``config.json`` (adapters are checked against it).
        layers: the global indices of this rank's layers, in order.
        slice_of: this rank's part of a base weight under tensor parallelism, or None.
        parallel: this rank's place in a group of several ranks (they agree on which adapters
            failed to load), or None.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, model_config: dict, layers: range,
                 slice_of: SliceOf | None = None, parallel: ParallelState | None = None
                 ) -> None:
        self.config, self.model_config, self.layers, self.slice_of = (
            config, model_config, layers, slice_of)
        self.parallel = parallel
        self.ctx = cast(LoRAContext, model.lora_context)
        self.dtype = self.ctx.mask.dtype
        self.device = next(model.parameters()).device
        # per local layer, its LoRALinear modules and their slices' PEFT targets
        self.modules: list[tuple[int, LoRALinear, tuple[str, ...]]] = [
            (layers[li], getattr(getattr(layer, part), name), SLICES[name])
            for li, layer in enumerate(cast(nn.ModuleList, model.layers))
            for part, name in (("attn", "qkv_proj"), ("attn", "o_proj"),
                               ("mlp", "gate_up_proj"), ("mlp", "down_proj"))]
        self.request_loras: dict[str, LoRARequest] = {}  # request id -> its adapter
        self.failed: set[str] = set()  # requests left out until they are finished
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_id -> loaded, LRU first
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_id -> slot, LRU first
        self.known: dict[int, LoRARequest] = {}  # lora_id -> the adapter last seen under it
        self.scales = torch.zeros(config.max_loras, dtype=torch.float32)  # per slot
        self.loads = 0  # adapters read from disk (tests: the LRU's effect)

    def execute(self, step: StepInput, run: Callable[[StepInput], StepOutput]) -> StepOutput:
        """``run`` (the runner's step) on ``step`` less the requests whose adapter cannot be
        loaded (``update``); the driver reports those in the output's ``failed_request_ids``
        and ``failed_messages``."""
        step, failed = self.update(step)
        out = run(step)
        if self.parallel is None or self.parallel.config.is_driver:
            out.failed_request_ids, out.failed_messages = list(failed), list(failed.values())
        return out

    def update(self, step: StepInput) -> tuple[StepInput, dict[str, str]]:
        """Note the adapters of ``step``'s new requests, forget its finished requests', and
        load every adapter the step runs with that is neither in the CPU LRU nor in a slot
        (so ``set_step`` loads nothing). Call before the runner applies the step.

        A request whose adapter cannot be loaded is left out of the step (the rest of it runs)
        and of every later step until the scheduler finishes it; if the runner held it (an
        evicted adapter read again), the returned step finishes it there. All ranks of a
        parallel group leave out the same requests (``ParallelState.any_rank``).

        Returns:
            The step to run (``step`` itself when nothing is left out) and the requests this
            step failed: request id -> the error, naming the adapter and the problem.
        """
        for request_id in step.finished_request_ids:
            self.request_loras.pop(request_id, None)
            self.failed.discard(request_id)
        loras = {}  # request id -> its adapter, for this step's requests that have one
        for r in step.new_requests:
            self.failed.discard(r.request_id)  # (sent in full: a fresh start, e.g. a new stream)
            self.request_loras.pop(r.request_id, None)
            if r.lora is not None:
                loras[r.request_id] = r.lora
                self._forget_if_renamed(r.lora)
        loras.update((c.request_id, self.request_loras[c.request_id])
                     for c in step.cached_requests if c.request_id in self.request_loras)
        errors = self._load({lora.lora_id: lora for lora in loras.values()})
        failed = {rid: errors[lora.lora_id] for rid, lora in loras.items()
                  if lora.lora_id in errors}
        for r in step.new_requests:
            if r.lora is not None and r.request_id not in failed:
                self.request_loras[r.request_id] = r.lora
        if not failed and not self.failed:
            return step, {}
        held = [c.request_id for c in step.cached_requests if c.request_id in failed]
        for request_id in held:
            del self.request_loras[request_id]
        self.failed.update(failed)
        return replace(
            step, new_requests=[r for r in step.new_requests if r.request_id not in self.failed],
            cached_requests=[c for c in step.cached_requests if c.request_id not in self.failed],
            finished_request_ids=[*step.finished_request_ids, *held]), failed

    def _forget_if_renamed(self, lora: LoRARequest) -> None:
        """Drop the CPU copy and the slot of ``lora``'s id if the worker holds another adapter
        under it: a new scheduler (a restart, a new stream) numbers adapters from 1 again, and
        the id's old weights would otherwise serve the new adapter."""
        known = self.known.get(lora.lora_id)
        if known is not None and known != lora:
            log.info("LoRA adapter id %d is now %r (%s), was %r (%s): read anew",
                     lora.lora_id, lora.name, lora.path, known.name, known.path)
            self.cpu.pop(lora.lora_id, None)
            self.slots.pop(lora.lora_id, None)
        self.known[lora.lora_id] = lora

    def _load(self, needed: dict[int, LoRARequest]) -> dict[int, str]:
        """Load the adapters of ``needed`` (lora_id -> adapter) that are neither in the CPU LRU
        nor in a slot; return lora_id -> the error of each that could not be loaded, here or
        on another rank of the group (every rank then returns the same ids).

        NOTE: every rank loads the same adapters in the same order and drops the same failed
        ones, so the LRUs stay alike and the ranks agree (one all-reduce) only on steps that
        load something.
        """
        for lora_id in needed:  # (first: a load below never evicts one of this step's)
            if lora_id in self.cpu:
                self.cpu.move_to_end(lora_id)
        missing = sorted(i for i in needed if i not in self.cpu and i not in self.slots)
        errors: dict[int, str] = {}
        for lora_id in missing:
            try:
                self._adapter(needed[lora_id])
            except LoRALoadError as e:
                log.warning("%s; its requests fail, the others run", e)
                errors[lora_id] = str(e)
        if missing and self.parallel is not None:
            agreed = self.parallel.any_rank([i in errors for i in missing])
            for lora_id, bad in zip(missing, agreed, strict=True):
                if bad and lora_id not in errors:
                    lora = needed[lora_id]
                    self.cpu.pop(lora_id, None)
                    errors[lora_id] = (f"LoRA adapter {lora.name!r} ({lora.path}) could not be "
                                       "loaded on another worker rank (see its log)")
        return errors

    def set_step(self, request_ids: list[str], num_scheduled_tokens: np.ndarray,
                 num_tokens: int, compiled: bool = False) -> None:
        """Put the step's adapters in slots and set the row -> slot mask.

        Args:
            request_ids: the step's ``B`` requests, in compute order.
            num_scheduled_tokens: ``[B]`` int64, their tokens, in order (the forward's rows).
            num_tokens: the step's tokens (``sum(num_scheduled_tokens)``).
            compiled: the forward is ``compiled.CompiledForward``, which pads a step to at
                least ``MIN_TOKENS`` rows (the padding rows get no adapter).

        Raises:
            ValueError: more distinct adapters than ``--max-loras`` (naming both numbers).
        """
        loras = [self.request_loras.get(r) for r in request_ids]
        needed = {lora.lora_id: lora for lora in loras if lora is not None}
        if len(needed) > self.config.max_loras:
            raise ValueError(f"a step has {len(needed)} distinct LoRA adapters, more than "
                             f"--max-loras {self.config.max_loras}")
        for lora in needed.values():
            self._activate(lora, needed)
        slot_of = [self.slots[lora.lora_id] if lora is not None else self.config.max_loras
                   for lora in loras]
        num_rows = max(num_tokens, MIN_TOKENS) if compiled else num_tokens
        token_slots = np.full(num_rows, self.config.max_loras, dtype=np.int64)
        n = int(num_scheduled_tokens.sum())
        token_slots[:n] = np.repeat(np.asarray(slot_of, dtype=np.int64), num_scheduled_tokens)
        s, r = self.config.max_loras, self.config.max_lora_rank
        table = torch.zeros(s + 1, s, r, dtype=torch.float32)  # row s: no adapter
        table[torch.arange(s), torch.arange(s)] = self.scales[:, None]
        index = torch.from_numpy(token_slots)
        self.ctx.mask = table.view(s + 1, s * r)[index].to(self.device, self.dtype)

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """``lora`` loaded (from the CPU LRU, else from its path, evicting the LRU's oldest
        first: so a load that fails evicts as one that succeeds, and the ranks' LRUs stay
        alike).

        Raises:
            LoRALoadError: it is not in the LRU and cannot be loaded (naming it and why).
        """
        adapter = self.cpu.get(lora.lora_id)
        if adapter is not None:
            self.cpu.move_to_end(lora.lora_id)
            return adapter
        while len(self.cpu) >= self.config.cpu_capacity:
            evicted, _ = self.cpu.popitem(last=False)
            log.info("LoRA adapter id %d evicted from CPU memory (--max-cpu-loras %d)",
                     evicted, self.config.cpu_capacity)
        adapter = load_adapter(lora, self.model_config, self.config.max_lora_rank, self.dtype,
                               self.layers, self.slice_of)
        self.loads += 1
        self.cpu[lora.lora_id] = adapter
        log.info("LoRA adapter %r (id %d, rank %d, scale %g) loaded from %s", lora.name,
                 lora.lora_id, adapter.rank, adapter.scale, lora.path)
        return adapter

    def _activate(self, lora: LoRARequest, keep: dict[int, LoRARequest]) -> None:
        """Put ``lora`` in a slot if it is in none: a free slot, else the least recently used
        one whose adapter is not in ``keep`` (this step's)."""
        if lora.lora_id in self.slots:
            self.slots.move_to_end(lora.lora_id)
            return
        used = set(self.slots.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slots if i not in keep)
            slot = self.slots.pop(victim)
        adapter = self._adapter(lora)
        self._copy_into(slot, adapter)
        self.slots[lora.lora_id] = slot

    @torch.inference_mode()
    def _copy_into(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter``'s weights into ``slot`` of every layer (zeros where it has none,
        and past its rank)."""
        for layer, module, targets in self.modules:
            for index, target in enumerate(targets):
                # (its own rank: rank_pattern may vary it; None: zeros)
                a, b = adapter.weights.get((layer, target), (None, None))
                module.write_slot(slot, index, a, b)
        self.scales[slot] = adapter.scale


def make_lora_manager(model: nn.Module, config: LoRAConfig, model_config: dict,
                      parallel) -> LoRAManager:
    """The manager of this rank (``parallel``: its ``ParallelState``, or None): its layers'
    global indices and, under tensor parallelism, its shard of each adapter weight."""
    from services.worker.parallel.sharding import ShardPlan

    cfg = cast(Any, model).config  # (a LlamaConfig or Gemma3Config)
    if parallel is None or parallel.config.world_size == 1:
        return LoRAManager(model, config, model_config, range(cfg.num_hidden_layers))
    plan = ShardPlan(cfg, parallel.config)
    return LoRAManager(model, config, model_config, plan.layers,
                       plan.slice_of if parallel.config.tensor_parallel_size > 1 else None,
                       parallel)
