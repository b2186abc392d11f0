"""The scheduler's limits and policies (``SchedulerConfig``), checked once at construction.

Each default is written once, here: the scheduler's flags read them (``field_default``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.spec_decode_config import SpeculativeConfig, check_spec_decode_parallelism
from services.scheduler.kv_events_config import KVEventsConfig

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerConfig:
    """Scheduling limits and policies.

    ``async_scheduling`` None (the default) resolves at construction to on where it can run:
    one pipeline stage (``pipeline_parallel_size``, the workers') and no speculative decoding
    (the drafts follow the tokens the last step returned); async scheduling needs step N's
    tokens only where they are sampled, so pipeline parallelism keeps one step per stage in
    flight instead (as in vLLM): ``max_steps_in_flight``.

    Raises:
        ValueError: a limit is < 1 (the ``0 = off`` ones < 0), an unknown policy, async
            scheduling asked for (True) with pipeline parallelism or speculative decoding, or
            speculative decoding with pipeline parallelism (each naming both flags), or KV
            events without prefix caching.
    """

    max_num_seqs: int = 256  # running requests at most (= rows of a decode batch)
    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    max_model_len: int = 8192  # prompt + output tokens of one request
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True  # share full KV blocks of identical prefixes
    scheduling_policy: str = "fcfs"  # "fcfs" (arrival order) or "priority" (lower = sooner)
    long_prefill_token_threshold: int = 0  # most prefill tokens per request per step; 0 = off
    max_num_waiting_requests: int = 1024  # refuse new requests beyond this queue length; 0 = off
    max_num_waiting_tokens: int = 0  # ... or beyond this many queued tokens; 0 = off
    pipeline_parallel_size: int = 1  # the workers' pipeline stages (one step in flight each)
    # schedule requests whose token is still in flight; None = on where it can run (above)
    async_scheduling: bool | None = None
    speculative: SpeculativeConfig | None = None  # speculative decoding (no async scheduling)
    max_loras: int = 1  # distinct LoRA adapters among the running requests (vLLM's max_loras)
    # steps the oldest waiting request may be passed over because its adapter has no slot;
    # then nothing behind it is admitted until it is (lora_admission.py)
    max_lora_skips: int = 32
    # bytes the KV tier on disk may hold, every rank's files (when the workers run one:
    # their --kv-offload-dir); least recently used blocks are evicted beyond it
    kv_offload_size: int = 4 * 2**30
    # KV events (vLLM's --kv-events-config: kv_events.py); None = off
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "pipeline_parallel_size", "max_loras", "max_lora_skips",
                     "kv_offload_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_prefill_token_threshold", "max_num_waiting_requests",
                     "max_num_waiting_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        check_spec_decode_parallelism(self.speculative, self.pipeline_parallel_size)
        if self.kv_events is not None and self.kv_events.enable_kv_cache_events and not (
                self.enable_prefix_caching):
            raise ValueError("--kv-events-config: KV events describe the prefix cache, which "
                             "--no-enable-prefix-caching turns off; drop one of them")
        can_async = self.pipeline_parallel_size == 1 and self.speculative is None
        if self.async_scheduling and not can_async:
            other = ("--speculative-config" if self.speculative is not None else
                     f"--pipeline-parallel-size {self.pipeline_parallel_size}")
            raise ValueError(f"--async-scheduling does not work with {other}: "
                             + ("the drafts follow the tokens the last step returned"
                                if self.speculative is not None else
                                "the earlier stages need each step's sampled tokens"))
        if self.async_scheduling is None:
            self.async_scheduling = can_async

    @property
    def max_steps_in_flight(self) -> int:
        """Steps scheduled before the oldest result is back: one per pipeline stage, or two
        with async scheduling (the one running and the next)."""
        if self.pipeline_parallel_size > 1:
            return self.pipeline_parallel_size
        return 2 if self.async_scheduling else 1
