"""``WorkerConfig``: a worker's model-runner settings, typed and checked once (no torch).

Built once from the worker's parsed flags (``WorkerConfig.from_args``), or directly by tests and
benchmarks; ``ModelRunner`` takes it whole. Each setting's default is written here only: the
flag that sets it reads it with ``field_default(WorkerConfig, name)``
(``services/worker/server.py``). Rules between flags are checked in ``__post_init__``, each
error naming both flags. What only the process needs (ports, TLS, threads, the rank and the
rendezvous) stays with the flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from services.common.spec_decode_config import SpeculativeConfig, check_spec_decode_parallelism
from services.worker.lora import LoRAConfig
from services.worker.parallel.layer_partition import parse_partition

# fields set from a flag of another name or from several flags (see ``from_args``)
_DERIVED = ("speculative", "lora")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker rank's model-runner settings (vLLM's names; the flag of each is
    ``--field-name``).

    Attributes:
        model: transformers folder or ``.gguf`` file; None = the packaged SmolLM2.
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        block_size: tokens per KV block.
        kv_cache_memory: KV cache bytes on CPU; ignored on CUDA.
        kv_cache_dtype: how the KV cache stores K/V: ``"auto"`` (the model dtype), ``"int8"``,
            ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (``kernels/kv_quant.py``).
        gpu_memory_utilization: fraction of the GPU's total memory this worker may use (weights,
            activations and KV cache); the KV cache gets what the profiled peak leaves.
        max_num_seqs: sequences of the largest step (the input batch's rows; on CUDA the
            profiling step's sequences).
        max_num_batched_tokens: tokens of the largest step (on CUDA the profiling step's).
        max_model_len: longest sequence (tokens); None = the model's.
        attention_backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cpu"``.
        enforce_eager: never ``torch.compile`` the forward.
        batch_invariant: every request's output bitwise the same whatever else is in the batch.
        quantization: how the weights are stored (``--quantization``); None = from the model.
        runner: ``"auto"``, ``"generate"`` or ``"pooling"`` (``--runner``).
        pooler_config: ``--pooler-config`` (JSON) or None.
        speculative: ``--speculative-config`` parsed, or None (no speculation).
        lora: ``--enable-lora``'s limits (``--max-loras``, ``--max-lora-rank``,
            ``--max-cpu-loras``), or None without it.
        tensor_parallel_size / pipeline_parallel_size: the rank group's shape.
        world_size: ``--world-size``, a check of tensor x pipeline parallel size; None = none.
        pipeline_layer_partition: layers per pipeline stage, e.g. ``"10,20"``; None = even.
        kv_offload_dir: the KV tier's folder on disk (``--kv-offload-dir``,
            ``services/worker/kv_tier.py``); "" = no tier.

    Raises:
        ValueError: ``speculative`` with ``pipeline_parallel_size`` > 1, a ``world_size``
            other than tensor x pipeline parallel size, or a ``pipeline_layer_partition`` of
            another number of stages (or unparsable), or ``kv_offload_dir`` with
            ``pipeline_parallel_size`` > 1 or the pooling runner; each message names both
            flags.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int = 2 << 30  # bytes
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    batch_invariant: bool = False
    quantization: str | None = None
    runner: str = "auto"
    pooler_config: str | None = None
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    world_size: int | None = None
    pipeline_layer_partition: str | None = None
    kv_offload_dir: str = ""

    def __post_init__(self) -> None:
        check_spec_decode_parallelism(self.speculative, self.pipeline_parallel_size)
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.world_size is not None and self.world_size != tp * pp:
            raise ValueError(f"--world-size {self.world_size} != --tensor-parallel-size "
                             f"{tp} x --pipeline-parallel-size {pp}")
        partition = self.layer_partition
        if partition is not None and len(partition) != pp:
            raise ValueError(f"--pipeline-layer-partition {self.pipeline_layer_partition} has "
                             f"{len(partition)} stages but --pipeline-parallel-size is {pp}")
        if self.kv_offload_dir and pp > 1:
            raise ValueError(f"--kv-offload-dir is not supported with --pipeline-parallel-size "
                             f"{pp} (a stage holds only its layers' blocks)")
        if self.kv_offload_dir and self.runner == "pooling":
            raise ValueError("--kv-offload-dir is not supported with --runner pooling (no "
                             "prefix caching of embeddings)")

    @property
    def num_ranks(self) -> int:
        """Ranks of the group: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def layer_partition(self) -> tuple[int, ...] | None:
        """``pipeline_layer_partition`` parsed (layers per stage), None = the even split."""
        return parse_partition(self.pipeline_layer_partition)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """The config of the worker's parsed flags (``services/worker/server.py``'s
        ``add_args``; ``pagedserve serve``'s namespace holds them too).

        Raises:
            ValueError: as ``__post_init__``, or LoRA limits ``LoRAConfig`` refuses.
        """
        flags = vars(args)
        lora = (LoRAConfig(flags["max_loras"], flags["max_lora_rank"], flags["max_cpu_loras"])
                if flags["enable_lora"] else None)
        return cls(speculative=SpeculativeConfig.parse(flags["speculative_config"]), lora=lora,
                   **{f.name: flags[f.name] for f in fields(cls) if f.name not in _DERIVED})
