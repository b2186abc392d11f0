"""LoRA adapters as the services name them (vLLM's ``LoRARequest``). Torch-free: the router
registers adapters, the scheduler carries them with requests, the worker loads them from
``path`` (``services/worker/lora/``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's LoRARequest): a router-unique id (>= 1; 0 is
    never used: no adapter), its name, and the PEFT folder the worker loads it from."""
    lora_id: int
    name: str
    path: str
