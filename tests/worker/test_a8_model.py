"""``PAGEDSERVE_CPU_A8=1``: a GGUF's layers served as stored take int8 activations
(``kernels.cpu_linear.cpu_a8_linear``, quantized per group of 32; the op itself is tested
against float64 in tests/kernels/test_a8_linear.py). Here: which layers take it (4-bit Q4_1
and the int8 Q8_0 LM head, whose table the embedding still reads; not a layer with Q6_K's
groups of 16; none without the variable), the start-up log, the logits those of the
weight-only model fed the same int8 activations, and the compiled forward in one graph close
to eager.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.cpu_linear import A8_ENV
from services.worker.config import WorkerConfig
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.quantized_linear import GroupQuantLinear
from tests.helpers import make_tiny_gguf, make_tiny_llama
from tests.worker.test_model import run_ours


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory) -> str:
    """A tiny Llama (K a multiple of 32) with Q4_1 linear layers, Q6_K values and a Q8_0
    embedding and LM head: 4-bit and int8 codes in one model."""
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-a8"), hidden_size=256,
                             intermediate_size=512, initializer_range=0.05)
    return str(make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", folder,
                              linear_type="Q4_1", types={"attn_v": "Q6_K"},
                              embedding_type="Q8_0"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    from kernels import cpu_build

    cpu_build.load()  # (from the shared cache, before the models' cache moves)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _prompt() -> list[int]:
    return torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def _dequantized_per_32(x: torch.Tensor) -> torch.Tensor:
    """What the A8 op multiplies: each group of 32 of ``x`` quantized to int8 (float32
    ``amax / 127``, round half to even) and scaled back."""
    g = x.reshape(*x.shape[:-1], -1, 32).float()
    amax = g.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(g / s).clamp(-127, 127) * s).reshape(x.shape).to(x.dtype)


def test_the_layers_take_int8_activations(q4_gguf, cache_dir, monkeypatch, caplog):
    """At float32, the A8 model's logits are the weight-only model's whose A8 layers are fed
    the dequantized int8 activations (to float32 rounding), and not its plain ones."""
    caplog.set_level(logging.INFO, logger="services.worker.loader")
    weight_only, _, _ = load_model(q4_gguf, torch.float32, "cpu", batch_invariant=True)
    assert not any(getattr(m, "a8", False) for m in weight_only.modules())
    monkeypatch.setenv(A8_ENV, "1")
    ours, _, info = load_model(q4_gguf, torch.float32, "cpu")
    assert info.quantization == "gguf"
    layer = ours.layers[0]
    for m in (layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(m, GroupQuantLinear) and m.a8 and m.packed.dim() == 4
    assert not layer.attn.qkv_proj.a8  # Q4_1 + Q6_K fused: int8 codes in groups of 16
    assert isinstance(ours.lm_head, GroupQuantLinear) and ours.lm_head.a8  # Q8_0
    assert ours.lm_head.packed.shape[-1] == 4  # (VNNI-4; the embedding reads it too)
    assert torch.equal(ours.embed_tokens(torch.arange(40)),
                       weight_only.embed_tokens(torch.arange(40)))
    assert "A8: activations int8 per 32" in caplog.text
    prompt = _prompt()
    plain = run_ours(weight_only, prompt)
    a8_names = {n for n, m in ours.named_modules() if getattr(m, "a8", False)}
    for name, m in weight_only.named_modules():
        if name in a8_names:
            m.register_forward_pre_hook(lambda _m, args: (_dequantized_per_32(args[0]),))
    reference = run_ours(weight_only, prompt)
    out = run_ours(ours, prompt)
    # NOTE: the two compute a layer's input in float32 in different orders (e.g. the SiLU gate
    # from A8 vs weight-only sums), so now and then an activation lands on the other side of
    # a rounding boundary of its quantization (a step of amax / 127) and that token's logits
    # move by a step's worth: 2 of these 40 tokens, ~1e-6 for the other 38
    rows = (out - reference).abs().amax(-1)
    assert (rows <= 1e-5).float().mean() >= 0.9, rows
    assert rows.max() <= 2e-2, rows
    assert (out - plain).abs().max() > 1e-3  # (the activations were quantized)


def test_a8_compiles_to_one_graph_close_to_eager(q4_gguf, cache_dir, monkeypatch):
    from services.worker.compiled import CompiledForward
    from tests.worker.test_compiled import _steps

    monkeypatch.setenv(A8_ENV, "1")
    runner = ModelRunner(WorkerConfig(model=q4_gguf, dtype="float32", device="cpu",
                                      kv_cache_memory=8 << 20))
    assert isinstance(runner.forward, CompiledForward)
    assert runner.model.layers[0].mlp.down_proj.a8
    batch = runner.input_batch
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for step in _steps():
            prepared = batch.prepare(batch.update(step))
            args = (prepared.input_ids, prepared.positions, runner.kv_caches,
                    runner.layer_metadata(prepared))
            # the fused elementwise ops round differently now and then, which can move an
            # activation across a quantization step (see above): most tokens agree closely
            rows = (runner.forward(*args) - runner.model(*args)).abs().amax(-1)
            assert (rows <= 1e-4).float().mean() >= 0.9, rows
            assert rows.max() <= 0.1, rows


@pytest.mark.parametrize("kind", ["4-bit", "int8"])
def test_an_a8_table_is_read_by_the_embedding(kind):
    """A tied model's A8 LM head keeps the only copy of the table: the embedding gathers its
    rows from the A8 layouts as from the weight-only ones."""
    from services.worker.quantized_linear import QuantizedEmbedding

    gen = torch.Generator().manual_seed(5)
    codes = (torch.randint(0, 16, (70, 64), dtype=torch.uint8, generator=gen) if kind == "4-bit"
             else torch.randint(-127, 128, (70, 64), dtype=torch.int8, generator=gen))
    scale, mins = torch.rand(70, 2, generator=gen), torch.rand(70, 2, generator=gen)
    ids = torch.tensor([[0, 31, 32], [69, 5, 40]])
    tables = [GroupQuantLinear(codes, scale, mins, out_dtype=torch.float32, a8=a8)
              for a8 in (False, True)]
    assert [t.a8 for t in tables] == [False, True]
    rows = [QuantizedEmbedding(t, torch.float32)(ids) for t in tables]
    expected = codes.float() * scale.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)
    assert torch.equal(rows[0], expected[ids]) and torch.equal(rows[1], expected[ids])
