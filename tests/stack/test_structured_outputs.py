"""Structured outputs through the whole stack: JSON schemas, a regex and a choice constrain what
the tiny random model samples (HTTP with the openai client, and the gRPC SDK); invalid
grammars are a 400 / INVALID_ARGUMENT naming the field and cost nothing; on SmolLM2 the mask
never disturbs a token the grammar allows.

Every tiny-stack sample request runs at once (one module fixture), so the scheduler batches all
of them: 200 samples per constraint per API, seeds 0..199 (4 requests of n=50; choice i of a
request with seed s samples with seed s + i). The schemas are bounded (maxLength, maxItems,
integer ranges, closed objects) so a random model always finishes them within MAX_TOKENS.
A random model picks whitespace wherever the grammar allows it, so all schemas but "flat" (which
keeps the router's bounded whitespace) ask for compact JSON through llguidance's
``x-guidance`` to keep the test short.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from benchmarks.structured_output_schemas import SCHEMAS
from pagedserve_client import Client
from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

REGEX = r"(?:[a-z]{1,5} ){1,3}#[0-9]{2,4}"
CHOICES = ["red", "dark red", "green", "blue!", "é ☃"]  # one a suffix of another, non-ASCII
CONSTRAINTS = [*SCHEMAS, "regex", "choice"]
SAMPLES, N = 200, 50  # 200 samples as 4 requests of n=50, seeds 0, 50, 100, 150
MAX_TOKENS = 160
CONCURRENT = 8  # requests in flight (x N sequences; the scheduler queues at most 1024)
PROMPT = "Answer:"


def _structured(name: str) -> dict:
    if name == "regex":
        return {"regex": REGEX}
    if name == "choice":
        return {"choice": CHOICES}
    return {"json": SCHEMAS[name]}


def _check(name: str, text: str) -> None:
    """``text`` satisfies constraint ``name`` (raises otherwise)."""
    if name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "choice":
        assert text in CHOICES, text
    else:
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def _http(oai, model: str, name: str, seed: int) -> list[tuple[str, str]]:
    """One request of N samples: chat + response_format for a schema (OpenAI's form),
    completions + structured_outputs for regex and choice (vLLM's)."""
    kw = {"model": model, "n": N, "seed": seed, "temperature": 1.0, "max_tokens": MAX_TOKENS}
    if name in SCHEMAS:
        r = oai.chat.completions.create(
            messages=[{"role": "user", "content": PROMPT}], **kw,
            response_format={"type": "json_schema", "json_schema": {
                "name": name, "schema": SCHEMAS[name], "strict": True}})
        return [(c.message.content, c.finish_reason) for c in r.choices]
    r = oai.completions.create(prompt=PROMPT, **kw,
                               extra_body={"structured_outputs": _structured(name)})
    return [(c.text, c.finish_reason) for c in r.choices]


def _grpc(address: str, name: str, seed: int) -> list[tuple[str, str]]:
    with Client(address, timeout=300) as c:
        r = c.generate(prompt=PROMPT, n=N, seed=seed, temperature=1.0, max_tokens=MAX_TOKENS,
                       structured_outputs=_structured(name))
    return [(x.text, x.finish_reason) for x in r.choices]


@pytest.fixture(scope="module")
def model_name(tiny_stack):
    return tiny_stack.info().model


@pytest.fixture(scope="module")
def samples(tiny_stack, model_name):
    """{(api, constraint): [(text, finish_reason)] * SAMPLES}, all requests run at once."""
    client = openai.OpenAI(base_url=f"{tiny_stack.http_url}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    jobs = {(api, name, seed): (_http, (client, model_name, name, seed)) if api == "http"
            else (_grpc, (tiny_stack.address, name, seed))
            for api in ("http", "grpc") for name in CONSTRAINTS
            for seed in range(0, SAMPLES, N)}
    with ThreadPoolExecutor(CONCURRENT) as pool:
        futures = {key: pool.submit(fn, *args) for key, (fn, args) in jobs.items()}
        out: dict[tuple[str, str], list] = {}
        for (api, name, _), f in futures.items():
            out.setdefault((api, name), []).extend(f.result())
    client.close()
    _leak_check(tiny_stack)
    return out


@pytest.mark.parametrize("api", ["http", "grpc"])
@pytest.mark.parametrize("name", CONSTRAINTS)
def test_every_sample_satisfies_its_constraint(samples, api, name):
    got = samples[(api, name)]
    assert len(got) == SAMPLES
    for text, finish in got:
        assert finish == "stop", (finish, text)
        _check(name, text)
    # temperature 1.0 with distinct seeds: the samples differ (the mask leaves a choice)
    assert len({t for t, _ in got}) >= (3 if name == "choice" else 20)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format", "structured_outputs.json: "),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "(("}}},
     "structured_outputs", "structured_outputs.json: "),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "structured_outputs.regex: "),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs",
     "structured_outputs.grammar: "),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "structured_outputs.choice"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_grammar_is_a_400_and_the_server_keeps_serving(oai, model_name, body,
                                                                   param, words, stream):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model_name, messages=[{"role": "user",
                                                                 "content": "hi"}],
                                    max_tokens=4, stream=stream, extra_body=body)
    error = err.value.body
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(words), error["message"]
    ok = oai.completions.create(model=model_name, prompt="hi", max_tokens=8,
                                extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", ok.choices[0].text) and ok.choices[0].finish_reason == "stop"


def test_an_invalid_grammar_is_invalid_argument_over_grpc(tiny):
    with Client(tiny.address) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt="hi", max_tokens=4, n=3,
                       structured_outputs={"json": '{"type": "integer", "minimum": 3, '
                                                   '"maximum": 1}'})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("structured_outputs.json: Unsatisfiable")
        r = c.generate(prompt="hi", max_tokens=8, structured_outputs={"choice": ["ab", "cd"]})
        assert r.text in ("ab", "cd") and r.finish_reason == "stop"


