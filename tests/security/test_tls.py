"""TLS and mTLS on every gRPC link (client→router→scheduler→worker), health checks over TLS,
and HTTPS on the OpenAI-compatible port (issue 9)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve_client import AsyncClient, Client
from services.common.grpc_utils import check_health, health_status, new_server, set_serving
from services.common.tls import load_tls
from tests.security.conftest import TINY_SCHEDULER, TINY_WORKER
from tests.stack_harness import InProcessStack

PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def mtls_stack(tiny_model_dir, pki):
    """Worker, scheduler and router all serving mTLS (same certificate and CA on each)."""
    flags = pki.service_flags(mtls=True)
    stack = InProcessStack(tiny_model_dir, worker_argv=[*TINY_WORKER, *flags],
                           scheduler_argv=[*TINY_SCHEDULER, *flags], router_argv=flags).start()
    yield stack
    stack.stop()


def _client(stack, pki, **kw) -> Client:
    return Client(stack.address, timeout=30, max_retries=0, **kw)


def _mtls_client(stack, pki) -> Client:
    return _client(stack, pki, root_certificates=pki.read("ca"),
                   private_key=pki.read("client_key"),
                   certificate_chain=pki.read("client_cert"))


def test_generate_streams_tokens_over_mtls_on_every_link(mtls_stack, pki):
    with _mtls_client(mtls_stack, pki) as c:
        deltas = list(c.stream(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                               ignore_eos=True))
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == MAX_TOKENS
    assert deltas[-1].finish_reason == "length"
    assert mtls_stack.wait_idle().num_running == 0  # harness calls reach the TLS scheduler


def test_async_client_with_channel_credentials(mtls_stack, pki):
    creds = grpc.ssl_channel_credentials(pki.read("ca"), pki.read("client_key"),
                                         pki.read("client_cert"))

    async def run():
        async with AsyncClient(mtls_stack.address, timeout=30, credentials=creds) as c:
            return await c.generate(prompt_token_ids=PROMPT, max_tokens=3, temperature=0,
                                    ignore_eos=True)
    assert len(asyncio.run(run()).token_ids) == 3


def test_plaintext_client_is_refused(mtls_stack, pki):
    with _client(mtls_stack, pki) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(prompt_token_ids=PROMPT, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_without_certificate_is_refused_under_mtls(mtls_stack, pki):
    with _client(mtls_stack, pki, root_certificates=pki.read("ca")) as c, \
            pytest.raises(grpc.RpcError) as e:
        c.generate(prompt_token_ids=PROMPT, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_certificate_from_another_ca_is_refused(mtls_stack, pki):
    with _client(mtls_stack, pki, root_certificates=pki.read("ca"),
                 private_key=pki.read("rogue_client_key"),
                 certificate_chain=pki.read("rogue_client_cert")) as c, \
            pytest.raises(grpc.RpcError) as e:
        c.generate(prompt_token_ids=PROMPT, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_must_verify_the_server(mtls_stack, pki):
    """Without the CA the client does not trust the server's certificate (system roots)."""
    with _client(mtls_stack, pki, private_key=pki.read("client_key"),
                 certificate_chain=pki.read("client_cert")) as c, \
            pytest.raises(grpc.RpcError) as e:
        c.generate(prompt_token_ids=PROMPT, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_internal_links_refuse_plaintext(mtls_stack, pki):
    """The scheduler (and so the router→scheduler link) serves mTLS only."""
    creds = load_tls(str(pki.client_cert), str(pki.client_key), str(pki.ca)).channel_credentials()
    scheduler = mtls_stack.scheduler_address
    assert asyncio.run(health_status(scheduler, 5.0)).startswith("UNREACHABLE")
    assert asyncio.run(check_health(scheduler, 5.0, credentials=creds))
    assert asyncio.run(check_health(mtls_stack.address, 5.0, credentials=creds))


def test_https_on_the_openai_port(mtls_stack, pki):
    import requests
    url = f"{mtls_stack.http_url}/v1/models"
    assert url.startswith("https://")
    r = requests.get(url, verify=str(pki.ca), cert=(str(pki.client_cert), str(pki.client_key)),
                     timeout=30)
    assert r.status_code == 200 and r.json()["data"]
    # mTLS, no client certificate: a TLS 1.3 server refuses after the client has finished
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(url, verify=str(pki.ca), timeout=30)
    with pytest.raises(requests.exceptions.ConnectionError):  # plaintext HTTP
        requests.get(url.replace("https://", "http://"), timeout=30)


def test_tls_without_client_auth(pki):
    """Certificate and key but no CA on the server: TLS, and any client that trusts the
    server's CA connects without a certificate of its own; plaintext is refused."""
    tls = load_tls(str(pki.server_cert), str(pki.server_key))
    assert not tls.mtls

    async def run():
        server, port, health = await new_server("127.0.0.1", 0, tls=tls)
        await server.start()
        await set_serving(health, True, [])
        try:
            address = f"127.0.0.1:{port}"
            ok = await check_health(address, 5.0, credentials=grpc.ssl_channel_credentials(
                pki.read("ca")))
            plain = await health_status(address, 5.0)
            return ok, plain
        finally:
            await server.stop(None)
    ok, plain = asyncio.run(run())
    assert ok
    assert plain.startswith("UNREACHABLE")


def test_load_tls_errors(pki, tmp_path):
    assert load_tls() is None
    with pytest.raises(ValueError, match="--ssl-keyfile"):
        load_tls(certfile=str(pki.server_cert))
    with pytest.raises(FileNotFoundError, match="--ssl-ca-certs"):
        load_tls(str(pki.server_cert), str(pki.server_key), str(tmp_path / "missing.pem"))
    ca_only = load_tls(ca_certs=str(pki.ca))  # a client-side-only setting: verify peers
    with pytest.raises(ValueError, match="--ssl-certfile"):
        ca_only.server_credentials()


def test_sdk_tls_argument_errors(pki):
    with pytest.raises(ValueError, match="together"):
        Client("127.0.0.1:1", private_key=pki.read("client_key"))
    with pytest.raises(ValueError, match="not both"):
        Client("127.0.0.1:1", root_certificates=pki.read("ca"),
               credentials=grpc.ssl_channel_credentials())


def test_every_service_and_serve_take_the_tls_flags(pki):
    from services.cli.flags import SERVICES, forwarded_argv, serve_parser
    flags = pki.service_flags(mtls=True)
    ns = serve_parser().parse_args(flags)
    for name in SERVICES:
        argv = forwarded_argv(name, ns)
        for flag, value in zip(flags[::2], flags[1::2]):
            assert argv[argv.index(flag) + 1] == value, (name, flag)
