"""int8 weights in the worker (``--quantization int8|w8a8``, GGUF Q8_0) against transformers:

- ``int8`` at float32: greedy tokens exactly those of transformers whose linear weights were
  replaced by the same dequantized int8 values (through the runner: chunked prefill, late
  arrival, preemption);
- ``w8a8`` at float32: the logits of transformers with those weights and its linear layers'
  inputs quantized per token the same way (to 1e-4), and the same greedy tokens;
- a GGUF whose linear weights are ``Q8_0`` is served from its int8 values (no float copy of
  them is read) with logits bitwise equal to the float conversion's, at float32 and bf16;
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
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.quantized_linear import GroupInt8Linear, Int8Linear, W8A8Linear
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
    runner = ModelRunner(str(tiny_llama), dtype="float32", device="cpu",
                         kv_cache_memory=4 << 20, enforce_eager=True, quantization="int8")
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
    runner = ModelRunner(str(tiny_llama), dtype="float32", device="cpu",
                         kv_cache_memory=4 << 20, enforce_eager=True, quantization="w8a8")
    prompts = _prompts()[:3]
    outputs = drive_greedy(runner, prompts, NEW_TOKENS, token_budget=64)
    assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]


def test_w8a8_compiles_to_one_graph_close_to_eager(tiny_llama):
    """The compiled forward (the CPU default): the per-token quantization and
    ``torch._int_mm`` inside one dynamic-shape graph, no step recompiles, and the hidden states
    within the activation quantization's own noise of the eager module's (a fused division
    rounds differently now and then, which moves an activation by one step)."""
    from services.worker.compiled import CompiledForward
    from tests.worker.test_compiled import _steps

    runner = ModelRunner(str(tiny_llama), dtype="float32", device="cpu",
                         kv_cache_memory=4 << 20, quantization="w8a8")
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_q8_0_is_served_as_int8_with_the_float_conversions_logits(q8_0_gguf, cache_dir,
                                                                       dtype, caplog):
    """The Q8_0 values and scales as stored, dequantized inside the GEMM to exactly the
    conversion's weights (rounded to bf16 as its bf16 model's): the same native kernel path
    gives the same logits bit for bit (float32: both on the native kernel,
    ``batch_invariant``)."""
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    batch_invariant = dtype == torch.float32
    ours, _, _ = load_model(str(q8_0_gguf), dtype, "cpu", batch_invariant=batch_invariant)
    assert all(isinstance(m, GroupInt8Linear) for layer in ours.layers
               for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                         layer.mlp.down_proj))
    assert "12 of 12 GGUF Q8_0 as stored" in caplog.text
    converted = resolve_model(str(q8_0_gguf)).cache_dir("weights")  # the float32 conversion
    floats, _, _ = load_model(str(converted), dtype, "cpu", batch_invariant=batch_invariant)
    assert type(floats.layers[0].attn.qkv_proj) is not GroupInt8Linear
    prompt = _prompts()[2]
    assert torch.equal(run_ours(ours, prompt), run_ours(floats, prompt))


def test_gguf_is_requantized_only_when_asked_and_then_with_a_warning(q8_0_gguf, cache_dir,
                                                                     caplog):
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    ours, _, _ = load_model(str(q8_0_gguf), torch.float32, "cpu", quantization="w8a8")
    assert isinstance(ours.layers[0].mlp.down_proj, W8A8Linear)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("Q8_0 linear layers not served as stored: --quantization w8a8" in w
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
        ModelRunner(str(tiny_llama), dtype="float32", device="cpu", kv_cache_memory=1 << 20,
                    enforce_eager=True, quantization="int8")


def test_the_flag_is_a_worker_flag_that_serve_forwards(capsys):
    from services.cli.flags import forwarded_argv, serve_parser

    ns = serve_parser().parse_args(["--quantization", "w8a8"])
    worker = forwarded_argv("worker", ns)
    assert worker[worker.index("--quantization") + 1] == "w8a8"
    assert "--quantization" not in forwarded_argv("scheduler", ns)
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--quantization", "int4"])
    assert "argument --quantization: invalid choice: 'int4'" in capsys.readouterr().err
