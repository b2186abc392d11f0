"""LoRA adapters executed through the whole tiny stack (issue 35): workers with
--enable-lora, the router's --lora-modules, the scheduler's --max-loras. Greedy tokens of two
adapters' requests and base-model requests, all sent at once with the same prompts (so the
prefix cache would mix them up if it did not key blocks by adapter), then again (prefix hits),
equal transformers + PEFT exactly at float32; the official ``openai`` client's completion
naming an adapter answers the same text as gRPC's."""

from __future__ import annotations

import random

import openai
import pytest
import requests

from tests.helpers import make_peft_lora
from tests.stack.conftest import _leak_check, generate_at_once
from tests.stack_harness import InProcessStack
from tests.worker.lora_driver import reference_greedy

MAX_NEW = 6
WORKER = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--enforce-eager",
          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_peft_lora(tiny_model_dir, root / "a", r=4, lora_alpha=8),
            "b": make_peft_lora(tiny_model_dir, root / "b", r=16, seed=1, lora_alpha=16,
                                use_rslora=True, target_modules=("q_proj", "v_proj",
                                                                 "down_proj"))}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, adapters):
    stack = InProcessStack(tiny_model_dir, worker_argv=WORKER,
                           scheduler_argv=["--max-num-batched-tokens", "256", "--max-loras", "2"],
                           router_argv=["--enable-lora", "--allow-runtime-lora-updating",
                                        "--lora-modules", f"a={adapters['a']}",
                                        f"b={adapters['b']}"]).start()
    yield stack
    stack.stop()


def test_adapters_and_base_mixed_equal_peft_through_the_stack(stack, tiny_model_dir, adapters):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 49152) for _ in range(n)] for n in (7, 40)]
    want = {name: reference_greedy(tiny_model_dir, path, prompts, MAX_NEW)
            for name, path in (("", None), *adapters.items())}
    assert want["a"] != want[""] and want["b"] != want[""]  # (the adapters change the answer)
    cases = [(model, i) for _ in range(2) for model in ("a", "", "b") for i in range(2)]
    for _ in range(2):  # the second round hits the prefix cache of each (adapter, prompt)
        got = generate_at_once(stack.address, [
            {"prompt_token_ids": prompts[i], "temperature": 0, "max_tokens": MAX_NEW,
             "ignore_eos": True, "model": model} for model, i in cases])
        assert [r.token_ids for r in got] == [want[model][i] for model, i in cases]
    _leak_check(stack)


def test_the_openai_client_runs_an_adapter(stack):
    ids = [5, 6, 7, 8, 9, 10]
    oai = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    answers = {model: oai.completions.create(model=model, prompt=ids, max_tokens=MAX_NEW,
                                             temperature=0, extra_body={"ignore_eos": True})
               for model in ("a", "b")}
    grpc_answers = generate_at_once(stack.address, [
        {"prompt_token_ids": ids, "temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True,
         "model": model} for model in ("a", "b")])
    for (model, answer), expected in zip(answers.items(), grpc_answers, strict=True):
        assert answer.model == model and answer.usage.completion_tokens == MAX_NEW
        assert answer.choices[0].text == expected.text


def test_unload_lets_running_requests_finish_and_load_does_not_disturb_others(stack, adapters):
    """Unload "a" while its request streams: that stream ends normally with the same text as
    before (vLLM's rule: running requests keep their adapter), a new request naming "a" is a
    404. Load "a" again as "a2" while a request of "b" streams: "b" finishes, "a2" answers
    as "a" did. Nothing leaks."""
    oai = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    ids, extra = [5, 6, 7, 8, 9, 10], {"ignore_eos": True}

    def whole(model: str) -> str:
        return oai.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0,
                                      extra_body=extra).choices[0].text

    def lora(route: str, body: dict) -> int:
        return requests.post(f"{stack.http_url}/v1/{route}", json=body, timeout=60).status_code

    want = {"a": whole("a"), "b": whole("b")}
    stream = oai.completions.create(model="a", prompt=ids, max_tokens=24, temperature=0,
                                    stream=True, extra_body=extra)
    chunks = [next(stream)]
    assert lora("unload_lora_adapter", {"lora_name": "a"}) == 200
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == want["a"]
    with pytest.raises(openai.NotFoundError, match=r"The model `a` does not exist\."):
        whole("a")
    stream = oai.completions.create(model="b", prompt=ids, max_tokens=24, temperature=0,
                                    stream=True, extra_body=extra)
    chunks = [next(stream)]
    assert lora("load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a"]}) == 200
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want["b"]
    assert whole("a2") == want["a"]
    assert lora("unload_lora_adapter", {"lora_name": "a2"}) == 200
    assert lora("load_lora_adapter", {"lora_name": "a", "lora_path": adapters["a"]}) == 200
    _leak_check(stack)
