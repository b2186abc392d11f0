"""Where and in what dtype a worker runs: ``--device`` and ``--dtype`` resolved."""

from __future__ import annotations

import re

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 matmul instructions (AVX512-BF16 or AMX)."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if "AMX" in capability or "BF16" in capability:
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


def resolve_device(device: str) -> torch.device:
    """``"auto"`` = CUDA when available, else CPU; anything else as torch spells it. A CUDA
    device always gets an index (the current device when none is given).

    Raises:
        ValueError: CUDA asked for where torch sees no CUDA device.
        RuntimeError: a device string torch does not know.
    """
    resolved = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device on this machine "
                         f"(torch {torch.__version__}); use --device cpu or auto")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"`` = bfloat16 on CUDA or a CPU with native bf16, else float32.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        native_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native_bf16 else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
