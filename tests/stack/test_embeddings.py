"""POST /v1/embeddings through the real stack (worker --runner pooling), with the official
``openai`` client, against transformers' ``Qwen3Model`` hidden states pooled the same way."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import torch

from pagedserve_client import Client
from tests.helpers import TINY_LLAMA_CONFIG, _save_tiny
from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

BUDGET = 16  # the scheduler's --max-num-batched-tokens: a longer prompt is chunked
TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog.",
         "Embeddings of different lengths, batched in one step by the scheduler, " * 3]


def make_tiny_qwen3_embedding(path, **config) -> str:
    """A Qwen3-Embedding-style checkpoint: a random-weight ``Qwen3Model`` (no LM head, saved
    without the ``model.`` prefix) plus SmolLM2's tokenizer files."""
    from transformers import Qwen3Config, Qwen3Model

    from services.router.tokenizer import load_tokenizer

    cfg = Qwen3Config(**{**TINY_LLAMA_CONFIG, "vocab_size": 49152, "head_dim": 32, **config})
    _save_tiny(cfg, Qwen3Model, path, seed=0)
    load_tokenizer(None).save_pretrained(str(path))
    return str(path)


def reference(model_dir: str, prompts: list[list[int]], kind: str, normalize: bool
              ) -> list[np.ndarray]:
    """transformers' final hidden states (float32) of each prompt, pooled by ``kind``."""
    from transformers import Qwen3Model

    model = Qwen3Model.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model(torch.tensor([ids])).last_hidden_state[0]  # [n, E]
            v = h[-1] if kind == "LAST" else h.mean(0) if kind == "MEAN" else h[0]
            if normalize:
                v = torch.nn.functional.normalize(v, dim=-1)
            out.append(v.numpy())
    return out


def _stack(model_dir: str, runner: str, pooler: dict | None, eager: bool) -> InProcessStack:
    worker = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--runner", runner]
    worker += ["--pooler-config", json.dumps(pooler)] if pooler else []
    worker += ["--enforce-eager"] if eager else []
    return InProcessStack(model_dir, worker_argv=worker,
                          scheduler_argv=["--max-num-batched-tokens", str(BUDGET),
                                          "--enable-prefix-caching"]).start()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_qwen3_embedding(tmp_path_factory.mktemp("tiny-qwen3-embedding"))


@pytest.fixture(scope="module")
def last_stack(model_dir):
    """LAST + normalize (Qwen3-Embedding's), --runner pooling, the compiled forward."""
    stack = _stack(model_dir, "pooling", {"pooling_type": "LAST", "normalize": True}, False)
    yield stack
    stack.stop()


@pytest.fixture
def client(last_stack):
    c = openai.OpenAI(base_url=f"{last_stack.http_url}/v1", api_key="unused", max_retries=0,
                      timeout=60)
    yield c
    c.close()
    _leak_check(last_stack)


def _post(stack: InProcessStack, body: dict) -> tuple[int, dict]:
    """POST ``body`` to /v1/embeddings: (HTTP status, JSON answer)."""
    req = urllib.request.Request(f"{stack.http_url}/v1/embeddings", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_last_pooling_matches_transformers_batched_and_chunked(client, last_stack, model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    assert len(prompts[2]) > BUDGET  # chunked prefill
    assert last_stack.info().runner == "pooling"
    r = client.embeddings.create(model=last_stack.info().model, input=TEXTS,
                                 encoding_format="float")
    want = reference(model_dir, prompts, "LAST", True)
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    for d, w in zip(r.data, want, strict=True):
        _close(d.embedding, w)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, prompts))
    # the SDK's default asks for base64 and decodes it (the batch may differ: MKL's float32
    # products are not batch-invariant in the last bits, hence the tolerance)
    b = client.embeddings.create(model=last_stack.info().model, input=TEXTS)
    for d, w in zip(b.data, want, strict=True):
        _close(d.embedding, w)
    # token ids (one list, and a list of lists) give the same vectors as the text
    one = client.embeddings.create(model="", input=prompts[1], encoding_format="float")
    _close(one.data[0].embedding, want[1])
    many = client.embeddings.create(model="", input=prompts, encoding_format="float")
    for d, w in zip(many.data, want, strict=True):
        _close(d.embedding, w)


