"""GET /openapi.json and schemathesis against it (issue 56): the document is valid OpenAPI 3.1
and lists every route the router's aiohttp app serves; a live tiny stack answers a few hundred
generated cases (valid and invalid bodies of every operation) with no 5xx, every answer
conforming to the document (status, media type, body; invalid data refused with a 4xx); and
the server still serves afterwards with no KV block leaked. ``benchmarks/openapi_fuzz.py`` runs
the same with many more cases."""

from __future__ import annotations

import pytest
import requests

from benchmarks.openapi_fuzz import fuzz, fuzz_stack
from services.router.auth import OPEN_HTTP_PATHS
from services.router.openai.http import OpenAIServer
from services.router.openai.lora_routes import LoRARoutes
from services.router.openapi import Route
from tests.stack.conftest import _leak_check

CASES = 30  # per operation and mode: 8 bodies x 2 modes + 1 path parameter -> > 500 cases
MIN_CASES = 500


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    s = fuzz_stack(tiny_model_dir)
    yield s
    s.stop()


def test_document_is_openapi_31_and_lists_every_route(stack):
    import jsonschema
    import schemathesis

    server = OpenAIServer(engine=None, tokenizer=None)
    LoRARoutes(loras=None).add_to(server)
    served = {(r.method, r.resource.canonical) for r in server.app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    listed = {(r.method, r.path) for r in server.routes}
    assert served == listed and len(served) >= 14, served ^ listed

    document = requests.get(f"{stack.http_url}/openapi.json", timeout=30).json()
    assert document["openapi"] == "3.1.0"
    schema = schemathesis.openapi.from_dict(document)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    operations = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    # the live router (LoRA routes on) lists exactly what the app serves
    assert operations == listed, operations ^ listed
    for name, component in document["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(component), name
    for path, ops in document["paths"].items():
        for op in ops.values():
            assert ("security" not in op) == (path in OPEN_HTTP_PATHS), path


def test_schemathesis_finds_no_5xx_and_no_nonconforming_answer(stack):
    report = fuzz(stack.http_url, cases=CASES, seed=56)
    print(report.summary())
    assert report.cases >= MIN_CASES, report.summary()
    assert not report.server_errors, report.server_errors[:3]
    assert not report.violations, "\n\n".join(text for _, text in report.violations[:3])
    assert 200 in report.statuses and 400 in report.statuses, report.statuses  # both kinds ran
    # still serving, nothing leaked
    answer = requests.post(f"{stack.http_url}/v1/completions", timeout=60,
                           json={"prompt": "still serving", "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    _leak_check(stack)


def test_a_bad_body_is_a_400_naming_the_path_and_the_param_is_the_field(stack):
    answer = requests.post(f"{stack.http_url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages"
    assert error["message"].startswith("messages[1].content must be a string or a list"), error
    assert "got 5" in error["message"]


def test_an_undocumented_method_is_a_405_naming_the_allowed_ones(stack):
    answer = requests.delete(f"{stack.http_url}/v1/completions", timeout=30)
    assert answer.status_code == 405
    assert answer.headers["Allow"] == "POST"
    assert answer.json()["error"]["code"] == "method_not_allowed"


def test_add_route_serves_and_lists_a_route():
    from aiohttp import web

    server = OpenAIServer(engine=None, tokenizer=None)

    async def hello(request):
        return web.json_response({"version": "x"})

    server.add_route(Route("GET", "/hello", "hello"), hello)
    assert ("GET", "/hello") in {(r.method, r.resource.canonical)
                                 for r in server.app.router.routes()}
    assert server.routes[-1].path == "/hello"
