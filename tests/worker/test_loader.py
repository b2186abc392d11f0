"""Loader: transformers folders, GGUF conversion once into the cache, and its failure modes."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import transformers

from kernels.cpu_attention import cpu_isa
from services.common.model_files import resolve_model
from services.worker.loader import load_model
from services.worker.packed_linear import PackedLinear
from services.worker.quantized_linear import QuantizedEmbedding
from tests.helpers import make_tiny_gguf
from tests.worker.test_model import run_ours


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(path))
    return path


@pytest.fixture
def tiny_gguf(tiny_llama, tmp_path):
    return make_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, eos_token_id=7)


def _no_transformers(*args, **kwargs):
    raise AssertionError("transformers must not be called: the conversion is cached")


def test_gguf_converted_once_into_cache_dir(tiny_llama, tiny_gguf, cache_dir, monkeypatch):
    model, config, info = load_model(str(tiny_gguf), torch.float32, "cpu")
    target = resolve_model(str(tiny_gguf)).cache_dir("weights")
    assert target.is_relative_to(cache_dir)
    assert (target / "config.json").is_file() and list(target.glob("*.safetensors"))
    # no temporary folder left behind (beside the tensor index, read before the conversion)
    assert sorted(target.parent.iterdir()) == [target.parent / "gguf_index.json", target]
    assert (info.name, info.eos_token_ids, info.vocab_size, info.max_model_len) == (
        "tiny", [7], 512, 1024)
    assert config["num_key_value_heads"] == 2
    expected, _, _ = load_model(str(tiny_llama), torch.float32, "cpu")
    token_ids = list(range(1, 60))
    first = run_ours(model, token_ids)
    # transformers un-permuted GGUF's Q/K rows: same model as the safetensors original
    torch.testing.assert_close(first, run_ours(expected, token_ids), atol=1e-5, rtol=1e-5)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_transformers)
    again, _, _ = load_model(str(tiny_gguf), torch.float32, "cpu")
    assert torch.equal(run_ours(again, token_ids), first)


def test_failed_conversion_leaves_no_cache(tiny_gguf, cache_dir, monkeypatch):
    def half_save(self, folder, **kwargs):
        (Path(folder) / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", half_save)
    with pytest.raises(OSError, match="disk full"):
        load_model(str(tiny_gguf), torch.float32, "cpu")
    target = resolve_model(str(tiny_gguf)).cache_dir("weights")
    assert not target.exists()
    assert list(target.parent.iterdir()) == [target.parent / "gguf_index.json"]


def test_conversion_race_keeps_the_first_copy(tiny_gguf, cache_dir, monkeypatch):
    target = resolve_model(str(tiny_gguf)).cache_dir("weights")
    save = transformers.PreTrainedModel.save_pretrained

    def racing_save(self, folder, **kwargs):
        save(self, target, **kwargs)  # another process finishes first ...
        save(self, folder, **kwargs)  # ... while we write our own copy

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", racing_save)
    model, _, _ = load_model(str(tiny_gguf), torch.float32, "cpu")
    assert sorted(target.parent.iterdir()) == [target.parent / "gguf_index.json", target]
    assert model.config.num_hidden_layers == 3


def test_folder_eos_ids_and_dtype(tiny_llama, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    model, _, info = load_model(str(folder), torch.bfloat16, "cpu")
    assert info.eos_token_ids == [2, 5] and info.name == "m"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    (folder / "generation_config.json").unlink()
    _, _, info = load_model(str(folder), torch.float32, "cpu")
    assert info.eos_token_ids == [2]  # from config.json


def test_bad_checkpoints(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj"):
        load_model(str(folder), torch.float32, "cpu")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        load_model(str(folder), torch.float32, "cpu")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(folder), torch.float32, "cpu")
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing"), torch.float32, "cpu")


def test_smollm2_default_model_cached_load_is_fast(monkeypatch):
    """The packaged default model, default cache: converted at most once per machine."""
    load_model(None, torch.float32, "cpu")  # converts (~20 s) only if this machine never did
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_transformers)
    start = time.perf_counter()
    model, config, info = load_model(None, torch.float32, "cpu")
    elapsed = time.perf_counter() - start
    assert (info.name, info.eos_token_ids, info.vocab_size, info.max_model_len) == (
        "SmolLM2-135M-Instruct.Q4_1", [2], 49152, 8192)
    assert config["tie_word_embeddings"]  # no LM head read from the checkpoint
    # the GGUF as stored: the tied LM head is the embedding's Q8_0 table, read in place
    assert info.quantization == "gguf" and isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head is model.embed_tokens.table
    floats, _, _ = load_model(None, torch.float32, "cpu", quantization="none")
    if cpu_isa() == "avx2":  # a float32 model's layers on the native kernel: the table packed
        assert isinstance(floats.lm_head, PackedLinear)
    else:
        assert floats.lm_head is None
    assert elapsed < 10, f"cached load took {elapsed:.1f} s"
