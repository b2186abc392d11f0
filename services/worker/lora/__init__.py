"""Multi-LoRA on the worker (``--enable-lora``): many PEFT adapters over one base model, the
rows of different adapters in one step (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023).

- ``adapter.py``: reads a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``)
  into per-layer A/B tensors and its scale, this rank's shard of them.
- ``layers.py``: ``LoRALinear``, the wrapper of each targeted linear layer (q/k/v, o,
  gate/up, down) that adds the batched low-rank update of the step's active slots.
- ``manager.py``: the CPU-resident LRU of loaded adapters (``--max-cpu-loras``), the
  ``--max-loras`` active slots, and the per-step row -> slot mapping.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """The worker's LoRA limits (vLLM's flags).

    Attributes:
        max_loras: adapters resident at once, so at most that many distinct adapters per
            step (``--max-loras``).
        max_lora_rank: the largest rank an adapter may have (``--max-lora-rank``); the
            slots are this wide.
        max_cpu_loras: adapters kept loaded in CPU memory, least recently used evicted
            (``--max-cpu-loras``); None = ``max_loras``.

    Raises:
        ValueError: a count below 1, or ``max_cpu_loras < max_loras`` (naming the flags).
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras {self.max_loras} and --max-lora-rank "
                             f"{self.max_lora_rank} must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} must be >= --max-loras "
                             f"{self.max_loras}")

    @property
    def cpu_capacity(self) -> int:
        """Adapters the CPU-resident LRU holds."""
        return self.max_cpu_loras or self.max_loras


class LoRALoadError(ValueError):
    """An adapter could not be loaded; the message names the adapter and the problem. Its
    requests are left out of the step and reported as failed (``LoRAManager.update``); the
    rest of the step runs."""
