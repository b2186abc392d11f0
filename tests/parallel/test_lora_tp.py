"""Multi-LoRA at TP=2 through the whole stack (issue 35): two rank processes, the scheduler,
the router with three adapters of different ranks (one rsLoRA, one on some projections only);
requests of every adapter and of the base model sent at once (so each step mixes them), greedy
tokens equal transformers + PEFT exactly at float32."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import make_peft_lora
from tests.parallel.conftest import PROMPTS, ParallelStack
from tests.worker.lora_driver import reference_greedy

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-adapters")
    return {"r4": make_peft_lora(tiny_model, root / "r4", r=4, lora_alpha=8),
            "r8": make_peft_lora(tiny_model, root / "r8", r=8, seed=1, use_rslora=True),
            "r16": make_peft_lora(tiny_model, root / "r16", r=16, seed=2, lora_alpha=32,
                                  target_modules=("q_proj", "o_proj", "down_proj"))}


def test_three_adapters_and_the_base_at_tp2_equal_peft(tiny_model, adapters):
    want = {name: reference_greedy(tiny_model, path, PROMPTS, MAX_TOKENS)
            for name, path in (("", None), *adapters.items())}
    assert all(want[name] != want[""] for name in adapters)  # (each adapter matters)
    stack = ParallelStack(
        tiny_model, tp=2,
        worker_argv=["--enforce-eager", "--enable-lora", "--max-loras", "3",
                     "--max-lora-rank", "16"],
        scheduler_argv=["--max-loras", "3"],
        router_argv=["--enable-lora", "--max-lora-rank", "16", "--lora-modules",
                     *(f"{name}={path}" for name, path in adapters.items())]).start()
    try:
        from pagedserve_client import Client

        cases = [(model, i) for model in ("r4", "", "r8", "r16") for i in range(len(PROMPTS))]

        def one(case):
            model, i = case
            with Client(stack.address) as c:
                return c.generate(prompt_token_ids=PROMPTS[i], temperature=0,
                                  max_tokens=MAX_TOKENS, ignore_eos=True,
                                  model=model).token_ids

        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(one, cases))
        assert got == [want[model][i] for model, i in cases]
    finally:
        stack.stop()
