"""The compiled forward: ``torch.compile`` (TorchDynamo + Inductor) of the model's forward on CPU.

One graph per model, for every step. Attention and the KV-cache write are the native CPU kernels'
``torch.library`` custom ops (``torch.ops.pagedserve.paged_attention`` / ``reshape_and_cache``,
with mutation schemas and Meta kernels), so Dynamo traces through all layers without a graph
break and Inductor fuses everything between them (the norms, RoPE, the SiLU gate, residual
adds) into a few C++ loops per layer; the matmuls stay ATen/oneDNN calls.

Dynamic shapes, one graph: the token count ``T``, the batch dimensions of the attention
metadata (sequences, block-table width) and the caches' block count are marked dynamic, so a
step of any size reuses the graph compiled at warm-up. Two torch settings make that hold:

- ``backed_size_oblivious``: a dynamic size is not specialised when a step has exactly 1 of
  something (one sequence, a one-block table), so such steps need no graph of their own;
- ``use_duck_shape = False``: sizes that happen to be equal at warm-up (say 2 sequences and 2 KV
  heads) are not assumed equal forever.

KV cache groups (``services/worker/kv_cache_groups.py``): the forward takes one metadata object
per layer, one per group shared by its layers, and layers of different groups share K/V
tensors; the graph is traced with that aliasing, which the model's sliding windows fix (they
are in the artifact key).

One place still asks for ``T >= 2`` (``copy_``'s broadcast check in RoPE), so a one-token step
(one request decoding alone) is padded to two tokens: the padding token's KV slot is -1 (not
written) and its query row lies past ``query_start_loc[-1]`` (the kernel leaves it zero).

NOTE: padded buckets (CUDA-graph style) were the other choice; on CPU there is no launch
overhead to save, and every bucket would be one more compile at start (tens of seconds each on
2 cores), so one dynamic graph it is.

Compiled ahead of time and saved whole: the forward is compiled with Dynamo's AOT API
(``torch.compile(...).aot_compile``, the one vLLM uses) into a function of ``(model, inputs)``
and written to ``$PAGEDSERVE_CACHE_DIR/inductor/aot/<key>.bin``, where the key hashes
everything the graph was specialised on (torch and Python versions, the CPU's vector ISA, the
model class and its config, dtype, block size, the source of the model, kernel and compile
modules). A restart
with the same key loads that file (Dynamo's bytecode trace, ~10 s of SmolLM2's start, and
Inductor's code generation are both skipped) and calls it with guards off: the key stands in for
them, as in vLLM. The parameters are graph inputs (Dynamo inlines nn.Modules), so one artifact
serves every model with that key, in one process (kept in memory) and across restarts. The first
start compiles (a minute or more for SmolLM2 on 2 cores). Inductor's own caches share that
folder (``$TORCHINDUCTOR_CACHE_DIR`` moves both). If the AOT path fails (an unreadable artifact,
a torch that refuses to save), the plain ``torch.compile`` path runs instead, with a warning.

NOTE: without guards, Python ints the graph was traced with (the metadata's ``max_query_len`` /
``max_seq_len``) may be baked in. The native kernels ignore those two; an op that reads one
must take it as a tensor, or a loaded artifact would reuse the warm-up's value.

Eager fallback (``--enforce-eager``, vLLM's flag, turns compilation off everywhere): the
``torch`` reference backend and the Triton (CUDA) backend run eagerly, and so do parallel
ranks: tensor-parallel all-reduces inside the layers would split the graph, and pipeline stages
would have to compile in lock step within the distributed timeout (their warm-up steps pass
hidden states). A machine without a C++ compiler (Inductor generates C++) runs eagerly too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from services.common.model_files import cache_root
from services.common.progress import startup_step

log = logging.getLogger(__name__)

# Steps of fewer tokens are padded to this many (see the module docstring).
MIN_TOKENS = 2
# Whether a CPU worker compiles unless told --enforce-eager (benchmarks/ab_engine.py varies it).
COMPILE_ON_CPU = True


def inductor_cache_dir() -> str:
    """Where Inductor keeps its caches across restarts: ``$TORCHINDUCTOR_CACHE_DIR`` if the
    user set it, else ``$PAGEDSERVE_CACHE_DIR/inductor`` (default ``~/.cache/pagedserve``)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_root() / "inductor")


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
        block_size: tokens per KV block (the caches' second dimension is static in the graph).
        kv_cache_dtype: the KV cache tensors' dtype (``--kv-cache-dtype``; an int8 cache's rows
            are 2 elements wider, static in the graph too); None = the model's.

    Compilation (or loading the saved artifact) happens at the first call; the model runner's
    warm-up makes that call. ``compile_seconds`` is how long it took, ``source`` how the
    function was obtained: "compiled" (AOT, saved), "loaded" (from disk), "memory" (already in
    this process), or "jit" (the plain ``torch.compile`` fallback).
    """

    def __init__(self, model: torch.nn.Module, backend: Any, block_size: int,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as fx_config

        fx_config.backed_size_oblivious = True
        fx_config.use_duck_shape = False
        # Inductor's C++ loops take the thread count at run time (omp_get_max_threads), not
        # the one at compile time: the worker lowers it while other load takes its cores
        # (services/worker/cpu_governor.py), and one artifact serves any --cpu-threads.
        inductor_config.cpp.dynamic_threads = True
        backend.load()
        self.model = model
        self.key = artifact_key(model, backend.name, block_size, kv_cache_dtype,
                                backend.kv_layout)
        self.path = Path(inductor_cache_dir()) / "aot" / f"{self.key}.bin"
        self._fn: Any = None  # (model, input_ids, positions, kv_caches, metas, hidden) -> [T, E]
        self.compile_seconds: float | None = None
        self.source: str | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: list[Any],
                 hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run the compiled forward on ``T`` tokens (``input_ids``/``positions`` ``[T]``
        int64, ``hidden_states`` ``[T, E]`` or None); returns ``[T, E]``."""
        num_tokens = input_ids.shape[0]
        if num_tokens < MIN_TOKENS:
            input_ids, positions, meta, hidden_states = _pad(
                MIN_TOKENS - num_tokens, input_ids, positions, meta, hidden_states)
        args = (self.model, input_ids, positions, kv_caches, meta, hidden_states)
        if self._fn is None:
            t0 = time.perf_counter()
            with self._progress():
                self._fn, self.source = self._obtain(args)
            self.compile_seconds = time.perf_counter() - t0
            log.info("forward %s in %.1f s (%s)", self.source, self.compile_seconds, self.path)
        return self._fn(*args)[:num_tokens]

    def _progress(self) -> AbstractContextManager[object]:
        """The start-up step ``_obtain`` is about to take (none when this process has it)."""
        if self.key in _LOADED:
            return nullcontext()
        if self.path.exists():
            return startup_step("loading the compiled forward")
        return startup_step("compiling the forward", detail="once; saved for later starts")

    def _obtain(self, args: tuple) -> tuple[Any, str]:
        """The compiled function for ``args``: from this process, from disk, or compiled now
        (and saved); the plain ``torch.compile`` path if the AOT one fails."""
        if self.key in _LOADED:
            return _LOADED[self.key], "memory"
        fn_globals = type(self.model).forward.__globals__
        fn: Any  # an AOTCompiledFunction, which torch's signatures type as a plain Callable
        if self.path.exists():
            try:
                with open(self.path, "rb") as f:
                    fn = torch.compiler.load_compiled_function(f, f_globals=fn_globals)
                fn.disable_guard_check()
                _LOADED[self.key] = fn
                return fn, "loaded"
            except Exception as e:  # noqa: BLE001 - any unreadable artifact: compile afresh
                log.warning("could not load %s (%s: %s); compiling", self.path,
                            type(e).__name__, e)
        _mark_dynamic(args)
        try:
            # torch.compile's result has aot_compile, which its return type does not show
            compiled: Any = torch.compile(type(self.model).forward, fullgraph=True)
            # NOTE: floats (norm eps, softmax scale) are constants of the graph (the artifact
            # key hashes the config). Without this, a second model class sharing this
            # forward's code in one process (Llama after Qwen3, say) had Dynamo mark the float
            # that differed "automatic dynamic", which ahead-of-time compilation cannot trace
            # (TensorifyScalarRestartAnalysis), and the worker fell back to jit.
            with torch._dynamo.config.patch(specialize_float=True):
                fn = compiled.aot_compile((args, {}))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(self.path))  # atomic: a temp file, then a rename
        except Exception as e:  # noqa: BLE001 - e.g. Inductor caches disabled: compile in place
            log.warning("ahead-of-time compile failed (%s: %s); using torch.compile without a "
                        "saved artifact", type(e).__name__, e)
            jit = torch.compile(type(self.model).forward, fullgraph=True, dynamic=None)
            jit(*args)
            return jit, "jit"
        fn.disable_guard_check()
        _LOADED[self.key] = fn
        return fn, "compiled"


