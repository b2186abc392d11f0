"""The rest of the serving surface through the whole tiny stack (issue 34): vLLM's /tokenize,
/detokenize and /version, --served-model-name, --max-logprobs, return_tokens_as_token_ids,
prompt_logprobs, continuous usage stats, and hostile parameters refused with a 400 while the
server keeps serving. The official ``openai`` client, unchanged (its low-level ``post`` for
vLLM's routes, which it has no method for), and the gRPC SDK for the same requests.

One router: served as "tiny-a" and "tiny-b", --max-logprobs 3, an API key.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
from urllib.parse import urlsplit

import grpc
import openai
import pytest
import requests
from pagedserve_client import Client
from transformers import AutoTokenizer

from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

KEY = "sk-surface"
NAMES = ["tiny-a", "tiny-b"]
M = "tiny-b"  # requests name the second; answers say the first
MAX_LOGPROBS = 3
IDS = [5, 6, 7, 8, 9, 10]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = InProcessStack(tiny_model_dir,
                           worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB",
                                        "--enforce-eager"],  # no compile warm-up
                           scheduler_argv=["--max-num-batched-tokens", "256"],
                           router_argv=["--api-key", KEY, "--max-logprobs", str(MAX_LOGPROBS),
                                        "--served-model-name", *NAMES]).start()
    yield stack
    stack.stop()


@pytest.fixture
def oai(stack):
    c = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()
    _leak_check(stack)


@pytest.fixture
def root(stack):
    """The openai client on the server's root, for vLLM's routes (/tokenize, /version)."""
    c = openai.OpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sdk(stack):
    with Client(stack.address, api_key=KEY) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def post(root, path: str, body: dict) -> dict:
    return root.post(path, cast_to=object, body=body)


def refused(root, path: str, body: dict) -> dict:
    """The error object of a request that must be a 400."""
    with pytest.raises(openai.BadRequestError) as err:
        post(root, path, body)
    return err.value.body


# ---- served model names, version --------------------------------------------------------
def test_served_model_names(oai, sdk, stack):
    assert [m.id for m in oai.models.list().data] == ["tiny-a"]
    for name in NAMES + [""]:
        r = oai.completions.create(model=name, prompt=IDS, max_tokens=1)
        assert r.model == "tiny-a"
    for name in ("tiny-c", stack.info().model):  # the engine's own name is not served
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model=name, messages=CHAT, max_tokens=1)
    assert [m.id for m in sdk.list_models()] == ["tiny-a"]


def test_version_and_the_api_key(root, stack):
    assert root.get("/version", cast_to=object) == {
        "version": importlib.metadata.version("pagedserve")}
    assert requests.post(stack.http_url + "/tokenize", json={"prompt": "a"}).status_code == 401
    assert requests.get(stack.http_url + "/version").status_code == 401
    assert requests.get(stack.http_url + "/health").status_code == 200


# ---- /tokenize, /detokenize ---------------------------------------------------------------
def test_tokenize_a_prompt_round_trip(root, oai, tokenizer, stack):
    text = "The quick brown fox jumps over the lazy dog, ünïcödé 🦊"
    out = post(root, "/tokenize", {"model": "tiny-b", "prompt": text, "return_token_strs": True})
    ids = tokenizer.encode(text)
    assert out == {"count": len(ids), "max_model_len": stack.info().max_model_len,
                   "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    r = oai.completions.create(model=M, prompt=text, max_tokens=1)
    assert r.usage.prompt_tokens == len(ids)
    assert post(root, "/detokenize", {"tokens": ids}) == {"prompt": text}
    assert "token_strs" not in post(root, "/tokenize", {"prompt": text})


def test_tokenize_a_chat_is_what_chat_sends(root, oai, sdk, tokenizer):
    out = post(root, "/tokenize", {"messages": CHAT})
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    usage = oai.chat.completions.create(model=M, messages=CHAT, max_tokens=1).usage
    assert out["count"] == usage.prompt_tokens
    assert post(root, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"x": 1}}) == out
    # continue_final_message: the last message stays open (no end-of-turn after it)
    partial = CHAT + [{"role": "assistant", "content": "Once upon"}]
    cont = post(root, "/tokenize", {"messages": partial, "add_generation_prompt": False,
                                    "continue_final_message": True})
    expected = tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    assert cont["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.decode(cont["tokens"]).endswith("Once upon")
    assert sdk.tokenize(messages=partial, add_generation_prompt=False,
                        continue_final_message=True).token_ids == cont["tokens"]


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {}, "messages", ["exactly one of prompt"]),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", ["exactly one"]),
    ("/tokenize", {"prompt": 5}, "prompt", ["prompt must be a string"]),
    ("/tokenize", {"prompt": ""}, "prompt", ["prompt is empty"]),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens",
     ["boolean"]),
    ("/tokenize", {"messages": []}, "messages", ["messages is empty"]),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "messages",
     ["continue_final_message", "add_generation_prompt"]),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs", ["tools"]),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs",
     ["object"]),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools", ["tools"]),
    ("/detokenize", {"tokens": [1, 49152]}, "tokens", ["tokens[1]", "49152", "vocabulary"]),
    ("/detokenize", {"tokens": [-1]}, "tokens", ["tokens[0]", "got -1"]),
    ("/detokenize", {"tokens": [2**40]}, "tokens", ["tokens[0]", "49152"]),
    ("/detokenize", {"tokens": "1 2"}, "tokens", ["list of token ids"]),
    ("/detokenize", {}, "tokens", ["list of token ids"]),
])
def test_tokenize_bad_input_is_a_400_naming_the_field(root, path, body, param, words):
    error = refused(root, path, body)
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    assert post(root, "/tokenize", {"prompt": "still serving"})["count"] > 0


# ---- logprobs -----------------------------------------------------------------------------
def test_max_logprobs_is_the_configured_limit(oai, sdk):
    for kwargs in ({"logprobs": MAX_LOGPROBS + 1},
                   {"extra_body": {"prompt_logprobs": MAX_LOGPROBS + 1}}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model=M, prompt=IDS, max_tokens=1, **kwargs)
        assert f"[0, {MAX_LOGPROBS}]" in err.value.message
        assert "--max-logprobs" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=M, messages=CHAT, max_tokens=1, logprobs=True,
                                    top_logprobs=MAX_LOGPROBS + 1)
    assert err.value.body["param"] == "top_logprobs"
    assert f"[0, {MAX_LOGPROBS}]" in err.value.message
    r = oai.completions.create(model=M, prompt=IDS, max_tokens=1, logprobs=MAX_LOGPROBS)
    assert len(r.choices[0].logprobs.top_logprobs[0]) == MAX_LOGPROBS
    with pytest.raises(grpc.RpcError) as rpc:
        sdk.generate(prompt_token_ids=IDS, max_tokens=1, logprobs=MAX_LOGPROBS + 1)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-logprobs" in rpc.value.details()


def test_return_tokens_as_token_ids(oai, sdk):
    ids = sdk.generate(prompt_token_ids=IDS, max_tokens=4, temperature=0,
                       ignore_eos=True).token_ids
    r = oai.completions.create(model=M, prompt=IDS, max_tokens=4, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True,
                                           "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chat_ids = sdk.chat(CHAT, max_tokens=3, temperature=0, ignore_eos=True).token_ids
    c = oai.chat.completions.create(model=M, messages=CHAT, max_tokens=3, temperature=0,
                                    logprobs=True, top_logprobs=1, extra_body={
                                        "ignore_eos": True, "return_tokens_as_token_ids": True})
    entries = c.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in chat_ids]
    assert entries[0].bytes == list(f"token_id:{chat_ids[0]}".encode())


def _check_prompt_logprobs(entries, expected, k: int, tokenizer):
    """vLLM's prompt_logprobs list against the gRPC API's prompt_logprobs of the prompt."""
    assert entries[0] is None and len(entries) == len(expected) + 1
    for entry, want in zip(entries[1:], expected, strict=True):
        assert entry[str(want.token_id)]["logprob"] == pytest.approx(want.logprob)
        assert entry[str(want.token_id)]["decoded_token"] == tokenizer.decode([want.token_id])
        tops = [(int(t), v["rank"]) for t, v in entry.items() if v["rank"] is not None]
        assert sorted(tops, key=lambda x: x[1]) == [
            (x.token_id, rank) for rank, x in enumerate(want.top[:k], 1)]
        for x in want.top[:k]:
            assert entry[str(x.token_id)]["logprob"] == pytest.approx(x.logprob)


def test_prompt_logprobs_equal_the_grpc_apis(oai, sdk, tokenizer):
    k = 2
    want = sdk.generate(prompt_token_ids=IDS, max_tokens=1, prompt_logprobs=k).prompt_logprobs
    r = oai.completions.create(model=M, prompt=IDS, max_tokens=1,
                               extra_body={"prompt_logprobs": k})
    _check_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], want, k, tokenizer)
    assert r.choices[0].logprobs is None
    # with echo and logprobs 1 as well: echo's prompt logprobs keep their own k
    r = oai.completions.create(model=M, prompt=IDS, max_tokens=1, echo=True, logprobs=1,
                               extra_body={"prompt_logprobs": k})
    _check_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], want, k, tokenizer)
    assert all(len(t) == 1 for t in r.choices[0].logprobs.top_logprobs[1:])
    chat_ids = sdk.tokenize(messages=CHAT).token_ids
    want = sdk.chat(CHAT, max_tokens=1, prompt_logprobs=0).prompt_logprobs
    c = oai.chat.completions.create(model=M, messages=CHAT, max_tokens=1,
                                    extra_body={"prompt_logprobs": 0})
    entries = c.model_extra["prompt_logprobs"]
    assert len(entries) == c.usage.prompt_tokens == len(chat_ids)
    _check_prompt_logprobs(entries, want, 0, tokenizer)
    assert [int(next(iter(e))) for e in entries[1:]] == chat_ids[1:]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=M, messages=CHAT, max_tokens=1, stream=True,
                                    extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


# ---- streaming usage ----------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(oai, chat):
    kwargs = dict(max_tokens=5, temperature=0, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True},
                  extra_body={"ignore_eos": True})
    stream = (oai.chat.completions.create(model=M, messages=CHAT, **kwargs) if chat
              else oai.completions.create(model=M, prompt=IDS, **kwargs))
    chunks = list(stream)
    *with_choices, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    prompt = last.usage.prompt_tokens
    counts = [c.usage.completion_tokens for c in with_choices]
    assert all(c.usage.prompt_tokens == prompt for c in with_choices)
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in with_choices)
    assert counts == sorted(counts) and counts[-1] == 5 and len(with_choices) >= 5
    # without continuous_usage_stats: usage only on the last chunk
    kwargs["stream_options"] = {"include_usage": True}
    stream = (oai.chat.completions.create(model=M, messages=CHAT, **kwargs) if chat
              else oai.completions.create(model=M, prompt=IDS, **kwargs))
    assert [c.usage is None for c in stream][-2:] == [True, False]


# ---- hostile parameters -------------------------------------------------------------------
DEEP = {"type": "object"}
for _ in range(70):
    DEEP = {"type": "array", "items": DEEP}


@pytest.mark.parametrize("extra, param, words", [
    ({"structured_outputs": {"regex": ""}}, "structured_outputs", ["regex is empty"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", ["at least one"]),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs", ["choice[1]"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     ["exactly one", "regex, choice"]),
    ({"structured_outputs": {}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs", ["not valid JSON"]),
    ({"structured_outputs": {"json": "[]"}}, "structured_outputs", ["JSON Schema object"]),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "structured_outputs", ["structured_outputs.json"]),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", ["look-around"]),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", ["foo"]),
    ({"structured_outputs": {"regex": "a" * 1_100_000}}, "structured_outputs",
     ["at most 1048576 bytes", "got 1100000"]),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs",
     ["at most 64", "got 71"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
     "response_format", ["at most 64"]),
    ({"n": 65}, "n", ["[1, 64]"]),
    ({"best_of": 65}, "best_of", ["[n, 64]"]),
    ({"use_beam_search": True, "beam_width": 65}, "beam_width", ["[n, 64]"]),
    ({"use_beam_search": True, "n": 65}, "n", ["[1, 64]"]),
])
def test_hostile_parameters_are_refused_and_the_server_keeps_serving(oai, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=M, prompt=IDS, max_tokens=2, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    assert all(w in err.value.message for w in words), err.value.message
    assert oai.completions.create(model=M, prompt=IDS, max_tokens=1).choices[0].finish_reason


def test_oversized_headers_are_a_400_and_the_server_keeps_serving(stack, oai):
    url = urlsplit(stack.http_url)
    for headers in ({"X-Big": "a" * 9000}, {f"X-{i}": "1" for i in range(200)}):
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "a"}),
                     headers={"Authorization": f"Bearer {KEY}", **headers})
        assert conn.getresponse().status == 400
        conn.close()
    assert oai.completions.create(model=M, prompt=IDS, max_tokens=1).choices[0].finish_reason