def test_streaming_gives_the_same_constrained_samples(tiny, oai, model_name):
    kw = {"model": model_name, "prompt": PROMPT, "n": 4, "seed": 3, "temperature": 1.0,
          "max_tokens": MAX_TOKENS, "extra_body": {"structured_outputs": {"regex": REGEX}}}
    whole = oai.completions.create(**kw)
    texts = [""] * 4
    for chunk in oai.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]
    assert all(re.fullmatch(REGEX, t) for t in texts)


# ---- SmolLM2-135M: the mask leaves an allowed greedy token alone --------------------------
FEW_SHOT = ('Alice is 30 years old and lives in Paris.\nJSON:\n'
            '{"name": "Alice", "age": 30, "city": "Paris"}\n'
            'Bob is 25 years old and lives in Rome.\nJSON:\n')
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
PERSON_REGEX = r'\{"name": "[A-Z][a-z]+", "age": [0-9]+, "city": "[A-Z][a-z]+"\}'


@pytest.fixture(scope="module")
def smol():
    stack = InProcessStack(None, worker_argv=["--dtype", "float32",
                                              "--kv-cache-memory", "512MiB"]).start()
    yield stack
    _leak_check(stack)
    stack.stop()


def test_smollm2_greedy_under_an_admitting_grammar_is_the_unconstrained_greedy(smol):
    def run(structured):
        with Client(smol.address, timeout=300) as c:
            return c.generate(prompt=FEW_SHOT, temperature=0, max_tokens=40, stop="\n",
                              structured_outputs=structured)

    free = run(None)  # ends at its stop string "\n"; constrained, the grammar ends it first
    assert free.finish_reason == "stop", free.text
    assert re.fullmatch(PERSON_REGEX, free.text), f"precondition: {free.text!r}"
    with ThreadPoolExecutor(2) as pool:
        constrained = list(pool.map(run, [{"json": PERSON}, {"regex": PERSON_REGEX}]))
    for r in constrained:
        assert (r.text, r.finish_reason) == (free.text, "stop")


def test_smollm2_openai_client_json_schema(smol):
    schema = {"type": "object", "properties": {
        "capital": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20}},
        "required": ["capital", "country"], "additionalProperties": False}
    with openai.OpenAI(base_url=f"{smol.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        r = client.chat.completions.create(
            model=smol.info().model, temperature=0, max_tokens=60,
            messages=[{"role": "user", "content": "What is the capital of France? "
                                                  "Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "capital", "schema": schema, "strict": True}})
    (choice,) = r.choices
    value = json.loads(choice.message.content)
    jsonschema.validate(value, schema)
    assert choice.finish_reason == "stop" and "Paris" in value["capital"]
