"""SmolLM2-135M-Instruct (the packaged GGUF) through the whole stack equals transformers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from pagedserve_client import Client

from services.common.model_files import resolve_model
from tests.stack.conftest import _leak_check, hf_greedy
from tests.stack_harness import InProcessStack

CHATS = ["What is the capital of France?", "Write a haiku about autumn.",
         "List three prime numbers.", "Explain gravity to a child."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smol_stack():
    stack = InProcessStack(None, worker_argv=["--dtype", "float32",
                                              "--kv-cache-memory", "512MiB"]).start()
    yield stack
    stack.stop()


def test_smollm2_greedy_chat_matches_transformers(smol_stack):
    from transformers import AutoTokenizer

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}],
                                       add_generation_prompt=True, tokenize=True)
               for c in CHATS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    expected = hf_greedy(src.folder, prompts, NEW_TOKENS, gguf_file=src.gguf_file,
                         ignore_eos=False)

    def one(chat):
        with Client(smol_stack.address) as c:
            return c.generate(messages=[{"role": "user", "content": chat}], temperature=0,
                              max_tokens=NEW_TOKENS)
    with ThreadPoolExecutor(len(CHATS)) as pool:
        results = list(pool.map(one, CHATS))
    for chat, prompt, r, e in zip(CHATS, prompts, results, expected, strict=True):
        assert r.usage.prompt_tokens == len(prompt), f"chat template differs for {chat!r}"
        assert r.token_ids == e, f"{chat!r}: {r.text!r}"
        assert r.finish_reason == ("length" if len(e) == NEW_TOKENS else "stop")
    assert "Paris" in results[0].text
    _leak_check(smol_stack)