# AOT-compiled functions by artifact key, shared by the model runners of one process.
_LOADED: dict[str, Any] = {}

# The sources whose text the graph depends on (the model's math, the ops' schemas and
# kernels, native ones included, this file).
_SOURCES = ("services/worker/models", "kernels", "services/worker/compiled.py",
            "services/worker/attention.py",
            "services/worker/kv_cache_groups.py", "services/worker/packed_linear.py",
            "services/worker/quantized_linear.py", "services/worker/lora")
_SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def artifact_key(model: torch.nn.Module, backend_name: str, block_size: int,
                 kv_cache_dtype: torch.dtype | None = None, kv_layout: str = "rows") -> str:
    """A 24-hex-digit hash of everything a compiled forward was specialised on: torch, Python,
    the CPU's vector ISA, the model class and config (its layers' sliding windows too, which
    fix the KV cache groups: how many metadata objects the graph takes and which layers share a
    K/V tensor pair), its dtype and device, the attention backend, the block size and KV cache
    dtype (None = the model's) and layout (``kernels/kv_layout.py``), the sizes of its
    LoRA slots (``services/worker/lora/layers.py``), the classes of its modules (packed
    linear layers: a 16-bit model's, or ``--batch-invariant``'s), the name, shape and dtype of
    every parameter and buffer (graph inputs of static shape: a quantized layer's codes,
    group scales and mins, and an act-order permutation, differ by format for one config),
    and the text of the model, kernel (native ones included), packing, compile, grouping and
    LoRA modules."""
    root = Path(__file__).resolve().parents[2]
    param = next(model.parameters())
    lora = getattr(model, "lora_context", None)
    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, torch.backends.cpu.get_cpu_capability(),
                 type(model).__qualname__, repr(getattr(model, "config", None)),
                 repr(getattr(getattr(model, "config", None), "sliding_windows", None)),
                 str(param.dtype), param.device.type, backend_name, str(block_size),
                 str(kv_cache_dtype or param.dtype), kv_layout,
                 str(len(getattr(model, "layers", ()))),
                 # (static sizes: LoRA's --max-loras x --max-lora-rank slots)
                 "" if lora is None else f"lora {lora.num_slots}x{lora.rank}",
                 ",".join(sorted({type(m).__qualname__ for m in model.modules()})),
                 ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in (
                     *model.named_parameters(), *model.named_buffers()))):
        h.update(part.encode() + b"\0")
    for rel in _SOURCES:
        paths = (sorted(p for p in (root / rel).rglob("*") if p.suffix in _SOURCE_SUFFIXES)
                 if (root / rel).is_dir() else [root / rel])
        for path in paths:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:24]