def test_base64_is_little_endian_float32(last_stack, client, model_dir):
    _, raw = _post(last_stack, {"input": "Hello", "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    from transformers import AutoTokenizer
    want = reference(model_dir, [AutoTokenizer.from_pretrained(model_dir).encode("Hello")],
                     "LAST", True)[0]
    _close(vec, want)


def test_truncate_prompt_tokens_keeps_the_last_tokens(last_stack, client, model_dir):
    ids = list(range(5, 60))
    _, raw = _post(last_stack, {"input": [ids], "truncate_prompt_tokens": 10,
                                "encoding_format": "float"})
    _close(raw["data"][0]["embedding"], reference(model_dir, [ids[-10:]], "LAST", True)[0])
    assert raw["usage"]["prompt_tokens"] == 10


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [1, "a"]}, "input", "list of token ids"),
    ({"input": {"text": "a"}}, "input", "list of strings"),
    ({"input": [[1, 2], []]}, "input", "input[1] is empty"),
    ({"input": ["a"] * 2049}, "input", "between 1 and 2048"),
    ({"input": [[49152]]}, "input", "[0, 49152)"),
    ({"input": [1, 2, 99999]}, "input", "input[2] = 99999"),  # one id list: its index only
    ({"input": [[1], [1, 2, 99999]]}, "input", "input[1][2] = 99999"),
    ({"input": "a", "truncate_prompt_tokens": 100000}, "truncate_prompt_tokens",
     "truncate_prompt_tokens value (100000) is greater than max_model_len (1024)"),
    ({"input": [list(range(1025))]}, "input", "max_model_len 1024"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float, base64"),
    ({"input": "a", "dimensions": 16}, "dimensions", "matryoshka"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
    ({"input": "a", "dimensions": "16"}, "dimensions", "must be an integer"),
])
def test_bad_input_is_a_400_naming_the_field(last_stack, client, body, param, words):
    status, answer = _post(last_stack, body)
    assert status == 400, answer
    err = answer["error"]
    assert err["param"] == param and words in err["message"], err
    # and the server still serves
    assert len(client.embeddings.create(model="", input="still here").data[0].embedding) == 64


def test_generation_on_a_pooling_server_is_a_400(last_stack, client):
    for call in (lambda: client.completions.create(model="", prompt="hi", max_tokens=2),
                 lambda: client.chat.completions.create(
                     model="", messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert "does not support Completions API" in err.value.message
    assert len(client.embeddings.create(model="", input="still here").data) == 1


@pytest.mark.parametrize("pooler", [{"pooling_type": "MEAN", "normalize": False},
                                    {"pooling_type": "CLS"}])
def test_mean_and_cls_auto_detected_eager(tmp_path, pooler):
    """``--runner auto`` finds the embedding model (architectures ``Qwen3Model``); MEAN and CLS
    over chunked prompts, on the eager forward; Matryoshka ``dimensions`` where the config
    declares them."""
    model_dir = make_tiny_qwen3_embedding(tmp_path / "m", matryoshka_dimensions=[16, 32])
    from transformers import AutoTokenizer
    prompts = [AutoTokenizer.from_pretrained(model_dir).encode(t) for t in TEXTS]
    stack = _stack(model_dir, "auto", pooler, True)
    try:
        c = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                          timeout=60)
        kind, normalize = pooler["pooling_type"], pooler.get("normalize", True)
        r = c.embeddings.create(model="", input=TEXTS, encoding_format="float")
        for d, w in zip(r.data, reference(model_dir, prompts, kind, normalize), strict=True):
            _close(d.embedding, w)
        short = c.embeddings.create(model="", input=TEXTS[:1], dimensions=16,
                                    encoding_format="float").data[0].embedding
        full = np.asarray(r.data[0].embedding[:16])
        _close(short, (full / np.linalg.norm(full)).astype(np.float32))
        with pytest.raises(openai.BadRequestError) as err:
            c.embeddings.create(model="", input="a", dimensions=20)
        assert err.value.param == "dimensions" and "[16, 32]" in err.value.message
        c.close()
        _leak_check(stack)
    finally:
        stack.stop()


def test_grpc_embed_from_the_sdk(last_stack, client, model_dir):
    """``Client.embed`` (gRPC Embed): the same vectors; its errors are INVALID_ARGUMENT naming
    the field; Generate on a pooling server is refused."""
    import grpc
    from transformers import AutoTokenizer
    prompts = [AutoTokenizer.from_pretrained(model_dir).encode(t) for t in TEXTS]
    with Client(last_stack.address) as c:
        r = c.embed(TEXTS)
        assert r.prompt_tokens == [len(p) for p in prompts] and r.model == last_stack.info().model
        for got, want in zip(r.embeddings, reference(model_dir, prompts, "LAST", True),
                             strict=True):
            _close(got, want)
        _close(c.embed(prompts[0]).embeddings[0], np.asarray(r.embeddings[0], np.float32))
        for kwargs, words in (({"input": ["a", ""]}, "input[1] is empty"),
                              ({"input": "a", "dimensions": 8}, "dimensions")):
            with pytest.raises(grpc.RpcError) as err:
                c.embed(**kwargs)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.generate("hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not support Completions API" in err.value.details()
        assert "the Embed RPC (gRPC)" in err.value.details()  # what a gRPC user can call
        assert len(c.embed("still serving").embeddings) == 1
