"""LoRA adapters through the whole tiny stack, the request path (issue 35): --lora-modules at
start, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter at run time (behind the flag
and the API key; a bad adapter is a 400 naming the problem and the server keeps serving),
/v1/models and gRPC ListModels listing the adapters with their parent, a request's model
selecting an adapter (HTTP, gRPC, the SDK) or a 404 / NOT_FOUND naming an unknown one.

The workers here run no adapters (their LoRA execution is another part of the issue), so a
request naming an adapter is refused by the scheduler with INVALID_ARGUMENT naming the adapter
(the scheduler knows it only from the SubmitRequest the router sent): never run as the base
model. The official ``openai`` client, unchanged; ``requests`` for vLLM's two routes, which
answer plain text.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import grpc
import openai
import pytest
import requests

from pagedserve_client import Client
from tests.helpers import make_peft_lora, make_tiny_llama
from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

KEY = "sk-lora"
IDS = [5, 6, 7, 8, 9, 10]
WORKER = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--enforce-eager"]
NO_ADAPTERS = "is a LoRA adapter but the workers run no adapters"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    other = make_tiny_llama(root / "other", hidden_size=32)
    lacking = Path(shutil.copytree(make_peft_lora(tiny_model_dir, root / "x", r=4),
                                   root / "lacking"))
    config = json.loads((lacking / "adapter_config.json").read_text())
    (lacking / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["q_proj", "c_attn"]}))
    hostile = {}  # a config that is /dev/zero (an endless read) or a FIFO (a blocked one)
    for kind in ("devzero", "fifo"):
        folder = Path(shutil.copytree(lacking, root / kind))
        (folder / "adapter_config.json").unlink()
        if kind == "devzero":
            (folder / "adapter_config.json").symlink_to("/dev/zero")
        else:
            os.mkfifo(folder / "adapter_config.json")
        hostile[kind] = str(folder)
    return {**hostile, "a": make_peft_lora(tiny_model_dir, root / "a", r=4),
            "b": make_peft_lora(tiny_model_dir, root / "b", r=8, seed=1,
                                target_modules=("q_proj", "v_proj")),
            "rank32": make_peft_lora(tiny_model_dir, root / "rank32", r=32),
            "lacking": str(lacking),
            "other_base": make_peft_lora(other, root / "other_base", r=4),
            "missing": str(root / "missing")}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, adapters):
    stack = InProcessStack(tiny_model_dir, worker_argv=WORKER,
                           scheduler_argv=["--max-num-batched-tokens", "256"],
                           router_argv=["--api-key", KEY, "--enable-lora", "--lora-modules",
                                        f"a={adapters['a']}", "--max-lora-rank", "16",
                                        "--allow-runtime-lora-updating"]).start()
    yield stack
    stack.stop()


@pytest.fixture
def oai(stack):
    c = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()
    _leak_check(stack)


def lora_call(stack, route: str, body: dict, key: str | None = KEY) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{stack.http_url}/v1/{route}", json=body, headers=headers, timeout=60)


def base_still_serves(oai) -> None:
    r = oai.completions.create(model="", prompt=IDS, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_models_list_the_adapters_after_the_base_with_their_parent(oai, stack, adapters):
    models = oai.models.list().data
    base = stack.info().model
    assert [(m.id, m.parent, m.root) for m in models] == [
        (base, None, base), ("a", base, adapters["a"])]
    with Client(stack.address, api_key=KEY) as c:
        assert [(m.id, m.parent) for m in c.list_models()] == [(base, ""), ("a", base)]


def test_a_request_naming_an_adapter_carries_it_to_the_engine(oai, stack):
    """Chat, completions and responses alike: the scheduler names the adapter it got."""
    with pytest.raises(openai.BadRequestError, match=f"model 'a' {NO_ADAPTERS}") as e:
        oai.completions.create(model="a", prompt=IDS, max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match=f"model 'a' {NO_ADAPTERS}"):
        oai.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"model 'a' {NO_ADAPTERS}"):
        oai.responses.create(model="a", input="hi", max_output_tokens=2)
    with Client(stack.address, api_key=KEY) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(prompt_token_ids=IDS, max_tokens=2, model="a")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"model 'a' {NO_ADAPTERS}" in e.value.details()
    base_still_serves(oai)


def test_an_unknown_model_is_a_404_naming_it(oai, stack):
    with pytest.raises(openai.NotFoundError, match=r"The model `nope` does not exist\."):
        oai.completions.create(model="nope", prompt=IDS, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match=r"The model `nope` does not exist\."):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with Client(stack.address, api_key=KEY) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.chat([{"role": "user", "content": "x"}], max_tokens=2, model="nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details() == "The model `nope` does not exist."
        assert len(c.generate(prompt_token_ids=IDS, max_tokens=2, model="").token_ids) == 2


def test_load_then_unload_at_run_time(oai, stack, adapters):
    r = lora_call(stack, "load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' added successfully.")
    assert [m.id for m in oai.models.list().data][1:] == ["a", "b"]
    with pytest.raises(openai.BadRequestError, match=f"model 'b' {NO_ADAPTERS}"):
        oai.completions.create(model="b", prompt=IDS, max_tokens=2)
    again = lora_call(stack, "load_lora_adapter", {"lora_name": "b", "lora_path": adapters["a"]})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'b' has already been loaded."
    r = lora_call(stack, "unload_lora_adapter", {"lora_name": "b"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' removed successfully.")
    assert [m.id for m in oai.models.list().data][1:] == ["a"]
    with pytest.raises(openai.NotFoundError, match=r"The model `b` does not exist\."):
        oai.completions.create(model="b", prompt=IDS, max_tokens=2)
    gone = lora_call(stack, "unload_lora_adapter", {"lora_name": "b"})
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'b' cannot be found."
    base_still_serves(oai)


def test_load_and_unload_while_requests_stream(oai, stack, adapters):
    """Load and unload while a stream is open (between the chunks it reads): both succeed and
    the stream goes on to its end."""
    stream = oai.completions.create(model="", prompt=IDS, max_tokens=48, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    assert lora_call(stack, "load_lora_adapter",
                     {"lora_name": "c", "lora_path": adapters["b"]}).status_code == 200
    assert lora_call(stack, "unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in chunks) > 1


@pytest.mark.parametrize(("name", "message"), [
    ("rank32", "rank 32 (layer 0 down_proj) is above --max-lora-rank 16"),
    ("missing", "no such adapter folder"),
    ("lacking", "target module 'c_attn' is one the model lacks"),
    ("other_base", "base model mismatch"),
    ("devzero", "adapter_config.json is not a regular file"),
    ("fifo", "adapter_config.json is not a regular file"),
])
def test_a_bad_adapter_is_refused_naming_the_problem(oai, stack, adapters, name, message):
    r = lora_call(stack, "load_lora_adapter", {"lora_name": name, "lora_path": adapters[name]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "lora_path" and error["type"] == "invalid_request_error"
    assert f"cannot load LoRA adapter '{name}'" in error["message"]
    assert message in error["message"]
    assert [m.id for m in oai.models.list().data][1:] == ["a"]
    base_still_serves(oai)


def test_a_name_too_long_for_a_label_is_refused(oai, stack, adapters):
    r = lora_call(stack, "load_lora_adapter", {"lora_name": "n" * 257, "lora_path": adapters["b"]})
    assert r.status_code == 400
    assert "lora_name must be at most 256 printable characters, got 257" in r.json()["error"][
        "message"]
    base_still_serves(oai)


@pytest.mark.parametrize("body", [{}, {"lora_name": "c"}, {"lora_name": 3, "lora_path": "/x"},
                                  {"lora_name": "", "lora_path": "/x"}])
def test_a_load_without_name_and_path_is_refused(oai, stack, body):
    r = lora_call(stack, "load_lora_adapter", body)
    assert r.status_code == 400
    assert "'lora_name' and 'lora_path' must be provided" in r.json()["error"]["message"]


def test_the_lora_routes_are_behind_the_api_key(stack, adapters):
    assert lora_call(stack, "load_lora_adapter", {"lora_name": "k", "lora_path": adapters["b"]},
                     key=None).status_code == 401
    assert lora_call(stack, "unload_lora_adapter", {"lora_name": "a"},
                     key="sk-wrong").status_code == 401


def test_without_the_runtime_flag_there_are_no_lora_routes(tiny_model_dir, adapters):
    stack = InProcessStack(tiny_model_dir, worker_argv=WORKER,
                           router_argv=["--enable-lora", "--lora-modules",
                                        f"a={adapters['a']}"]).start()
    try:
        r = lora_call(stack, "load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
        assert r.status_code == 404
        r = requests.get(f"{stack.http_url}/v1/models", timeout=60)
        assert [m["id"] for m in r.json()["data"]][1:] == ["a"]
    finally:
        stack.stop()
