"""What a worker rank's memory goes to: its weights, its KV cache, and the peak of the
activations of its largest step, so an imbalance between ranks (a pipeline stage whose layers
cost more) shows in the start-up log and in the metrics, without a debugger.

- weights: the bytes of the rank's parameters and buffers (its shard, its stage's layers);
- KV cache: ``num_kv_blocks`` x the bytes of one block over the rank's layers (a draft
  model's blocks included);
- peak activations: the most bytes of tensors alive at once during one dummy prefill step
  of ``max_num_batched_tokens`` tokens (spread over ``max_num_seqs`` sequences, as vLLM's
  profiling run; greedy sampling), counting only tensors created during that step (not the
  weights or the KV cache it writes into). On CUDA: the caching allocator's peak over the
  step, less what was allocated before. On CPU, which has no allocator statistics: a
  ``TorchDispatchMode`` that adds the bytes of every new storage an operator returns and
  subtracts them once the last tensor on it is freed, keeping the maximum. Every rank runs
  the step at the same point of its start-up (the stages pass hidden states to each other),
  through the eager model. A single CPU rank skips the step (it has no stages to balance and
  the step costs seconds at every start): its peak is reported as not measured.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from services.common.sampling_params import EngineSamplingParams
from services.common.step import NewRequest, StepInput

log = logging.getLogger(__name__)
_GREEDY = EngineSamplingParams(temperature=0.0)


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """One rank's memory, in bytes."""

    weights_bytes: int
    kv_cache_bytes: int
    peak_activation_bytes: int | None  # None: not measured (a single CPU rank)

    def describe(self) -> str:
        """E.g. ``weights 12.3 MiB, KV cache 16.0 MiB, peak activations 2.1 MiB``."""
        peak = ("not measured" if self.peak_activation_bytes is None
                else f"{self.peak_activation_bytes / 2**20:.1f} MiB")
        return (f"weights {self.weights_bytes / 2**20:.1f} MiB, KV cache "
                f"{self.kv_cache_bytes / 2**20:.1f} MiB, peak activations {peak}")


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages operators created while active (``now``) and their maximum
    (``peak``). An output on the storage of one of the operator's inputs (an in-place op, a
    view) adds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors on it]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in inputs or key == 0:
            return
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self._live[key]


def _fewest_blocks(runner) -> int:
    """The fewest KV blocks of any rank of ``runner``'s group (stages of an uneven split have
    different counts; the measuring step must be the same on all)."""
    ps = getattr(runner, "parallel", None)
    if ps is None or ps.config.world_size == 1:
        return runner.num_kv_blocks
    import torch.distributed as dist
    blocks = torch.tensor([runner.num_kv_blocks], dtype=torch.int64, device=ps.device)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
    return int(blocks.item())


def dummy_lens(runner, num_kv_blocks: int) -> list[int]:
    """Prompt lengths of the measuring step: ``max_num_batched_tokens`` tokens over at most
    ``max_num_seqs`` sequences, fewer where ``num_kv_blocks`` (half of them at most) or
    ``max_model_len`` is smaller."""
    tokens = runner.max_num_batched_tokens
    num_seqs = max(1, min(runner.max_num_seqs, tokens))
    per_seq = min(-(-tokens // num_seqs), max(1, runner.max_model_len - 2))
    blocks_per_seq = per_seq // runner.block_size + 1
    num_seqs = max(1, min(num_seqs, num_kv_blocks // blocks_per_seq // 2))
    return [per_seq] * num_seqs


def _prefill(runner, lens: list[int]) -> None:
    """One prefill step of dummy requests of ``lens`` tokens (greedy: the sampler's own
    sort-free path), then drop them. Their KV goes into blocks 0.., room for ``n + 1``
    tokens each."""
    requests, next_block = [], 0
    groups = len(runner.kv_cache_groups)
    for i, n in enumerate(lens):
        blocks = list(range(next_block, next_block + n // runner.block_size + 1))
        next_block += len(blocks)
        requests.append(NewRequest(f"__memory_{i}", [0] * n, _GREEDY, blocks * groups, 0, n))
    runner.execute_step(StepInput(-2, requests, [], []))
    runner.execute_step(StepInput(-1, [], [], [r.request_id for r in requests]))


def measure(runner) -> MemoryReport:
    """Report the memory of ``runner`` (a ``ModelRunner``, started): the peak activations from
    one dummy step on a rank of a group or on CUDA; not on a single CPU rank (no stages to
    balance; the step would cost seconds at every start, e.g. ~5 s for SmolLM2's 2048 tokens
    on 2 cores).

    Call it on every rank of a group at the same point (the step's collectives and
    pipeline sends need every rank). Uses KV blocks 0.. (not handed out before the
    scheduler connects).
    """
    params = list(runner.model.parameters()) + list(runner.model.buffers())
    weights = sum(t.numel() * t.element_size() for t in params)
    draft = getattr(runner, "draft", None)
    kv = runner.num_kv_blocks * (runner.bytes_per_block
                                 + (draft.bytes_per_block if draft is not None else 0))
    ps = getattr(runner, "parallel", None)
    if runner.device.type != "cuda" and (ps is None or ps.config.world_size == 1):
        report = MemoryReport(weights, kv, None)
        log.info("memory: %s (one CPU rank: no stages to balance, so no dummy step)",
                 report.describe())
        return report
    forward, runner.forward = runner.forward, runner.model  # eager: a dispatch mode sees it
    try:
        lens = dummy_lens(runner, _fewest_blocks(runner))
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
            before = torch.cuda.memory_allocated(runner.device)
            torch.cuda.reset_peak_memory_stats(runner.device)
            _prefill(runner, lens)
            torch.cuda.synchronize(runner.device)
            peak = torch.cuda.max_memory_allocated(runner.device) - before
        else:
            with LiveTensorBytes() as live:
                _prefill(runner, lens)
            peak = live.peak
    finally:
        runner.forward = forward
    report = MemoryReport(weights, kv, max(0, peak))
    log.info("memory: %s (dummy step of %d tokens in %d sequences)", report.describe(),
             sum(lens), len(lens))
    return report
