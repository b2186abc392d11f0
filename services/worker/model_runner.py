"""ModelRunner: one worker's model, KV cache and step execution (no gRPC; usable in-process).

KV cache layout (docs/architecture.md, "KV cache layout"): the layers are grouped by attention
type into KV cache groups (``services/worker/kv_cache_groups.py``), each with its own block
table per request. Per position ``j`` in a group one K and one V tensor, each
``[num_kv_blocks, block_size, num_kv_heads, head_dim]`` in the KV cache dtype (an int8 row one
byte wider, ``kernels/kv_quant.py``), zero-initialised;
the layer at position ``j`` of its group uses pair ``j`` (so layers of different groups share a
pair, in the blocks their groups were given). Token position ``p`` of a request lives, for a
layer of group ``g``, at block ``block_table[g][p // block_size]``, offset ``p % block_size``;
the flat slot is ``block * block_size + offset``. A model of one attention type has one group of
all its layers: one pair per layer. Under pipeline parallelism a rank allocates only the pairs
its layers use. Copy-on-write (beam search) copies whole blocks in every pair before a step's
forward (``kernels.copy_blocks``).

Speculative decoding (vLLM V1 style; ``--speculative-config``): a step may carry draft tokens
per request (``CachedRequest.spec_token_ids``), which every rank computes as 1 + d query
positions; the driver samples every position with the request's own parameters and keeps the
drafts while they equal the samples, plus the sample after them (``spec_decode/verify.py``, lossless
for our deterministic proposers), appends those, and sends its tp peers what it kept. After
appending, it proposes the next drafts (``StepInput.num_speculative_tokens``) by prompt lookup
(``ngram_proposer.py``) or with a draft model (``draft_model.py``).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from kernels.copy_blocks import copy_blocks
from kernels.kv_quant import cache_row_size
from services.common.progress import startup_step
from services.common.sampling_params import EngineSamplingParams
from services.common.spec_decode_config import SpeculativeConfig, check_spec_decode_parallelism
from services.common.step import (
    CachedRequest,
    NewRequest,
    SampledLogprobs,
    StepInput,
    StepOutput,
)
from services.common.tokenizer_loading import load_tokenizer
from services.worker.attention import (
    AttentionBackend,
    AttentionMetadata,
    choose_kv_layout,
    resolve_kv_cache_dtype,
    select_backend,
)
from services.worker.checkpoint import Model
from services.worker.compiled import CompiledForward, why_eager
from services.worker.config import WorkerConfig
from services.worker.device import resolve_device, resolve_dtype
from services.worker.huge_pages import zeros_on_huge_pages
from services.worker.input_batch import InputBatch
from services.worker.kv_cache_groups import KVGroup, kv_cache_groups, local_kv_layout
from services.worker.kv_tier_step import build_kv_tier, run_with_kv_tier
from services.worker.loader import load_model
from services.worker.lora.manager import make_lora_manager
from services.worker.models.llama import DecoderLayer, lm_head_logits
from services.worker.parallel.distributed import ParallelState
from services.worker.parallel.sharding import vocab_parallel_logits
from services.worker.pooler import make_pooler
from services.worker.sample.compute_logprobs import compute_logprobs, compute_prompt_logprobs
from services.worker.sample.sampler import Sampler
from services.worker.sample.structured_output_masks import StructuredOutputs
from services.worker.spec_decode.ngram_proposer import NgramProposer
from services.worker.spec_decode.verify import verify_drafts
from services.worker.step_batch import PreparedStep

if TYPE_CHECKING:  # (imported where the draft_model method needs it)
    from services.worker.spec_decode.draft_model import DraftModelProposer as DraftProposer

log = logging.getLogger(__name__)

# The dummy requests sample with top-k and top-p, so the sort those take is in the profile.
_WARMUP_SAMPLING = EngineSamplingParams(temperature=1.0, top_p=0.9, top_k=50)


class ModelRunner:
    """Loads the model, allocates the paged KV cache and runs engine steps.

    Args:
        config: the rank's settings (``services/worker/config.py``). What the runner makes of
            them, beyond what ``WorkerConfig`` says:

            - ``kv_cache_memory``: the KV cache's bytes on CPU; on CUDA the cache gets
              ``gpu_memory_utilization * total`` less the peak of a profiling step of
              ``max_num_batched_tokens`` tokens in ``max_num_seqs`` sequences.
            - ``kv_cache_dtype``: int8 / fp8 rows are half the bytes of bf16, a quarter of
              float32's, so about twice / four times the blocks (``kernels/kv_quant.py``). The
              torch and cpu attention backends read them; the draft model of speculative
              decoding keeps its own K/V at the model dtype.
            - ``max_model_len``: at most the model's (its default).
            - ``enforce_eager`` off: a single-rank CPU worker on the native kernels runs the
              forward through ``torch.compile`` (``services/worker/compiled.py``), compiled
              here, at start, by warm-up steps.
            - ``speculative``: the driver proposes drafts after each step that asks
              (``StepInput.num_speculative_tokens``): prompt lookup (``ngram_proposer.py``) or
              a draft model (``draft_model.py``, loaded here, its KV cache beside the target's
              in the same block ids, so the KV memory is split: ``num_kv_blocks = kv_bytes //
              (target + draft bytes per block)``). Every rank verifies the drafts a step
              carries.
            - ``batch_invariant``: every request's tokens and logprobs bitwise the same
              whatever else the step holds (its batch, the chunking of its prompt, a
              prefix-cache hit). The attention kernel, and a 16-bit model's linear layers, are
              row-invariant always; this also puts a float32 model's linear layers and LM head
              on the native row-invariant kernel (``services/worker/packed_linear.py``). CPU
              only, native attention backend.
            - ``quantization``: None (weights in ``dtype``; a GGUF's ``Q8_0`` linear layers stay
              int8 on a CPU), ``"int8"`` (the decoder's linear weights int8 per output channel,
              weight-only) or ``"w8a8"`` (int8 weights and per-token int8 activations);
              ``services/worker/quantized_linear.py``. CPU only.
            - ``runner`` / ``pooler_config``: ``"pooling"`` = embeddings, no LM head
              (``services/worker/pooler.py``); ``"auto"``: from the checkpoint.
            - ``lora``: ``services/worker/lora/`` (``NewRequest.lora`` loaded at first use, its
              rows updated in the batched forward).
            - ``kv_offload_dir``: the KV tier on disk (``kv_tier``, ``kv_tier_step.py``).
        parallel: this rank's place in a tensor/pipeline-parallel group (``init_distributed``);
            None = a single rank. Every rank runs every step; only the driver (tp rank 0 of the
            last stage) returns sampled tokens, the others an empty ``StepOutput``.

    The driver also holds the structured-output state (``structured``: llguidance matchers
    over the model's tokenizer, built in the background from here on); other ranks have None.

    Raises:
        ValueError: bad dtype/backend/max_model_len, no room for a single KV block, or
            speculation with pipeline parallelism, or a draft model the target cannot pair
            with (another vocabulary; a target without full-attention layers), or
            ``batch_invariant`` off a CPU or without the native kernels, or a ``quantization``
            that is unknown or cannot run here (its message names ``--quantization``), or a
            bad ``runner`` / ``pooler_config`` (naming the field), or ``kv_offload_dir`` with a
            pooling model.
        OSError: the KV tier's folder cannot be made.
    """

    def __init__(self, config: WorkerConfig, parallel: ParallelState | None = None) -> None:
        check_spec_decode_parallelism(  # (the group's: ``config`` may leave its sizes 1)
            config.speculative, parallel.config.pipeline_parallel_size if parallel else 1)
        self.config = config
        self.speculative = config.speculative
        self.batch_invariant = config.batch_invariant
        self.quantization = config.quantization
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        backend = self._select_backend(config)
        cuda_baseline = self._cuda_memory_baseline() if self.device.type == "cuda" else None
        self.parallel = parallel
        self._load(config, backend)
        self._plan_kv_cache(backend)
        self.sampler = Sampler()
        self.structured = (StructuredOutputs(lambda: load_tokenizer(config.model),
                                             self.vocab_size, self.eos_token_ids)
                           if parallel is None or parallel.config.is_driver else None)
        self.input_batch = InputBatch(self.device, self.block_size, 0, self.vocab_size,
                                      self.eos_token_ids, max_num_seqs=self.max_num_seqs,
                                      max_model_len=self.max_model_len,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      num_kv_cache_groups=len(self.kv_cache_groups),
                                      structured=self.structured)
        self.forward: Model | CompiledForward = self.model  # (the CUDA profile's steps run it)
        if cuda_baseline is not None:
            kv_bytes = self._profile_cuda(self.max_num_batched_tokens, self.max_num_seqs,
                                          config.gpu_memory_utilization, *cuda_baseline)
        else:
            kv_bytes = config.kv_cache_memory
        with startup_step(f"allocating the KV cache ({kv_bytes / 2**30:.2f} GiB)"):
            self._allocate_kv_blocks(kv_bytes)
        self.kv_tier = build_kv_tier(self, config.kv_offload_dir)
        world = parallel.config.world_size if parallel else 1
        self.eager_reason = why_eager(config.enforce_eager, self.device, backend.name, world)
        if self.eager_reason is None:
            self.forward = CompiledForward(self.model, backend, self.block_size,
                                           self.kv_cache_dtype)
            self._warm_up()
        else:
            log.info("forward runs eagerly: %s", self.eager_reason)

    def _select_backend(self, config: WorkerConfig) -> AttentionBackend:
        """The attention backend of ``config.attention_backend`` on this device, and the KV
        cache dtype it stores (sets ``kv_cache_dtype``, ``kv_cache_dtype_name``,
        ``attention_backend_name``).

        Raises:
            ValueError: a KV cache dtype the backend cannot read, or ``batch_invariant``
                without the native CPU kernels.
        """
        backend = select_backend(config.attention_backend, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, backend.name,
            torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None)
        self.kv_cache_dtype_name = config.kv_cache_dtype
        if config.batch_invariant and backend.name != "cpu":
            raise ValueError(f"--batch-invariant needs the native CPU attention kernels "
                             f"(--attention-backend cpu or auto on a CPU), not {backend.name!r}")
        self.attention_backend_name = backend.name  # "torch", "triton" or "cpu" ("auto" resolved)
        return backend

    def _cuda_memory_baseline(self) -> tuple[int, int]:
        """Before loading: ``(total bytes of the GPU, bytes this process holds outside torch's
        allocator)``, with the allocator's peak reset, for ``_profile_cuda``."""
        torch.cuda.set_device(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total, total - free - torch.cuda.memory_reserved(self.device)

    def _load(self, config: WorkerConfig, backend: AttentionBackend) -> None:
        """Load this rank's part of the model (its LoRA manager and pooler too) and set what
        the model decides: ``max_model_len``, ``eos_token_ids``, ``vocab_size``, ...

        Raises:
            ValueError: ``config.max_model_len`` above the model's, or the loader's refusals.
        """
        self.model, model_config, info = load_model(
            config.model, self.dtype, self.device, backend, self.parallel,
            batch_invariant=config.batch_invariant, quantization=config.quantization,
            runner=config.runner, lora=config.lora)
        self.lora = (make_lora_manager(self.model, config.lora, model_config, self.parallel)
                     if config.lora else None)
        self.info = info  # (its runner, pooler defaults and Matryoshka sizes: worker_info)
        self.pooler = make_pooler(info.runner, config.pooler_config, info.pooler)
        if config.max_model_len is not None and config.max_model_len > info.max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {info.max_model_len}")
        self.max_model_len = config.max_model_len or info.max_model_len
        self.eos_token_ids, self.vocab_size, self.model_name = (
            info.eos_token_ids, info.vocab_size, info.name)
        self.weights_quantization = info.quantization  # "" / "int8" / "w8a8" / "gguf"

    def _plan_kv_cache(self, backend: AttentionBackend) -> None:
        """This rank's KV cache geometry: its groups and pairs (``_plan_kv_cache_groups``),
        ``bytes_per_block``, the draft proposer (whose K/V shares the blocks) and the
        backend's ``kv_layout``."""
        cfg = self.model.config
        # NOTE: this rank's layers and KV heads only (a pipeline stage, a tensor-parallel shard).
        self.num_layers = len(self.model.layers)
        self.num_kv_heads: int = cast(DecoderLayer, self.model.layers[0]).attn.n_kv_heads
        self._plan_kv_cache_groups(list(cfg.sliding_windows))
        self.kv_row = cache_row_size(cfg.head_dim, self.kv_cache_dtype)  # elements per row
        self.bytes_per_block = (2 * self.num_kv_pairs * self.block_size * self.num_kv_heads
                                * self.kv_row * self.kv_cache_dtype.itemsize)
        self.ngram, self.draft = self._build_proposer(self.speculative, backend)
        # the caches' order inside a block (the draft's share the backend): before compiling
        head_dims = [cfg.head_dim] + ([self.draft.head_dim] if self.draft is not None else [])
        backend.kv_layout = choose_kv_layout(backend.name, self.kv_cache_dtype, self.block_size,
                                             head_dims, compute_dtype=self.dtype)
        self.kv_layout = backend.kv_layout  # "rows" or "pairs" (kernels/kv_layout.py)

    def _allocate_kv_blocks(self, kv_bytes: int) -> None:
        """As many KV blocks as ``kv_bytes`` holds (the draft model's share included): sets
        ``num_kv_blocks`` and ``kv_caches``.

        Raises:
            ValueError: not one block fits, naming the flag to change.
        """
        draft_bytes = self.draft.bytes_per_block if self.draft is not None else 0
        num_blocks = int(kv_bytes // (self.bytes_per_block + draft_bytes))
        if num_blocks < 1:
            raise ValueError(
                f"no memory for the KV cache: {kv_bytes / 2**20:.1f} MiB available, one block "
                f"needs {(self.bytes_per_block + draft_bytes) / 2**20:.2f} MiB"
                + (" (the draft model's included)" if draft_bytes else "") + "; raise "
                + ("--gpu-memory-utilization or lower --max-num-batched-tokens"
                   if self.device.type == "cuda" else "--kv-cache-memory"))
        self.num_kv_blocks = num_blocks
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)
        self.input_batch.num_kv_blocks = num_blocks
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s, --kv-cache-dtype "
                 "%s) on %s; %d KV cache groups (windows %s, 0 = full), %d K/V tensor pairs for "
                 "%d layers", num_blocks, self.block_size, num_blocks * self.block_size,
                 num_blocks * self.bytes_per_block / 2**30,
                 str(self.kv_cache_dtype).removeprefix("torch."), self.kv_cache_dtype_name,
                 self.device, len(self.kv_cache_groups),
                 [g.sliding_window for g in self.kv_cache_groups], self.num_kv_pairs,
                 self.num_layers)

    def _build_proposer(self, speculative: SpeculativeConfig | None, backend
                        ) -> tuple[NgramProposer | None, DraftProposer | None]:
        """The driver's draft proposer for ``speculative`` (``(ngram, draft model)``, at most
        one set; none on other ranks or without speculation). A draft model writes its K/V
        in the blocks of the target's first full-attention KV cache group
        (``_draft_group``).

        Raises:
            ValueError: a target without full-attention layers for a draft model, or the
                draft's own refusals (another vocabulary, sliding-window layers).
        """
        ps = self.parallel
        if speculative is None or not (ps is None or ps.config.is_driver):
            return None, None
        if speculative.method == "ngram":
            return NgramProposer(speculative.prompt_lookup_min,
                                 speculative.prompt_lookup_max), None
        full = [g for g, group in enumerate(self.kv_cache_groups) if group.sliding_window == 0]
        if not full:
            raise ValueError("--speculative-config: a draft model shares the target's "
                             "full-attention block table, and this model has none (sliding "
                             f"windows {[g.sliding_window for g in self.kv_cache_groups]})")
        self._draft_group = full[0]
        from services.worker.spec_decode.draft_model import (
            DraftModelProposer,  # (only the draft_model method needs it)
        )

        return None, DraftModelProposer(speculative.model, self.dtype, self.device, backend,
                                        self.block_size, self.vocab_size,
                                        batch_invariant=self.batch_invariant)

    def _plan_kv_cache_groups(self, sliding_windows: list[int]) -> None:
        """Group the model's (global) layers and lay this rank's layers out over K/V tensor
        pairs: sets ``kv_cache_groups``, ``layer_groups`` (per local layer, its group's index),
        ``_layer_pairs`` (per local layer, its pair's index) and ``num_kv_pairs``.

        Raises:
            ValueError: ``sliding_windows`` is not one entry per layer of the model.
        """
        cfg = self.model.config
        if len(sliding_windows) != cfg.num_hidden_layers:
            raise ValueError(f"the model config gives {len(sliding_windows)} sliding windows for "
                             f"{cfg.num_hidden_layers} layers")
        self.kv_cache_groups: list[KVGroup] = kv_cache_groups(sliding_windows)
        ps = self.parallel
        local = (ps.config.layer_range(cfg.num_hidden_layers) if ps
                 else range(cfg.num_hidden_layers))
        assert len(local) == self.num_layers  # (the loader kept exactly this stage's layers)
        layout = local_kv_layout(self.kv_cache_groups, local)
        self.layer_groups, self._layer_pairs = layout.layer_groups, layout.layer_pairs
        self.num_kv_pairs = layout.num_pairs

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per local layer, its ``(k, v)`` pair (one object for every layer that shares it)."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.kv_row)
        # NOTE: zeros, not empty: kernels that load whole blocks and mask afterwards would turn
        # garbage NaNs in unused slots into NaN outputs (0 * NaN).
        dtype = self.kv_cache_dtype
        alloc = (partial(zeros_on_huge_pages, shape, dtype) if self.device.type == "cpu"
                 else partial(torch.zeros, shape, dtype=dtype, device=self.device))
        pairs = [(alloc(), alloc()) for _ in range(self.num_kv_pairs)]
        return [pairs[i] for i in self._layer_pairs]

    def layer_metadata(self, batch: PreparedStep) -> list[AttentionMetadata]:
        """Per local layer, the attention metadata of its KV cache group (the model's
        ``attn_metadata`` argument; one object for every layer of a group)."""
        metas = batch.attn_metadata
        if len(metas) == 1:
            return metas * self.num_layers
        return [metas[g] for g in self.layer_groups]

    def _profile_cuda(self, max_num_batched_tokens: int, max_num_seqs: int, utilization: float,
                      total: int, non_torch_before: int) -> int:
        """KV-cache bytes left after the peak of a dummy step of ``max_num_batched_tokens``.

        ``utilization * total - peak_torch - non_torch_increase``, where peak_torch is the
        allocator's peak over weights and the dummy step (less its throwaway KV cache), and
        non_torch_increase is memory this process took outside the allocator meanwhile
        (cuBLAS workspaces, ...). Other processes' memory is not counted, as in vLLM: the
        fraction is per worker.
        """
        num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
        lens = [max_num_batched_tokens // num_seqs + (i < max_num_batched_tokens % num_seqs)
                for i in range(num_seqs)]
        num_blocks = sum(n // self.block_size + 1 for n in lens)
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        dummy_bytes = num_blocks * self.bytes_per_block
        self.input_batch.num_kv_blocks = num_blocks
        self._dummy_steps(lens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - dummy_bytes
        del self.kv_caches
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        non_torch_increase = max(
            0, total - free - torch.cuda.memory_reserved(self.device) - non_torch_before)
        kv_bytes = int(utilization * total) - peak - non_torch_increase
        log.info("profiled %d tokens in %d seqs: peak %.2f GiB, non-torch +%.2f GiB, "
                 "KV cache gets %.2f GiB of %.2f GiB x %.2f", max_num_batched_tokens, num_seqs,
                 peak / 2**30, non_torch_increase / 2**30, kv_bytes / 2**30, total / 2**30,
                 utilization)
        return kv_bytes

    def _dummy_steps(self, lens: list[int]) -> None:
        """One prefill step of sampled dummy requests of ``lens`` tokens, then one decode
        step of them, then drop them; their KV goes into blocks 0.. (room for ``n + 1`` tokens
        each), which the scheduler has not handed out yet."""
        requests, next_block = [], 0
        ps = self.parallel
        samples = ps is None or ps.config.is_last_stage  # (it appended its samples)
        for i, n in enumerate(lens):
            blocks = list(range(next_block, next_block + n // self.block_size + 1))
            next_block += len(blocks)
            # (every group the same blocks: the layers sharing a pair overwrite each other's
            # dummy K/V, which nothing reads back as real)
            requests.append(NewRequest(f"__warmup_{i}", [0] * n, _WARMUP_SAMPLING,
                                       blocks * len(self.kv_cache_groups), 0, n))
        self.execute_step(StepInput(-2, requests, [], []))
        # the decode step as the scheduler builds it (each request's new token: 0), as this
        # rank sees it
        self.execute_step(StepInput(-1, [], [] if self.pooler else [  # (pooled: nothing next)
            CachedRequest(r.request_id, [0], [], False, len(r.prompt_token_ids), 1)
            for r in requests], []).for_rank(samples))
        self.execute_step(StepInput(-1, [], [], [r.request_id for r in requests]))

    def _warm_up(self) -> None:
        """Compile the forward before serving: a prefill of two sequences (at least two
        blocks each where the cache allows, so no size is 1 when the graph is traced), then a
        decode step of them, which must reuse the graph.

        NOTE: no speculative step is needed here: a step verifying drafts has 1 + d query
        tokens per request, the shape of a chunked prefill, which the one dynamic graph
        already covers (measured on the tiny Llama: ~2 ms per spec step after warm-up, the
        same as a plain decode; ``test_spec_steps_reuse_the_compiled_forward_of_the_warm_up``).
        """
        room = self.num_kv_blocks // 2 - 1  # blocks per dummy sequence, less one for decode
        # NOTE: n prompt tokens, the prefill's sample and the decode's: n + 2 <= max_model_len
        if room < 0 or self.max_model_len < 4:
            log.info("no room for warm-up (%d KV blocks, max_model_len %d): compiling at the "
                     "first step", self.num_kv_blocks, self.max_model_len)
            return
        n = max(2, min(128, self.max_model_len - 2, room * self.block_size))
        t0 = time.perf_counter()
        with startup_step("warming up the forward"):
            self._dummy_steps([n, n])
        log.info("warm-up (compile included) took %.1f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> StepOutput:
        """Copy ``step``'s KV blocks, apply its diffs, run the scheduled tokens, and sample where
        a chunk ends.

        The ranks of the last pipeline stage append the sampled tokens to their requests (the
        next step computes them), except a beam's, which the scheduler picks; the other stages
        get them as the next step's new_token_ids. The driver fills the grammar masks of its
        constrained rows during the forward. A request with drafts gets its accepted drafts
        and the token sampled after them (``StepOutput.num_sampled_token_ids``); with
        ``num_speculative_tokens > 0`` the driver then proposes drafts to follow each sampled
        request's new tokens (``StepOutput.draft_token_ids``).

        A request whose LoRA adapter cannot be loaded is left out, on every rank alike, and
        reported in ``StepOutput.failed_request_ids`` (``LoRAManager.execute``). A constrained
        request whose grammar broke is reported by the driver in ``StepOutput.
        broken_request_ids`` (``GrammarStep.broken``).

        With the KV tier, its loads and stores go around the step (``run_with_kv_tier``).

        Safe to call from any (one at a time) thread. Raises KeyError / ValueError on an
        inconsistent step (unknown request, tokens or blocks missing, bad block id).
        """
        run = (self._execute_step if self.lora is None
               else partial(self.lora.execute, run=self._execute_step))
        if self.kv_tier is None:
            return run(step)
        return run_with_kv_tier(self.kv_tier, step, run, self.lora)

    def _execute_step(self, step: StepInput) -> StepOutput:
        """``execute_step`` once the step's adapters are loaded."""
        self._copy_blocks(step.blocks_to_copy)
        if self.draft is not None:  # its KV of these is stale or gone: recompute from 0
            self.draft.drop_stale(step)
        scheduled = self.input_batch.update(step)
        if not scheduled:
            return StepOutput(step.step_id, [], [])
        batch = self.input_batch.prepare(scheduled)
        if self.lora is not None:
            self.lora.set_step(scheduled.request_ids, scheduled.num_scheduled_tokens,
                               batch.input_ids.shape[0], isinstance(self.forward, CompiledForward))
        grammar_step = (self.structured.start(batch.grammar_rows, batch.grammars)
                        if batch.grammars and self.structured is not None else None)
        ps = self.parallel
        received = None
        if ps and not ps.config.is_first_stage:
            received = ps.recv_from_prev_stage(  # the residual stream: float32
                (batch.input_ids.shape[0], self.model.config.hidden_size), torch.float32)
        hidden = self.forward(batch.input_ids, batch.positions, self.kv_caches,
                              self.layer_metadata(batch), received)  # [T, E]
        if ps and not ps.config.is_last_stage:
            ps.send_to_next_stage(hidden)
            return StepOutput(step.step_id, [], [])
        if self.pooler is not None:  # pooling runner: vectors where prompts end, no sampling
            return self.pooler.step_output(
                step, hidden, scheduled.request_ids, scheduled.num_computed_tokens,
                scheduled.num_scheduled_tokens, self.input_batch.num_tokens[scheduled.rows],
                ps is None or ps.config.is_driver)
        prompt_logprobs = self._prompt_logprobs(hidden, batch)  # (a collective under TP)
        if not batch.sampled_request_ids:
            return StepOutput(step.step_id, [], [], None, prompt_logprobs)
        logits = self._compute_logits(hidden[batch.logits_indices])  # [L, V] float32
        if ps and not ps.config.is_driver:  # a tp peer of the driver: it keeps the tokens too
            self._append_from_driver(batch)
            return StepOutput(step.step_id, [], [])
        if grammar_step is not None:
            batch.sampling_tensors.grammar = grammar_step.mask(logits.device)
        token_ids = self.sampler(logits, batch.sampling_tensors)  # [L] int64
        if batch.num_drafts is None:
            if ps:
                ps.broadcast_from_driver(token_ids)
            logprobs = compute_logprobs(logits, token_ids, batch.num_logprobs)  # raw logits
            sampled = token_ids.tolist()
            if grammar_step is not None:
                grammar_step.consume([sampled[i] for i in batch.grammar_rows.tolist()])
            self.input_batch.append_sampled(batch.sampled_rows, sampled)  # (the worker's)
            num_sampled = None
        else:
            sampled, num_sampled, logprobs = self._verify(batch, logits, token_ids)
            if grammar_step is not None:  # (a constrained request has no drafts: one row)
                grammar_step.consume([sampled[i] for i in batch.grammar_rows.tolist()])
        drafts = (self._propose(batch, step.num_speculative_tokens)
                  if step.num_speculative_tokens > 0 else None)
        out = StepOutput(step.step_id, batch.sampled_request_ids, sampled, logprobs,
                         prompt_logprobs, num_sampled, drafts)
        if grammar_step is not None:  # grammars that broke: the scheduler ends them (INTERNAL)
            out.broken_request_ids, out.broken_messages = grammar_step.broken()
        return out

    def _verify(self, batch: PreparedStep, logits: torch.Tensor, token_ids: torch.Tensor
                ) -> tuple[list[int], list[int] | None, SampledLogprobs | None]:
        """The driver's verification of a step with drafts (``spec_decode.verify.verify_drafts``):
        keep each request's accepted drafts and the token sampled after them, append them,
        tell the tp peers, and take their logprobs.

        Args:
            batch: the step (``num_drafts`` set).
            logits: ``[L, V]`` float32, the raw logits of every sampled position.
            token_ids: ``[L]`` int64, the token sampled at each.

        Returns:
            The output tokens concatenated ``[O]``, how many each request got (None when
            all got one), and their logprobs (one entry per output token, from the raw logits
            of its position).
        """
        assert batch.num_drafts is not None
        samples = token_ids.cpu().numpy()  # [L]
        verdict = verify_drafts(samples, batch.drafts, batch.num_drafts)
        rows = verdict.output_rows  # [O]
        out = samples[rows]  # [O]
        counts = verdict.num_accepted + 1  # [S]
        if self.parallel:  # the peers' layout: each request's 1 + d rows, -1 past its outputs
            padded = np.full(len(samples), -1, dtype=np.int64)
            padded[rows] = out
            self.parallel.broadcast_from_driver(torch.from_numpy(padded).to(self.parallel.device))
        self.input_batch.append_sampled(batch.sampled_rows, out, counts)
        logprobs = None
        if any(k is not None for k in batch.num_logprobs):
            index = torch.from_numpy(rows).to(logits.device)
            logprobs = compute_logprobs(logits.index_select(0, index),
                                        token_ids.index_select(0, index),
                                        [batch.num_logprobs[i] for i in rows.tolist()])
        return out.tolist(), (counts.tolist() if (counts != 1).any() else None), logprobs

    def _append_from_driver(self, batch: PreparedStep) -> None:
        """A tp peer: receive the driver's tokens for the step's sampled requests and append
        them. Without drafts one per request (``[S]`` int64); with drafts each request's
        ``1 + d`` rows, holding its output tokens and then -1 (``[L]`` int64)."""
        ps = self.parallel
        assert ps is not None
        received = ps.broadcast_from_driver(
            torch.empty(batch.logits_indices.shape[0], dtype=torch.int64, device=ps.device))
        if batch.num_drafts is None:
            self.input_batch.append_sampled(batch.sampled_rows, received.tolist())
            return
        values = received.cpu().numpy()  # [L]
        real = values >= 0
        seg_start = np.cumsum(batch.num_drafts + 1) - (batch.num_drafts + 1)  # [S]
        counts = np.add.reduceat(real.astype(np.int64), seg_start)  # [S] (>= 1 each)
        self.input_batch.append_sampled(batch.sampled_rows, values[real], counts)

    def _propose(self, batch: PreparedStep, k: int) -> list[list[int]]:
        """The driver's drafts (up to ``k`` each) to follow the updated token list of each of
        the step's sampled requests; ``[]`` for a beam, a grammar-constrained or penalised
        request (their sampling depends on state drafts are not verified against), for
        every request when this rank has no proposer (the scheduler checked it has the same
        ``--speculative-config``, ``limits_refused``), and past ``max_model_len - 1`` tokens
        (the token sampled after the drafts must fit too)."""
        ib, sr = self.input_batch, self.input_batch.sampling_rows
        rows = batch.sampled_rows  # [S]
        drafts: list[list[int]] = [[] for _ in range(len(rows))]
        if self.ngram is None and self.draft is None:
            return drafts
        ineligible = sr.beam[rows] | sr.constrained[rows] | sr.penalized[rows]  # [S]
        room = self.max_model_len - 1 - ib.num_tokens[rows]  # [S]
        eligible = np.flatnonzero(~ineligible & (room > 0)).tolist()
        if not eligible:
            return drafts
        tokens = [ib.token_ids[r, :ib.num_tokens[r]] for r in rows[eligible].tolist()]
        if self.ngram is not None:
            proposed = [self.ngram.propose(t, k) for t in tokens]
        else:
            assert self.draft is not None
            g = self._draft_group
            proposed = self.draft.propose(
                [batch.sampled_request_ids[i] for i in eligible], tokens,
                [ib.block_table[g, r, :ib.num_blocks[r]] for r in rows[eligible].tolist()], k)
        for i, p in zip(eligible, proposed, strict=True):
            drafts[i] = p[:int(room[i])]
        return drafts

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src`` into block ``dst`` in every K and V tensor this rank
        holds, for each ``(src, dst)`` of ``pairs`` (the servicer checked them,
        ``check_block_copies``: in range, no destination twice or also a source).

        NOTE: first in every step, on every rank, scheduled or not: a pipeline stage or tp peer
        holds its own layers' or heads' K/V, and a copy must land before any later step reads
        or writes the destination. Each shared pair tensor is copied once.
        """
        if not pairs:
            return
        tensors = {id(t): t for kv in self.kv_caches for t in kv}.values()
        src, dst = torch.tensor(list(zip(*pairs, strict=True)), dtype=torch.int64,
                                device=self.device)  # [N] each
        copy_blocks(tensors, src, dst)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch) -> list:
        """Raw logprobs of the prompt tokens scored this step (``hidden [T, E]``)."""
        if not batch.prompt_chunks:
            return []
        rows = torch.tensor([c.hidden_start + j for c in batch.prompt_chunks
                             for j in range(len(c.target_token_ids))], dtype=torch.int64,
                            device=hidden.device)
        logits = self._compute_logits(hidden[rows])  # [P, V] float32
        if self.parallel and not self.parallel.config.is_driver:
            return []
        return compute_prompt_logprobs(logits, batch.prompt_chunks)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, E]`` -> ``[N, V]`` float32; under TP gathered onto every tp rank."""
        if self.parallel is None or self.parallel.config.tensor_parallel_size == 1:
            return self.model.compute_logits(hidden)
        return vocab_parallel_logits(lm_head_logits(self.model, hidden), self.vocab_size,
                                     self.parallel,
                                     getattr(self.model.config, "final_logit_softcapping", None))
