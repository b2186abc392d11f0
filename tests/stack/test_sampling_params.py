"""min_p, repetition / presence / frequency penalties and min_tokens through the whole stack.

Greedy with penalties and min_tokens must equal transformers' ``generate`` exactly at float32:
repetition_penalty and min_new_tokens are transformers' own processors; presence/frequency (not
in transformers) run as a LogitsProcessor implementing OpenAI's formula, after the repetition
penalty, as in our sampler.
"""

from __future__ import annotations

import json
import random
import shutil

import grpc
import pytest
import torch
from pagedserve_client import Client

from tests.stack.conftest import _leak_check
from tests.stack_harness import InProcessStack

MAX_NEW = 24
PROMPT_LENGTHS = [5, 9, 40]


class PresenceFrequency:
    """OpenAI's penalties over output tokens: logit -= frequency * count + presence * (count >
    0); a transformers LogitsProcessor (``input_ids [1, L]``, ``scores [1, V]`` float32)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores, dtype=torch.int32)
        out = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
        presence = torch.tensor([[self.presence]], dtype=torch.float32)
        frequency = torch.tensor([[self.frequency]], dtype=torch.float32)
        return scores - (frequency * counts + presence * (counts > 0))


def hf_generate(model_dir: str, prompts: list[list[int]], max_new_tokens: int, *,
                eos_token_id=None, presence: float = 0.0, frequency: float = 0.0,
                **gen_kwargs) -> list[list[int]]:
    """tests/stack/conftest.py's ``hf_greedy`` with generate kwargs (repetition_penalty,
    min_new_tokens) and OpenAI's penalties: greedy token ids per prompt, float32. Without
    ``eos_token_id`` it runs to max_new_tokens; with it, the output ends with that token."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=eos_token_id, pad_token_id=0, **gen_kwargs)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            extra = LogitsProcessorList()
            if presence or frequency:
                extra.append(PresenceFrequency(len(ids), presence, frequency))
            out = model.generate(torch.tensor([ids]), generation_config=cfg,
                                 logits_processor=extra,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


def _greedy(address: str, prompts: list[list[int]], **kw):
    with Client(address) as c:
        return [c.generate(prompt_token_ids=p, **{"temperature": 0, "max_tokens": MAX_NEW,
                                                   "ignore_eos": True, **kw}) for p in prompts]


@pytest.mark.parametrize("penalty", [0.25, 1.3])
def test_greedy_repetition_penalty_matches_transformers(tiny, tiny_model_dir, prompts, penalty):
    expected = hf_generate(tiny_model_dir, prompts, MAX_NEW, repetition_penalty=penalty)
    got = [r.token_ids for r in _greedy(tiny.address, prompts, repetition_penalty=penalty)]
    assert got == expected
    if penalty < 1:  # the random model hardly repeats; a penalty < 1 makes it
        assert [r.token_ids for r in _greedy(tiny.address, prompts)] != got


@pytest.mark.parametrize("repetition, presence, frequency", [
    (1.0, -2.0, 0.0),  # a negative penalty makes the model repeat its output ...
    (4.0, -2.0, 0.0),  # ... which a repetition penalty > 1 then holds back
    (1.25, 0.5, 1.5),
])
def test_greedy_presence_frequency_and_repetition_match_the_formula(
        tiny, tiny_model_dir, prompts, repetition, presence, frequency):
    expected = hf_generate(tiny_model_dir, prompts, MAX_NEW, repetition_penalty=repetition,
                           presence=presence, frequency=frequency)
    got = [r.token_ids for r in _greedy(tiny.address, prompts, repetition_penalty=repetition,
                                        presence_penalty=presence, frequency_penalty=frequency)]
    assert got == expected
    if presence < 0 and repetition == 1.0:
        assert any(len(set(ids)) < len(ids) for ids in got)  # it did repeat
    if presence < 0 and repetition != 1.0:
        assert got != [r.token_ids for r in _greedy(tiny.address, prompts,
                                                    presence_penalty=presence,
                                                    frequency_penalty=frequency)]


@pytest.mark.parametrize("min_tokens", [0, 1, 6])
def test_min_tokens_holds_back_a_stop_token_like_transformers(tiny, tiny_model_dir, prompts,
                                                               min_tokens):
    # The stop token is each prompt's first greedy token: without min_tokens it ends at once.
    firsts = [r.token_ids[0] for r in _greedy(tiny.address, prompts, max_tokens=1)]
    for prompt, stop in zip(prompts, firsts, strict=True):
        expected = hf_generate(tiny_model_dir, [prompt], MAX_NEW, eos_token_id=stop,
                               min_new_tokens=min_tokens)[0]
        (r,) = _greedy(tiny.address, [prompt], stop_token_ids=[stop], min_tokens=min_tokens)
        assert r.token_ids == expected
        assert stop not in r.token_ids[:min_tokens]
        if expected[-1] == stop:
            assert r.finish_reason == "stop" and len(r.token_ids) > min_tokens
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == MAX_NEW
        if min_tokens == 0:
            assert r.token_ids == [stop] and r.finish_reason == "stop"


EOS_PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def eos_stack(tiny_model_dir, tmp_path_factory):
    """The tiny model with its EOS set to the greedy first token of ``EOS_PROMPT``, so EOS
    is sampled at once. Yields (stack, eos id, model folder)."""
    folder = tmp_path_factory.mktemp("tiny-eos") / "model"
    shutil.copytree(tiny_model_dir, folder)
    eos = hf_generate(str(folder), [EOS_PROMPT], 1)[0][0]
    for name in ("generation_config.json", "config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(cfg))
    stack = InProcessStack(str(folder), worker_argv=["--dtype", "float32", "--kv-cache-memory",
                                                     "64MiB"]).start()
    try:
        assert list(stack.info().eos_token_ids) == [eos]
        yield stack, eos, str(folder)
        _leak_check(stack)
    finally:
        stack.stop()


@pytest.mark.parametrize("min_tokens", [0, 4])
def test_min_tokens_holds_against_eos_like_transformers(eos_stack, min_tokens):
    stack, eos, folder = eos_stack
    expected = hf_generate(folder, [EOS_PROMPT], MAX_NEW, eos_token_id=eos,
                           min_new_tokens=min_tokens)[0]
    with Client(stack.address) as c:
        r = c.generate(prompt_token_ids=EOS_PROMPT, temperature=0, max_tokens=MAX_NEW,
                       min_tokens=min_tokens)
    assert r.token_ids == expected and eos not in r.token_ids[:min_tokens]
    if min_tokens == 0:
        assert r.token_ids == [eos] and r.finish_reason == "stop"
    else:
        assert r.finish_reason == ("stop" if expected[-1] == eos else "length")


def test_ignore_eos_lets_min_tokens_skip_eos(eos_stack):
    """With ignore_eos, min_tokens masks only stop_token_ids: EOS is sampled and runs on."""
    stack, eos, _ = eos_stack
    with Client(stack.address) as c:
        r = c.generate(prompt_token_ids=EOS_PROMPT, temperature=0, max_tokens=5, min_tokens=3,
                       ignore_eos=True)
    assert r.token_ids[0] == eos and r.finish_reason == "length" and len(r.token_ids) == 5


def test_sampled_min_p_and_penalties_run(tiny):
    with Client(tiny.address) as c:
        r = c.generate(prompt_token_ids=[5, 6, 7, 8], temperature=1.0, seed=3, max_tokens=16,
                       ignore_eos=True, min_p=0.2, top_k=50, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.1)
        again = c.generate(prompt_token_ids=[5, 6, 7, 8], temperature=1.0, seed=3,
                           max_tokens=16, ignore_eos=True, min_p=0.2, top_k=50,
                           presence_penalty=0.5, frequency_penalty=0.5,
                           repetition_penalty=1.1)
    assert r.finish_reason == "length" and len(r.token_ids) == 16
    assert again.token_ids == r.token_ids  # seeded: reproducible with penalties on


@pytest.mark.parametrize("kwargs, field", [
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
])
def test_bad_values_are_invalid_argument(tiny, kwargs, field):
    with Client(tiny.address) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate(prompt_token_ids=[5, 6, 7], **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field} must be")