def _mark_dynamic(args: tuple) -> None:
    """Mark the sizes that vary between steps dynamic on the example ``args`` (model,
    input_ids, positions, kv_caches, meta, hidden_states) before tracing."""
    model, input_ids, positions, kv_caches, metas, hidden_states = args
    for module in model.modules():  # per-token tensors of a module (LoRA's row -> slot mask)
        for t in getattr(module, "dynamic_rows", tuple)():
            torch._dynamo.mark_dynamic(t, 0)
    for t in (input_ids, positions):
        torch._dynamo.mark_dynamic(t, 0)
    for meta in {id(m): m for m in metas}.values():  # one per KV cache group
        for t in (meta.slot_mapping, meta.seq_lens, meta.query_start_loc):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(meta.block_tables, [0, 1])
    if hidden_states is not None:
        torch._dynamo.mark_dynamic(hidden_states, 0)
    for cache in (c for layer in kv_caches for c in layer):  # any --kv-cache-memory
        torch._dynamo.mark_dynamic(cache, 0)


def _pad(extra: int, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[Any],
         hidden_states: torch.Tensor | None) -> tuple:
    """Append ``extra`` padding tokens: id 0 at position 0, KV slot -1 (skipped), past the last
    sequence's query rows (so attention leaves their rows zero)."""
    def cat(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    padded = {id(m): dataclasses.replace(m, slot_mapping=cat(m.slot_mapping, -1))
              for m in metas}  # (layers of one KV cache group share one metadata object)
    return (cat(input_ids, 0), cat(positions, 0), [padded[id(m)] for m in metas],
            None if hidden_states is None else cat(hidden_states, 0))
