"""The router's LoRA adapter registry (services/router/lora_registry.py): --lora-modules
parsing, ids from 1 never reused, adapters checked when added, and how a request's model
resolves (services/router/served_model.py)."""

from __future__ import annotations

import argparse

import grpc
import pytest

from services.common.lora import AdapterError, LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.router.lora_registry import (
    LoRAExistsError,
    LoRAModule,
    LoRARegistry,
    lora_module,
    registry_from_args,
)
from services.router.served_model import ServedModel
from services.router.validation import RequestError
from tests.helpers import make_peft_lora, make_tiny_llama


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    model = make_tiny_llama(root / "model")
    return str(model), {r: make_peft_lora(model, root / f"r{r}", r=r) for r in (4, 8, 32)}


@pytest.fixture
def registry(model_and_adapters):
    import json
    from pathlib import Path

    model, _ = model_and_adapters
    return LoRARegistry(lambda: json.loads(Path(model, "config.json").read_text()),
                        max_lora_rank=16, base_names=lambda: ("base",))


@pytest.mark.parametrize(("value", "module"), [
    ("sql=/a/sql", LoRAModule("sql", "/a/sql")),
    ("x=/p=q", LoRAModule("x", "/p=q")),
    ('{"name": "sql", "path": "/a/sql"}', LoRAModule("sql", "/a/sql")),
    ('{"name": "sql", "path": "/a/sql", "base_model_name": "llama"}',
     LoRAModule("sql", "/a/sql", "llama")),
])
def test_lora_modules_take_both_of_vllms_forms_and_forward_as_given(value, module):
    assert lora_module(value) == module
    assert lora_module(module.as_flag_value()) == module


@pytest.mark.parametrize(("value", "message"), [
    ("sql", "expected name=path or a JSON object"),
    ("=/a", "an adapter needs a non-empty name and path"),
    ("sql=", "an adapter needs a non-empty name and path"),
    ('{"name": "sql"', "not valid JSON"),
    ('{"name": "sql", "path": "/a", "rank": 8}', "unknown field 'rank'"),
    ('{"name": "sql", "path": "/a", "base_model_name": 3}', "base_model_name must be a string"),
])
def test_bad_lora_modules_entries_are_named(value, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        lora_module(value)


def test_ids_start_at_one_and_are_never_reused(registry, model_and_adapters):
    _, adapters = model_and_adapters
    assert registry.add("a", adapters[4]) == LoRARequest(1, "a", adapters[4])
    assert registry.add("b", adapters[8], "llama-base") == LoRARequest(2, "b", adapters[8])
    assert [lora.name for lora in registry] == ["a", "b"] and registry.parent("b") == "llama-base"
    with pytest.raises(LoRAExistsError, match=r"The lora adapter 'a' has already been loaded\."):
        registry.add("a", adapters[8])
    assert registry.remove("a") == LoRARequest(1, "a", adapters[4])
    assert registry.get("a") is None
    assert registry.add("a", adapters[4]).lora_id == 3  # a reload is a new adapter
    with pytest.raises(KeyError):
        registry.remove("nope")


def test_bad_adapters_and_names_are_refused_and_leave_no_entry(registry, model_and_adapters):
    _, adapters = model_and_adapters
    with pytest.raises(AdapterError, match=r"rank 32 .* above --max-lora-rank 16"):
        registry.add("big", adapters[32])
    with pytest.raises(AdapterError, match="no such adapter folder"):
        registry.add("gone", "/nonexistent/adapter")
    with pytest.raises(AdapterError, match="lora_name 'base' is the base model's name"):
        registry.add("base", adapters[4])
    assert len(registry) == 0
    assert registry.add("ok", adapters[4]).lora_id == 1  # refusals take no id


def test_a_requests_model_resolves_to_the_base_an_adapter_or_not_found(registry,
                                                                         model_and_adapters):
    _, adapters = model_and_adapters
    lora = registry.add("sql", adapters[4])
    served = ServedModel(("base", "alias"), registry)
    info = served.info(engine_pb2.GetEngineInfoResponse(model="engine-name"))
    for base in (None, "", "base", "alias"):
        assert served.resolve(base, info) is None
    assert served.resolve("sql", info) == lora
    with pytest.raises(RequestError) as e:
        served.resolve("engine-name", info)  # with served names the engine's is not one
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert e.value.message == "The model `engine-name` does not exist."
    assert served.adapters(info) == [(lora, "base")]
    assert served.for_adapter(info, lora).model == "sql" and info.model == "base"
    registry.remove("sql")
    with pytest.raises(RequestError, match="sql"):
        served.resolve("sql", info)
    assert ServedModel().resolve(None, info) is None  # no --enable-lora


def test_registry_from_args_checks_the_flags_and_every_module(model_and_adapters):
    model, adapters = model_and_adapters

    def args(**kw):
        return argparse.Namespace(**{"model": model, "enable_lora": True, "lora_modules": None,
                                     "max_lora_rank": 16, "allow_runtime_lora_updating": False,
                                     **kw})

    assert registry_from_args(args(enable_lora=False), tuple) is None
    with pytest.raises(ValueError, match="need --enable-lora"):
        registry_from_args(args(enable_lora=False, lora_modules=[LoRAModule("a", "/a")]), tuple)
    with pytest.raises(ValueError, match="need --enable-lora"):
        registry_from_args(args(enable_lora=False, allow_runtime_lora_updating=True), tuple)
    registry = registry_from_args(args(lora_modules=[LoRAModule("a", adapters[4]),
                                                     LoRAModule("b", adapters[8])]), tuple)
    assert [lora.lora_id for lora in registry] == [1, 2]
    with pytest.raises(ValueError, match=r"--lora-modules big=.*: .*rank 32 .* above "
                                         r"--max-lora-rank 16"):
        registry_from_args(args(lora_modules=[LoRAModule("big", adapters[32])]), tuple)
