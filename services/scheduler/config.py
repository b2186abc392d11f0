"""The scheduler's limits and policies (``SchedulerConfig``), checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.spec_decode_config import SpeculativeConfig

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerConfig:
    """Scheduling limits and policies.

    Raises:
        ValueError: a limit is < 1 (the ``0 = off`` ones < 0), or an unknown policy.
    """

    max_num_seqs: int = 256  # running requests at most (= rows of a decode batch)
    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    max_model_len: int = 8192  # prompt + output tokens of one request
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True  # share full KV blocks of identical prefixes
    scheduling_policy: str = "fcfs"  # "fcfs" (arrival order) or "priority" (lower = sooner)
    long_prefill_token_threshold: int = 0  # most prefill tokens per request per step; 0 = off
    max_num_waiting_requests: int = 0  # refuse new requests beyond this queue length; 0 = off
    max_num_waiting_tokens: int = 0  # ... or beyond this many queued tokens; 0 = off
    max_steps_in_flight: int = 1  # steps scheduled before the oldest result (pipeline stages)
    async_scheduling: bool = False  # schedule requests whose token is still in flight
    speculative: SpeculativeConfig | None = None  # speculative decoding (no async scheduling)
    max_loras: int = 1  # distinct LoRA adapters among the running requests (vLLM's max_loras)
    # steps the oldest waiting request may be passed over because its adapter has no slot;
    # then nothing behind it is admitted until it is (lora_admission.py)
    max_lora_skips: int = 32

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "max_steps_in_flight", "max_loras", "max_lora_skips"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("long_prefill_token_threshold", "max_num_waiting_requests",
                     "max_num_waiting_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.speculative is not None and (self.async_scheduling
                                             or self.max_steps_in_flight > 1):
            raise ValueError("speculative decoding needs async_scheduling off and one step in "
                             "flight (the drafts follow the tokens the last step returned)")
