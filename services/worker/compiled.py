"""The compiled forward: ``torch.compile`` (TorchDynamo + Inductor) of the model's forward on CPU.

One graph per model, for every step. Attention and the KV-cache write are the native CPU kernels'
``torch.library`` custom ops (``torch.ops.pagedserve.paged_attention`` / ``reshape_and_cache``,
with mutation schemas and Meta kernels), so Dynamo traces through all layers without a graph
break and Inductor fuses everything between them (the norms, RoPE, the SiLU gate, residual
adds) into a few C++ loops per layer; the matmuls stay ATen/oneDNN calls.

Dynamic shapes, one graph: the token count ``T``, the batch dimensions of the attention
metadata (sequences, block-table width) and the caches' block count are marked dynamic, so a step of any size reuses the
graph compiled at warm-up. Two torch settings make that hold:

- ``backed_size_oblivious``: a dynamic size is not specialised when a step has exactly 1 of
  something (one sequence, a one-block table), so such steps need no graph of their own;
- ``use_duck_shape = False``: sizes that happen to be equal at warm-up (say 2 sequences and 2 KV
  heads) are not assumed equal forever.

One place still asks for ``T >= 2`` (``copy_``'s broadcast check in RoPE), so a one-token step
(one request decoding alone) is padded to two tokens: the padding token's KV slot is -1 (not
written) and its query row lies past ``query_start_loc[-1]`` (the kernel leaves it zero).

NOTE: padded buckets (CUDA-graph style) were the other choice; on CPU there is no launch
overhead to save, and every bucket would be one more compile at start (tens of seconds each on
2 cores), so one dynamic graph it is.

The parameters are graph inputs (Dynamo inlines nn.Modules), so every model with the same
architecture, dtype and device shares the compiled code, in one process and, through Inductor's
on-disk FX graph cache (``$PAGEDSERVE_CACHE_DIR/inductor``), across restarts: the first start
compiles (tens of seconds for SmolLM2), later starts load the cached code.

Eager fallback (``--enforce-eager``, vLLM's flag, turns compilation off everywhere): the
``torch`` reference backend and the Triton (CUDA) backend run eagerly, and so do parallel
ranks: tensor-parallel all-reduces inside the layers would split the graph, and pipeline stages
would have to compile in lock step within the distributed timeout (their warm-up steps pass
hidden states). A machine without a C++ compiler (Inductor generates C++) runs eagerly too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

# Steps of fewer tokens are padded to this many (see the module docstring).
MIN_TOKENS = 2
# Whether a CPU worker compiles unless told --enforce-eager (benchmarks/ab_engine.py varies it).
COMPILE_ON_CPU = True


def inductor_cache_dir() -> str:
    """Where Inductor keeps compiled graphs across restarts: ``$TORCHINDUCTOR_CACHE_DIR`` if the
    user set it, else ``$PAGEDSERVE_CACHE_DIR/inductor`` (default ``~/.cache/pagedserve``)."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pagedserve")
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(root, "inductor")


# NOTE: set at import, before anything asks Inductor for its cache folder: Inductor writes its
# own default (/tmp/torchinductor_$USER) into the environment the first time it looks.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()


def why_eager(enforce_eager: bool, device: torch.device, backend_name: str,
              world_size: int) -> str | None:
    """None when the forward should be compiled, else the reason it runs eagerly (a flag, a
    device or backend without a compiled path, a parallel rank, or no C++ compiler)."""
    if enforce_eager:
        return "--enforce-eager"
    if not COMPILE_ON_CPU:
        return "services.worker.compiled.COMPILE_ON_CPU is False"
    if device.type != "cpu":
        return f"compilation is implemented for the CPU only, not {device.type}"
    if backend_name != "cpu":
        return f"the {backend_name!r} attention backend is not a compiled custom op"
    if world_size > 1:
        return "parallel ranks run eagerly (tensor-parallel all-reduces would split the graph)"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler and friends: no usable g++
        return f"Inductor finds no C++ compiler ({type(e).__name__}); install g++"
    return None


class CompiledForward:
    """``model.forward`` compiled once with dynamic token counts; same signature and result.

    Args:
        model: a decoder whose ``forward(input_ids, positions, kv_caches, attn_metadata,
            hidden_states=None)`` returns ``[T, E]`` (``services/worker/models/llama.py``).
        backend: its ``AttentionBackend``; its ops are resolved before tracing, so Dynamo never
            sees the lazy import.

    Compilation happens at the first call (the model runner's warm-up makes that call).
    """

    def __init__(self, model: torch.nn.Module, backend: Any) -> None:
        import torch.fx.experimental._config as fx_config

        fx_config.backed_size_oblivious = True
        fx_config.use_duck_shape = False
        backend.load()
        self.model = model
        self._compiled = torch.compile(model.forward, fullgraph=True, dynamic=None)
        self.compile_seconds: float | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any,
                 hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run the compiled forward on ``T`` tokens (``input_ids``/``positions`` ``[T]``
        int64, ``hidden_states`` ``[T, E]`` or None); returns ``[T, E]``."""
        num_tokens = input_ids.shape[0]
        if num_tokens < MIN_TOKENS:
            input_ids, positions, meta, hidden_states = _pad(
                MIN_TOKENS - num_tokens, input_ids, positions, meta, hidden_states)
        for t in (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.query_start_loc):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(meta.block_tables, [0, 1])
        if hidden_states is not None:
            torch._dynamo.mark_dynamic(hidden_states, 0)
        if self.compile_seconds is None:
            for cache in (c for layer in kv_caches for c in layer):  # any --kv-cache-memory
                torch._dynamo.mark_dynamic(cache, 0)
            t0 = time.perf_counter()
            out = self._compiled(input_ids, positions, kv_caches, meta, hidden_states)
            self.compile_seconds = time.perf_counter() - t0
            log.info("compiled the forward in %.1f s (Inductor cache %s)", self.compile_seconds,
                     os.environ["TORCHINDUCTOR_CACHE_DIR"])
        else:
            out = self._compiled(input_ids, positions, kv_caches, meta, hidden_states)
        return out[:num_tokens]


def _pad(extra: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
         hidden_states: torch.Tensor | None) -> tuple:
    """Append ``extra`` padding tokens: id 0 at position 0, KV slot -1 (skipped), past the last
    sequence's query rows (so attention leaves their rows zero)."""
    def cat(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    meta = dataclasses.replace(meta, slot_mapping=cat(meta.slot_mapping, -1))
    return (cat(input_ids, 0), cat(positions, 0), meta,
            None if hidden_states is None else cat(hidden_states, 0))
