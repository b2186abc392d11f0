"""Quantized weights in the worker (``--quantization int8|w8a8``, GGUF as stored) against
transformers:

- ``int8`` at float32: greedy tokens exactly those of transformers whose linear weights were
  replaced by the same dequantized int8 values (through the runner: chunked prefill, late
  arrival, preemption);
- ``w8a8`` at float32: the logits of transformers with those weights and its linear layers'
  inputs quantized per token the same way (to 1e-4), and the same greedy tokens;
- a GGUF whose linear weights are ``Q8_0`` is served from its int8 values (no float copy of
  them is read); so is one of every other format served as stored (4-bit and 5/6-bit codes,
  mixed in one module), with its embedding and LM head as stored: at float32 the float
  conversion's logits to float32 rounding, at bf16 nearer the float32 logits than the bf16
  float conversion (whose weights are rounded to bf16) comes, and greedy tokens equal
  transformers' reading the GGUF; ``--quantization none`` dequantizes at load; a truncated
  tensor is refused, named;
- the start-up log says what the weights are stored as; bad combinations fail at start naming
  ``--quantization``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from kernels.int8_linear import dequantize, quantize_symmetric
from services.common.model_files import resolve_model
from services.worker.config import WorkerConfig
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.quantized_linear import (
    GroupQuantLinear,
    Int8Linear,
    QuantizedEmbedding,
    W8A8Linear,
)
from tests.helpers import make_tiny_gguf
from tests.worker.test_model import drive_greedy, hf_greedy, run_ours

NEW_TOKENS = 16


def _hf_with_int8_weights(path, fake_quantize_inputs: bool = False) -> HFLlamaForCausalLM:
    """transformers' float32 model with each decoder linear weight replaced by its per-output-
    channel int8 dequantization; with ``fake_quantize_inputs`` each such layer's input is
    replaced by its per-token int8 dequantization too (what W8A8 computes, in float)."""
    model = HFLlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for module in model.model.layers.modules():
        if not isinstance(module, nn.Linear):
            continue
        with torch.no_grad():
            module.weight.copy_(dequantize(*quantize_symmetric(module.weight)))
        if fake_quantize_inputs:
            module.register_forward_pre_hook(
                lambda m, args: (dequantize(*quantize_symmetric(args[0].view(
                    -1, args[0].shape[-1]))).view(args[0].shape),))
    return model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 9, 40, 300)]


def test_int8_greedy_equals_transformers_with_the_dequantized_weights(tiny_llama,
                                                                      one_torch_thread):
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, enforce_eager=True,
                                      quantization="int8"))
    layer = runner.model.layers[0]
    assert isinstance(layer.attn.qkv_proj, Int8Linear)
    assert isinstance(layer.mlp.down_proj, Int8Linear)
    prompts = _prompts()
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64,
                           arrivals=[3, 0, 0, 0], preempt=(8, 2))
    ref = _hf_with_int8_weights(tiny_llama)
    assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    # and int8 is not float32: some logits moved (the comparison above is not vacuous)
    plain = HFLlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompts[3]])
        assert (ref(ids).logits - plain(ids).logits).abs().max() > 1e-2


def test_w8a8_equals_transformers_with_quantized_weights_and_activations(tiny_llama,
                                                                         one_torch_thread):
    ours, _, _ = load_model(str(tiny_llama), torch.float32, "cpu", quantization="w8a8")
    assert isinstance(ours.layers[0].attn.o_proj, W8A8Linear)
    ref = _hf_with_int8_weights(tiny_llama, fake_quantize_inputs=True)
    # NOTE: now and then the float32 rounding of the two computations puts an activation on
    # either side of a rounding boundary of its quantization (a step of amax / 127), and from
    # there the attention carries the difference to the later tokens: in the 300-token prompt
    # one does at token 89 (later logits then differ by ~4e-3 on average); in the others none.
    prompt = _prompts()[2]
    with torch.inference_mode():
        expected = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(run_ours(ours, prompt), expected, atol=1e-4, rtol=1e-4)
    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, enforce_eager=True,
                                      quantization="w8a8"))
    prompts = _prompts()[:3]
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64)
    assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]


def test_w8a8_compiles_to_one_graph_close_to_eager(tiny_llama):
    """The compiled forward (the CPU default): the native W8A8 op (which quantizes the
    activations itself) inside one dynamic-shape graph, no step recompiles, and the hidden
    states within the activation quantization's own noise of the eager module's (a fused
    norm rounds differently now and then, which can move an activation by one step)."""
    from services.worker.compiled import CompiledForward
    from tests.worker.test_compiled import _steps

    runner = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, quantization="w8a8"))
    assert isinstance(runner.forward, CompiledForward)
    batch = runner.input_batch
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for step in _steps():
            prepared = batch.prepare(batch.update(step))
            args = (prepared.input_ids, prepared.positions, runner.kv_caches,
                    runner.layer_metadata(prepared))
            torch.testing.assert_close(runner.forward(*args), runner.model(*args),
                                       atol=2e-2, rtol=1e-2)


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-q8"))
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", folder,
                          linear_type="Q8_0")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _check_logits_against_the_conversion(path, ours: dict, prompt: list[int]) -> None:
    """``ours``: the GGUF as stored by dtype (float32, bfloat16). At float32 the float
    conversion's logits to float32 rounding; at bf16 nearer the float32 conversion's logits
    (the reference) than its bf16 model (weights rounded to bf16) comes, on average. Both
    float32 loads on the native kernel (``batch_invariant``), as the stored ones are."""
    converted = str(resolve_model(path).cache_dir("weights"))  # the float32 conversion
    ref = run_ours(load_model(converted, torch.float32, "cpu", batch_invariant=True)[0], prompt)
    torch.testing.assert_close(run_ours(ours[torch.float32], prompt), ref, atol=1e-4, rtol=1e-4)
    floats, _, _ = load_model(converted, torch.bfloat16, "cpu")
    assert type(floats.layers[0].attn.qkv_proj) is not GroupQuantLinear
    err = [(run_ours(m, prompt).double() - ref).abs().mean() for m in (ours[torch.bfloat16],
                                                                          floats)]
    assert err[0] < err[1], err


def test_gguf_q8_0_is_served_as_int8_near_the_float_conversions_logits(q8_0_gguf, cache_dir,
                                                                       caplog):
    """The Q8_0 values and scales as stored, multiplied inside the GEMM (a scale per 32)."""
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    ours = {dtype: load_model(str(q8_0_gguf), dtype, "cpu",
                              batch_invariant=dtype == torch.float32)[0]
            for dtype in (torch.float32, torch.bfloat16)}
    assert all(isinstance(m, GroupQuantLinear) for layer in ours[torch.bfloat16].layers
               for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                         layer.mlp.down_proj))
    assert "12 of 12 GGUF Q8_0 as stored" in caplog.text
    _check_logits_against_the_conversion(str(q8_0_gguf), ours, _prompts()[2])


def test_gguf_is_requantized_only_when_asked_and_then_with_a_warning(q8_0_gguf, cache_dir,
                                                                     caplog):
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    ours, _, _ = load_model(str(q8_0_gguf), torch.float32, "cpu", quantization="w8a8")
    assert isinstance(ours.layers[0].mlp.down_proj, W8A8Linear)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("quantized tensors are not served as stored: --quantization w8a8" in w
               for w in warnings)
    assert "12 of 12 int8 per output channel, activations int8 per token" in caplog.text


def test_start_up_log_says_what_the_weights_are_stored_as(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    load_model(str(tiny_llama), torch.bfloat16, "cpu")
    load_model(str(tiny_llama), torch.bfloat16, "cpu", quantization="int8")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    assert len(lines) == 2
    assert "decoder linear layers: 12 of 12 bfloat16; embedding and LM head bfloat16" in lines[0]
    assert ("decoder linear layers: 12 of 12 int8 per output channel, weight-only "
            "(--quantization int8); embedding and LM head bfloat16") in lines[1]
    mib = [float(line.split("; ")[-1].split()[0]) for line in lines]
    assert mib[1] < 0.8 * mib[0]  # int8: the decoder's linear weights at half the bytes


def test_bad_combinations_fail_at_start_naming_the_flag(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="--quantization 'int4' is not one of int8, w8a8"):
        load_model(str(tiny_llama), torch.float32, "cpu", quantization="int4")
    for mode in ("int8", "w8a8"):  # checked before CUDA is touched
        with pytest.raises(ValueError, match=f"--quantization {mode} is implemented for the "
                                             "CPU only, not cuda"):
            load_model(str(tiny_llama), torch.bfloat16, "cuda", quantization=mode)

    from kernels import cpu_build

    def no_compiler() -> None:
        raise RuntimeError("no g++")
    monkeypatch.setattr(cpu_build, "load", no_compiler)
    with pytest.raises(ValueError, match=r"--quantization int8 needs the native CPU .*no g\+\+"):
        ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                 kv_cache_memory=1 << 20, enforce_eager=True, quantization="int8"))


def test_the_flag_is_a_worker_flag_that_serve_forwards(capsys):
    from services.cli.flags import forwarded_argv, serve_parser

    ns = serve_parser().parse_args(["--quantization", "w8a8"])
    worker = forwarded_argv("worker", ns)
    assert worker[worker.index("--quantization") + 1] == "w8a8"
    assert "--quantization" not in forwarded_argv("scheduler", ns)
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--quantization", "int4"])
    assert "argument --quantization: invalid choice: 'int4'" in capsys.readouterr().err


# Formats per GGUF tensor kind: the legacy ones by gguf-py from the model's weights; a Q4_K_M
# -like mix of k-quants (random blocks: gguf-py cannot quantize them) with 4-bit and 6-bit
# rows in one module (attn_v, ffn_down as Q6_K); Gemma 3's Q5_0 with a Q8_0 attn_v.
FORMATS = {
    "Q4_0": {}, "Q4_1": {}, "Q5_1": {},
    "Q4_K": {"attn_v": "Q6_K", "ffn_down": "Q6_K"},
    "Q5_K": {"attn_output": "Q4_K"},
    "Q5_0": {"attn_v": "Q8_0"},
}


@pytest.fixture(scope="module")
def tiny_256(tmp_path_factory):
    """A tiny Llama whose linear layers' K are multiples of 256 (the k-quants' blocks)."""
    from tests.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-256"), hidden_size=256,
                           intermediate_size=512, initializer_range=0.05)


def _gguf(tmp_path, tiny_256, linear_type: str) -> str:
    return str(make_tiny_gguf(tmp_path / f"tiny-{linear_type}.gguf", tiny_256,
                              linear_type=linear_type, types=FORMATS[linear_type],
                              embedding_type="Q8_0"))


@pytest.mark.parametrize("linear_type", list(FORMATS))
def test_gguf_formats_are_served_as_stored_near_the_float_conversions_logits(
        tiny_256, tmp_path, cache_dir, linear_type, caplog):
    """Every decoder linear layer, the embedding and the (untied) LM head from the file's
    codes and scales, at a fraction of the float conversion's bytes."""
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    path = _gguf(tmp_path, tiny_256, linear_type)
    by_dtype = {dtype: load_model(path, dtype, "cpu", batch_invariant=dtype == torch.float32)
                for dtype in (torch.float32, torch.bfloat16)}
    ours, _, info = by_dtype[torch.bfloat16]
    assert info.quantization == "gguf"
    layers = [m for layer in ours.layers for m in (layer.attn.qkv_proj, layer.attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(isinstance(m, GroupQuantLinear) for m in layers)
    assert isinstance(ours.embed_tokens, QuantizedEmbedding)
    assert isinstance(ours.lm_head, GroupQuantLinear)
    assert ours.lm_head.packed.dtype == torch.int8  # Q8_0
    assert f"GGUF {linear_type}" in caplog.text and "embedding GGUF Q8_0 as stored" in caplog.text
    _check_logits_against_the_conversion(path, {d: m for d, (m, _, _) in by_dtype.items()},
                                         _prompts()[2])
    converted = resolve_model(path).cache_dir("weights")
    floats, _, _ = load_model(str(converted), torch.bfloat16, "cpu")
    size = [sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
            for m in (ours, floats)]
    assert size[0] < 0.8 * size[1]  # (bf16: 2 bytes a weight; 4-bit codes + scales: ~0.75)


def test_gguf_as_stored_greedy_equals_transformers_reading_the_gguf(tiny_256, tmp_path,
                                                                    cache_dir, one_torch_thread):
    """The k-quant mix at float32 through the runner (chunked prefill, late arrival,
    preemption, compiled): transformers' own GGUF reader's greedy tokens."""
    from transformers import AutoModelForCausalLM

    path = _gguf(tmp_path, tiny_256, "Q4_K")
    runner = ModelRunner(WorkerConfig(model=path, dtype="float32", device="cpu",
                                      kv_cache_memory=8 << 20))
    assert isinstance(runner.model.layers[0].mlp.down_proj, GroupQuantLinear)
    prompts = _prompts()
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64,
                           arrivals=[3, 0, 0, 0], preempt=(8, 2))
    source = resolve_model(path)
    ref = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file,
                                               dtype=torch.float32).eval()
    assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]


