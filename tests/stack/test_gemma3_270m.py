"""Gemma 3 270M (real weights: the base model's Q4_K_M GGUF, served at float32) through the
whole stack: greedy token ids equal transformers' for 4 plain-text prompts x 32 tokens, one of
them longer than the 512-token sliding window; ``pagedserve generate`` names France; a chat
request to this base model (no chat template) is a 400 naming ``--chat-template``.

``make install`` installs the model's packages; ``--model gemma3-270m`` names it
(``services.common.model_files.gemma3_270m_path``)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedserve_client import Client
from services.common.model_files import resolve_model
from tests.stack.conftest import _leak_check, hf_greedy
from tests.stack_harness import InProcessStack

MAX_NEW = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    # ~600 tokens: longer than the sliding window (512) of the local layers
    " ".join(["The river ran past the mill, and the miller counted the sacks of grain that "
              "the farmers had brought from the hills before the first snow."] * 20)
    + " When spring came, the miller",
]


@pytest.fixture(scope="module")
def gemma():
    """(stack, prompt token ids, transformers' greedy ids)."""
    from services.router.tokenizer import load_tokenizer
    from services.worker.checkpoint import convert_gguf

    source = resolve_model("gemma3-270m")
    with ThreadPoolExecutor(2) as pool:  # the two one-off conversions (tokenizer in a child)
        weights = pool.submit(convert_gguf, source)
        tokenizer = load_tokenizer(source.path)
        folder = weights.result()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[-1]) > 512 and prompts[0][0] == tokenizer.bos_token_id
    # NOTE: the reference reads the worker's one-off conversion (transformers' own GGUF reader
    # and save_pretrained, services/worker/checkpoint.py), so the 253 MB file is dequantised
    # once.
    expected = hf_greedy(str(folder), prompts, MAX_NEW)
    stack = InProcessStack(source.path, worker_argv=[
        "--dtype", "float32", "--kv-cache-memory", "256MiB", "--enforce-eager"],
        scheduler_argv=["--max-model-len", "2048"]).start()
    try:
        yield stack, prompts, expected
    finally:
        stack.stop()


def test_greedy_equals_transformers(gemma):
    stack, prompts, expected = gemma

    def one(ids):
        with Client(stack.address) as c:
            return c.generate(prompt_token_ids=ids, temperature=0, max_tokens=MAX_NEW,
                              ignore_eos=True).token_ids
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    for text, g, e in zip(PROMPTS, got, expected, strict=True):
        assert g == e, f"diverged from transformers on {text[:40]!r}"
    _leak_check(stack)


def test_generate_cli_names_france(gemma):
    stack, _, _ = gemma
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--address", stack.address,
         "--prompt", "The capital of France is", "--temperature", "0", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=120, check=True,
        cwd=Path(__file__).resolve().parents[2]).stdout
    assert "France" in out or "Paris" in out, out


def test_chat_to_a_base_model_names_the_chat_template_flag(gemma):
    stack, _, _ = gemma
    with urllib.request.urlopen(f"{stack.http_url}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"{stack.http_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    assert "--chat-template" in e.value.read().decode()
