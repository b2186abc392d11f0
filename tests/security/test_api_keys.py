"""API keys on the router: gRPC UNAUTHENTICATED / HTTP 401 without an accepted
``authorization: Bearer <key>``; health checking and reflection stay open; the keys never
appear in logs, --help or a child's command line (issue 9)."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc
import pytest

from pagedserve_client import AsyncClient, Client
from services.common.grpc_utils import check_health
from services.router.auth import INVALID, MISSING, ApiKeys, bearer_token
from tests.security.conftest import TINY_SCHEDULER, TINY_WORKER
from tests.stack_harness import InProcessStack

KEYS = "sk-first-key,sk-second-key"
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def keyed_stack(tiny_model_dir):
    stack = InProcessStack(tiny_model_dir, worker_argv=TINY_WORKER,
                           scheduler_argv=TINY_SCHEDULER,
                           router_argv=["--api-key", KEYS]).start()
    yield stack
    stack.stop()


def _generate(stack, api_key=None):
    with Client(stack.address, timeout=30, max_retries=0, api_key=api_key) as c:
        return c.generate(prompt_token_ids=PROMPT, max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("api_key,message", [(None, MISSING), ("sk-wrong", INVALID),
                                             ("sk-first-ke", INVALID)])
def test_missing_or_wrong_key_is_unauthenticated(keyed_stack, api_key, message):
    with pytest.raises(grpc.RpcError) as e:
        _generate(keyed_stack, api_key)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert e.value.details() == message
    assert "sk-" not in e.value.details()


def test_unary_calls_are_checked_too(keyed_stack):
    with Client(keyed_stack.address, timeout=30, max_retries=0) as c:
        for call in (c.list_models, lambda: c.tokenize("hello"), lambda: c.detokenize([1])):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("key", KEYS.split(","))
def test_right_key_streams_tokens(keyed_stack, key):
    assert len(_generate(keyed_stack, key).token_ids) == 4


def test_async_client_sends_the_key(keyed_stack):
    async def run():
        async with AsyncClient(keyed_stack.address, timeout=30, api_key="sk-second-key") as c:
            deltas = [d async for d in c.stream(prompt_token_ids=PROMPT, max_tokens=3,
                                                temperature=0, ignore_eos=True)]
            models = await c.list_models()
            return deltas, models
    deltas, models = asyncio.run(run())
    assert sum(len(d.token_ids) for d in deltas) == 3 and models


def test_health_and_reflection_need_no_key(keyed_stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    assert asyncio.run(check_health(keyed_stack.address, 5.0))
    with grpc.insecure_channel(keyed_stack.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=10)
        names = [s.name for r in responses for s in r.list_services_response.service]
    assert "pagedserve.v1.GenerationService" in names


def test_http_needs_the_bearer_header(keyed_stack):
    import requests
    url = keyed_stack.http_url
    r = requests.get(f"{url}/v1/models", timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["WWW-Authenticate"] == "Bearer"
    r = requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-nope"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["message"] == INVALID
    r = requests.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      timeout=30)
    assert r.status_code == 401
    r = requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-first-key"},
                     timeout=30)
    assert r.status_code == 200
    assert requests.get(f"{url}/health", timeout=30).status_code == 200  # probes stay open
    r = requests.get(f"{url}/metrics", timeout=30)  # and scrapers (a gateway's)
    assert r.status_code == 200 and "pagedserve:router_requests_total" in r.text


def test_openai_client_with_the_key(keyed_stack):
    import openai
    with openai.OpenAI(base_url=f"{keyed_stack.http_url}/v1", api_key="sk-second-key",
                       max_retries=0, timeout=60) as client:
        out = client.completions.create(model="", prompt="Hello", max_tokens=3, temperature=0)
    assert out.choices[0].text is not None
    with openai.OpenAI(base_url=f"{keyed_stack.http_url}/v1", api_key="sk-wrong",
                       max_retries=0, timeout=60) as client, \
            pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_anthropic_client_sends_the_key_as_x_api_key(keyed_stack):
    import anthropic
    import requests
    turns = [{"role": "user", "content": "Hi"}]
    with anthropic.Anthropic(base_url=keyed_stack.http_url, api_key="sk-first-key",
                             max_retries=0, timeout=60) as client:
        assert client.messages.count_tokens(model="", messages=turns).input_tokens > 0
    with anthropic.Anthropic(base_url=keyed_stack.http_url, auth_token="sk-second-key",
                             max_retries=0, timeout=60) as client:  # Authorization: Bearer
        assert client.messages.count_tokens(model="", messages=turns).input_tokens > 0
    with anthropic.Anthropic(base_url=keyed_stack.http_url, api_key="sk-wrong",
                             max_retries=0, timeout=60) as client, \
            pytest.raises(anthropic.AuthenticationError) as e:
        client.messages.create(model="", messages=turns, max_tokens=2)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": INVALID}}
    r = requests.get(f"{keyed_stack.http_url}/v1/models", timeout=30,  # any route takes it
                     headers={"x-api-key": "sk-second-key"})
    assert r.status_code == 200


# ---- the key parsing and its redaction -------------------------------------------------
def test_api_keys_parse_compare_and_redact():
    keys = ApiKeys(" a-key , b-key ,")
    assert len(keys) == 2
    assert keys.matches("a-key") and keys.matches(b"b-key")
    assert not keys.matches("a-ke") and not keys.matches("") and not keys.matches(None)
    assert "a-key" not in repr(keys) and "a-key" not in str(keys)
    assert keys.check("Bearer b-key") is None and keys.check("bearer b-key") is None
    assert keys.check(None) == MISSING and keys.check("Basic b-key") == MISSING
    assert keys.check("Bearer nope") == INVALID
    with pytest.raises(argparse.ArgumentTypeError):
        ApiKeys(" , ")
    assert bearer_token("Bearer  tok ") == "tok" and bearer_token("Bearer") is None


def test_key_stays_out_of_help_logs_and_child_argv(monkeypatch, caplog, capsys):
    from services.cli.flags import forwarded_argv, forwarded_env, serve_parser
    from services.router import server as router_server
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-from-env")
    monkeypatch.delenv("PAGEDSERVE_USAGE_DB", raising=False)  # (tests/conftest.py sets it)
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    router_server.add_args(p)
    assert "sk-from-env" not in p.format_help()
    args = p.parse_args([])
    assert args.api_key.matches("sk-from-env")
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("test").info("args: %s", args)
    assert "sk-from-env" not in caplog.text and "sk-from-env" not in repr(args)
    ns = serve_parser().parse_args(["--api-key", "sk-flag"])
    assert "sk-flag" not in " ".join(forwarded_argv("router", ns))
    assert forwarded_env("router", ns) == {"PAGEDSERVE_API_KEY": "sk-flag"}
    assert forwarded_env("worker", ns) == {}

