"""The one check of a LoRA adapter folder (services/common/lora.py), on real PEFT folders that
``peft`` writes for a tiny random Llama: valid adapters pass with their rank and scaling, and
every bad one is refused with a message naming its problem."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.common.lora import AdapterError, check_adapter, model_config_of
from tests.helpers import make_peft_lora, make_tiny_llama


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_llama(root / "model")
    other = make_tiny_llama(root / "other", hidden_size=32, num_hidden_layers=4)
    return {
        "model": str(model), "other": str(other),
        "r4": make_peft_lora(model, root / "r4", r=4, lora_alpha=8),
        "r8_qv": make_peft_lora(model, root / "r8_qv", r=8, target_modules=("q_proj", "v_proj"),
                                lora_alpha=32, use_rslora=True),
        "r16": make_peft_lora(model, root / "r16", r=16, target_modules=("o_proj", "down_proj")),
        "of_other": make_peft_lora(other, root / "of_other", r=4),
    }


@pytest.fixture(scope="module")
def config(folders) -> dict:
    return json.loads(Path(folders["model"], "config.json").read_text())


def _copy(src: str, dst: Path, **config_changes) -> str:
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_changes}))
    return str(dst)


def test_valid_adapters_of_three_ranks_pass_with_their_scaling(folders, config):
    a = check_adapter(folders["r4"], config, max_lora_rank=16)
    assert (a.rank, a.lora_alpha, a.use_rslora) == (4, 8.0, False)
    assert a.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                "up_proj", "v_proj")
    assert a.base_model_name_or_path == folders["model"]
    b = check_adapter(folders["r8_qv"], config, max_lora_rank=16)
    assert (b.rank, b.lora_alpha, b.use_rslora, b.target_modules) == (
        8, 32.0, True, ("q_proj", "v_proj"))
    assert check_adapter(folders["r16"], config, max_lora_rank=16).rank == 16


def test_a_rank_above_the_limit_is_refused_naming_both(folders, config):
    with pytest.raises(AdapterError, match=r"rank 16 .* is above --max-lora-rank 8"):
        check_adapter(folders["r16"], config, max_lora_rank=8)


def test_missing_folder_and_files_are_named(folders, config, tmp_path):
    with pytest.raises(AdapterError, match="no such adapter folder"):
        check_adapter(str(tmp_path / "nope"), config, 16)
    no_weights = Path(_copy(folders["r4"], tmp_path / "a"))
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"missing adapter_model\.safetensors"):
        check_adapter(str(no_weights), config, 16)
    (no_weights / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"missing adapter_config\.json"):
        check_adapter(str(no_weights), config, 16)


def test_a_target_module_the_model_lacks_is_named(folders, config, tmp_path):
    in_config = _copy(folders["r4"], tmp_path / "a", target_modules=["q_proj", "c_attn"])
    with pytest.raises(AdapterError, match="target module 'c_attn' is one the model lacks"):
        check_adapter(in_config, config, 16)
    in_tensors = Path(_copy(folders["r4"], tmp_path / "b", target_modules="all-linear"))
    save_file({f"base_model.model.model.layers.0.self_attn.qkv_proj.lora_{x}.weight":
               torch.zeros(4, 64) for x in "AB"}, in_tensors / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="target module 'qkv_proj'"):
        check_adapter(str(in_tensors), config, 16)


def test_a_base_model_mismatch_is_refused_where_decidable(folders, config, tmp_path):
    with pytest.raises(AdapterError, match=r"base model mismatch: .*hidden_size=32.* "
                                           r"hidden_size=64"):
        check_adapter(folders["of_other"], config, 16)
    # without a readable base (a hub id), the shapes still refuse it
    hub = _copy(folders["of_other"], tmp_path / "hub", base_model_name_or_path="org/model")
    with pytest.raises(AdapterError, match=r"layer 3 but the model has 3 layers|do not fit"):
        check_adapter(hub, config, 16)


def test_shapes_that_do_not_fit_the_model_are_refused(folders, config, tmp_path):
    hub = _copy(folders["r4"], tmp_path / "a", base_model_name_or_path="org/model")
    narrow = {**config, "intermediate_size": 96}
    with pytest.raises(AdapterError, match=r"layer 0 down_proj: shapes lora_A \[4, 128\].* "
                                           r"do not fit .* \(96 in, 64 out"):
        check_adapter(hub, narrow, 16)
    fewer_layers = {**config, "num_hidden_layers": 2}
    with pytest.raises(AdapterError, match="for layer 2 but the model has 2 layers"):
        check_adapter(hub, fewer_layers, 16)


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, r"use_dora=True \(DoRA\) is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"lora_bias": True}, r"lora_bias=True \(a bias on lora_B\) is not supported"),
    ({"alora_invocation_tokens": [1, 2]}, r"\(activated LoRA \(aLoRA\)\) is not supported"),
    ({"layer_replication": [[0, 2], [1, 3]]}, r"\(layer replication\) is not supported"),
    ({"r": 16}, r"lora_A \[4, 128\] has rank 4, adapter_config.json says r=16"),
    ({"rank_pattern": {"q_proj": 8}}, r"layer 0 q_proj: .* rank 4, .* says r=8"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"lora_alpha": "big"}, "lora_alpha 'big' is not a number"),
    ({"r": "4"}, "r '4' is not a number"),
    ({"rank_pattern": {"q_proj": "8"}}, "rank_pattern .* is not a map of name patterns"),
    ({"alpha_pattern": {"(": 8}}, r"alpha_pattern key '\(' is not a regular expression"),
])
def test_unsupported_configs_are_named(folders, config, tmp_path, change, message):
    with pytest.raises(AdapterError, match=message):
        check_adapter(_copy(folders["r4"], tmp_path / "a", **change), config, 16)


def test_a_file_that_is_not_safetensors_is_refused(folders, config, tmp_path):
    bad = Path(_copy(folders["r4"], tmp_path / "a"))
    (bad / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(AdapterError, match="is not a safetensors file"):
        check_adapter(str(bad), config, 16)
    (bad / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterError, match=r"adapter_config\.json is not valid JSON"):
        check_adapter(str(bad), config, 16)


def test_the_config_of_a_gguf_model_comes_from_its_metadata():
    from services.common.model_files import default_model_path

    config = model_config_of(default_model_path(), is_gguf=True)
    assert config == {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                      "num_attention_heads": 9, "num_key_value_heads": 3,
                      "intermediate_size": 1536}


def test_config_files_that_are_not_small_regular_files_are_refused(folders, config, tmp_path):
    """A config that is /dev/zero (endless), a FIFO (blocks the reader) or over 1 MiB is
    refused before it is read; so are tensors whose data is not their shape's size."""
    for i, make in enumerate((lambda p: p.symlink_to("/dev/zero"), os.mkfifo,
                              lambda p: p.write_text(" " * (1 << 20) + "{}"))):
        bad = Path(_copy(folders["r4"], tmp_path / f"cfg{i}"))
        (bad / "adapter_config.json").unlink()
        make(bad / "adapter_config.json")
        with pytest.raises(AdapterError, match=r"not a regular file|larger than 1048576 bytes"):
            check_adapter(str(bad), config, 16)
    bad = Path(_copy(folders["r4"], tmp_path / "offsets"))
    weights = bad / "adapter_model.safetensors"
    data = weights.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 2]  # (still inside the file)
    text = json.dumps(header).encode().ljust(n)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    with pytest.raises(AdapterError, match=f"tensor {re.escape(name)} .* has {end - 2 - begin} "
                                           "bytes of data"):
        check_adapter(str(bad), config, 16)