def test_quantization_none_dequantizes_a_gguf_and_gguf_needs_one(tiny_256, tiny_llama,
                                                                 tmp_path, cache_dir):
    path = _gguf(tmp_path, tiny_256, "Q4_1")
    floats, _, info = load_model(path, torch.bfloat16, "cpu", quantization="none")
    assert info.quantization == ""
    assert not any(isinstance(m, (GroupQuantLinear, QuantizedEmbedding))
                   for m in floats.modules())
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf model"):
        load_model(str(tiny_llama), torch.bfloat16, "cpu", quantization="gguf")


def test_a_truncated_quantized_tensor_is_refused_naming_it(tiny_256, tmp_path, cache_dir):
    """A file cut short inside a quantized tensor: the load fails naming the tensor (before
    any conversion), and nothing is served half-loaded; a tensor whose bytes do not fit its
    type and shape is named too."""
    import gguf

    from services.worker.gguf_weights import GGUFIndex, TensorInfo, read_stored_weights

    path = _gguf(tmp_path, tiny_256, "Q4_K")
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.2.ffn_up.weight")
    info = TensorInfo("Q4_K", tuple(int(d) for d in tensor.shape), int(tensor.data_offset),
                      int(tensor.n_bytes) - 1)
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.ffn_gate\.weight': Q4_K "
                                         r"tensor of shape \(512, 256\) needs 73728 bytes"):
        read_stored_weights(path, GGUFIndex("llama", {"blk.0.ffn_up.weight": info,
                                                      "blk.0.ffn_gate.weight": info}),
                            4, 2, [0], embedding=False)
    with open(path, "r+b") as f:
        f.truncate(tensor.data_offset + tensor.n_bytes // 2)
    with pytest.raises(ValueError, match=r"tensor '(blk\.2\.ffn_up|output_norm)\.weight' ends "
                                         r"at byte \d+, past the file's"):
        load_model(path, torch.bfloat16, "cpu")
    assert not any(cache_dir.rglob("config.json"))  # no conversion was written
