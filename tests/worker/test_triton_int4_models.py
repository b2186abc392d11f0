"""4-bit checkpoints served as stored on the Triton backend (``triton_int4_linear.py``): the
CUDA path, run here by Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton is imported) on a CPU worker with ``attention_backend="triton"``; on a CUDA
machine the same tests run on the GPU (scripts/gpu_check.sh), which has never been done.

At float32, on tiny random Llamas (the interpreter is slow: hidden 64, few tokens):

- AWQ and GPTQ (act-order) checkpoints (``test_int4_models.make_int4_checkpoint``): every
  decoder linear layer a ``TritonInt4Linear``; greedy tokens equal transformers' on the
  dequantized weights ``(q - z) * s``;
- a GGUF with Q4_1 layers, a Q8_0 ``attn_v`` and a Q8_0 embedding / LM head: the modules of
  4-bit codes as stored, the q/k/v module (a Q8_0 part) and the embedding and LM head
  dequantized at load (said in the log); greedy tokens equal transformers' on the float
  conversion (the same dequantized values);
- one layer of Q4_K blocks (K a multiple of 256: too large a model for the interpreter), with
  a bias and an input permutation, against float64 on the file's dequantized values; a layer
  of int8 codes is refused;
- a CUDA device is no longer refused for an AWQ / GPTQ checkpoint on the Triton backend, still
  is on another.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from services.common.model_files import resolve_model
from services.worker.as_stored import int4_stored
from services.worker.config import WorkerConfig
from services.worker.gguf_blocks import split_blocks
from services.worker.int4_checkpoints import quant_config
from services.worker.model_runner import ModelRunner
from services.worker.triton_int4_linear import TritonInt4Linear
from tests.helpers import make_tiny_gguf, make_tiny_llama, random_gguf_blocks
from tests.worker.test_int4_models import make_int4_checkpoint
from tests.worker.test_model import drive_greedy, hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_TOKENS = 4
PROMPTS = [[5, 7, 9, 11, 3], list(range(20, 37))]


@pytest.fixture(scope="module")
def tiny_64(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-triton-int4"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _greedy_on_triton(path: Path, caplog, quantization: str | None = None
                      ) -> tuple[ModelRunner, list[list[int]], str]:
    caplog.set_level(logging.INFO, logger="services.worker")
    runner = ModelRunner(WorkerConfig(model=str(path), dtype="float32", device=DEVICE,
                                      kv_cache_memory=1 << 20, attention_backend="triton",
                                      quantization=quantization))
    assert runner.attention_backend_name == "triton"
    outputs = drive_greedy(runner, PROMPTS, NEW_TOKENS, token_budget=12)  # chunked prefill
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    return runner, outputs, line


def _reference(folder: Path) -> list[list[int]]:
    hf = HFLlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize(("method", "group", "act_order"),
                         [("awq", 64, False), ("gptq", 32, True)])
def test_int4_checkpoint_on_triton_equals_the_dequantized_reference(
        tiny_64, tmp_path, method, group, act_order, caplog):
    path, ref_dir = make_int4_checkpoint(tmp_path / "ckpt", tiny_64, method, group, act_order)
    runner, outputs, line = _greedy_on_triton(path, caplog)
    assert runner.weights_quantization == method
    for layer in runner.model.layers:
        for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                  layer.mlp.down_proj):
            assert isinstance(m, TritonInt4Linear) and m.qweight.dtype == torch.uint8
            assert (m.perm is not None) == act_order and m.weight_min is not None
    assert (f"12 of 12 {method.upper()} int4, group {group}"
            f"{', act-order' if act_order else ''} as stored (4-bit codes, a scale and min "
            f"per {group}, Triton kernel)") in line
    assert outputs == _reference(ref_dir)


def test_gguf_four_bit_layers_on_triton_the_rest_dequantized(tiny_64, tmp_path, cache_dir,
                                                             caplog):
    path = make_tiny_gguf(tmp_path / "tiny-q4_1.gguf", tiny_64, linear_type="Q4_1",
                          types={"attn_v": "Q8_0"}, embedding_type="Q8_0")
    runner, outputs, line = _greedy_on_triton(path, caplog, quantization="gguf")
    assert runner.weights_quantization == "gguf"
    for layer in runner.model.layers:
        assert not isinstance(layer.attn.qkv_proj, TritonInt4Linear)  # a Q8_0 part: float
        for m in (layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(m, TritonInt4Linear) and m.stored_as == "GGUF Q4_1"
    model = runner.model
    assert type(model.embed_tokens) is torch.nn.Embedding
    assert model.embed_tokens.weight.dtype == torch.float32
    assert "9 of 12 GGUF Q4_1 as stored (4-bit codes, a scale and min per 32, Triton" in line
    assert "Triton backend: GGUF Q4_0 / Q4_1 / Q4_K layers as stored" in line
    assert "9 of 12 GGUF modules are served as stored" in caplog.text
    assert outputs == _reference(resolve_model(str(path)).cache_dir("weights"))


def test_a_gguf_on_triton_is_dequantized_unless_asked(tiny_64, tmp_path, cache_dir, caplog):
    """The Triton kernel has not run on a GPU yet: a GGUF's default there is the float
    conversion, ``--quantization gguf`` opts in (above)."""
    path = make_tiny_gguf(tmp_path / "tiny-q4_0.gguf", tiny_64, linear_type="Q4_0")
    runner, outputs, _ = _greedy_on_triton(path, caplog)
    assert not any(isinstance(m, TritonInt4Linear) for m in runner.model.modules())
    assert "--quantization gguf serves its 4-bit layers as stored" in caplog.text
    assert outputs == _reference(resolve_model(str(path)).cache_dir("weights"))


def test_a_cuda_device_is_refused_only_off_the_triton_backend(tiny_64, tmp_path):
    """Checked before any tensor goes to the device (none here has CUDA)."""
    import json

    path, _ = make_int4_checkpoint(tmp_path / "ckpt", tiny_64, "awq", 32)
    int4 = quant_config(json.loads((path / "config.json").read_text()))
    assert int4 is not None
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="awq checkpoints are served on the CPU or with the "
                                         "triton attention backend only, not cuda"):
        int4_stored(path, int4, cuda, None, range(3))
    stored, _ = int4_stored(path, int4, cuda, None, range(3), triton=True)
    assert len(stored.linears) == 12 and stored.source == "AWQ"


def test_a_q4_k_layer_with_bias_and_perm_equals_float64():
    n, k = 40, 256  # (N not a multiple of the tile)
    weight = split_blocks(random_gguf_blocks("Q4_K", n, k, seed=5), "Q4_K", (n, k))
    assert weight.bits == 4 and weight.min is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    perm = torch.randperm(k, generator=gen)
    layer = TritonInt4Linear(weight, bias, perm).to(DEVICE)
    y = layer(x.to(DEVICE))
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    want = x.double()[..., perm] @ weight.dequantize().double().T + bias.double()
    torch.testing.assert_close(y.cpu().double(), want, atol=1e-5, rtol=1e-5)
    int8 = split_blocks(random_gguf_blocks("Q6_K", n, k), "Q6_K", (n, k))
    with pytest.raises(ValueError, match="TritonInt4Linear takes 4-bit codes"):
        TritonInt4Linear(int8)
