"""Parallel sampling (n > 1), priority and cached-token usage through the whole stack."""

from __future__ import annotations

import time

import grpc
import pytest
from pagedserve_client import Client

PROMPT = [5, 6, 7, 8]


def _generate(address: str, **kw):
    with Client(address) as c:
        return c.generate(prompt_token_ids=kw.pop("prompt_token_ids", PROMPT), **kw)


def _check_usage(result, prompt_len: int) -> None:
    for choice in result.choices:
        assert choice.usage.prompt_tokens == prompt_len
        assert choice.usage.completion_tokens == len(choice.token_ids) > 0


def test_seeded_choices_are_reproducible_and_differ(tiny):
    kw = dict(n=4, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    a, b = _generate(tiny.address, **kw), _generate(tiny.address, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in a.choices)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) > 1, "4 seeded samples all identical"
    _check_usage(a, len(PROMPT))
    # choice 0 is the same request as n=1 with the same seed (child 0 keeps the seed)
    single = _generate(tiny.address, **{**kw, "n": 1})
    assert single.token_ids == a.choices[0].token_ids
    assert (a.text, a.token_ids, a.usage) == (a.choices[0].text, a.choices[0].token_ids,
                                              a.choices[0].usage)


def test_greedy_choices_equal_the_single_greedy_output(tiny):
    kw = dict(temperature=0, max_tokens=8, ignore_eos=True)
    single = _generate(tiny.address, n=1, **kw)
    multi = _generate(tiny.address, n=4, **kw)
    assert len(single.choices) == 1 and len(single.token_ids) == 8
    assert [c.token_ids for c in multi.choices] == [single.token_ids] * 4
    assert [c.text for c in multi.choices] == [single.text] * 4
    _check_usage(multi, len(PROMPT))


def test_streamed_choices_interleave_and_each_ends_once(tiny):
    with Client(tiny.address) as c:
        deltas = list(c.stream(prompt_token_ids=PROMPT, n=3, seed=9, max_tokens=6,
                               ignore_eos=True))
    finals = [d for d in deltas if d.finish_reason]
    assert sorted(d.index for d in finals) == [0, 1, 2]
    assert deltas[-1].finish_reason is not None
    for i in range(3):
        ids = [t for d in deltas if d.index == i for t in d.token_ids]
        final = next(d for d in finals if d.index == i)
        assert final.usage.completion_tokens == len(ids) == 6


def test_stop_string_on_one_choice_does_not_end_the_others(tiny):
    kw = dict(n=2, temperature=1.0, max_tokens=30, ignore_eos=True)
    for seed in range(20):  # find a seed whose choice 0 has a short string choice 1 lacks
        free = _generate(tiny.address, seed=seed, **kw)
        t0, t1 = free.choices[0].text, free.choices[1].text
        stop = next((t0[i:i + 3] for i in range(4, len(t0) - 3)
                     if t0[i:i + 3].strip() and t0[i:i + 3] not in t1), None)
        if stop is not None:
            break
    else:
        pytest.fail("no seed gave a stop string found in choice 0 only")
    stopped = _generate(tiny.address, seed=seed, stop=[stop], **kw)
    c0, c1 = stopped.choices
    assert c0.finish_reason == "stop" and c0.stop_reason == stop
    assert c0.text == t0[:t0.find(stop)]
    assert len(c0.token_ids) < 30 and c0.usage.completion_tokens == len(c0.token_ids)
    # choice 1 ran on to max_tokens, exactly as without the stop string
    assert (c1.finish_reason, c1.stop_reason) == ("length", None)
    assert (c1.text, c1.token_ids) == (t1, free.choices[1].token_ids)


def test_cancelled_n4_stream_frees_every_choice(tiny):
    with Client(tiny.address) as c:
        stream = c.stream(prompt_token_ids=list(range(3, 40)), n=4, max_tokens=800,
                          ignore_eos=True)
        seen = set()
        for i, d in enumerate(stream):
            seen.add(d.index)
            if i == 8:
                break
        stream.close()  # cancels the RPC
    assert len(seen) > 1, "the choices' deltas should interleave"
    deadline = time.monotonic() + 5
    while True:
        s = tiny.stats()
        if s.num_running == s.num_waiting == s.num_used_blocks == 0:
            break
        assert time.monotonic() < deadline, f"choices still in the engine after cancel: {s}"
        time.sleep(0.05)


@pytest.mark.parametrize("n", [0, 65])
def test_n_out_of_range_is_invalid_argument(tiny, n):
    with pytest.raises(grpc.RpcError) as err:
        _generate(tiny.address, n=n, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"n must be in [1, 64], got {n}"


def test_priority_under_fcfs_is_invalid_argument(tiny):
    assert tiny.info().scheduling_policy == "fcfs"
    with pytest.raises(grpc.RpcError) as err:
        _generate(tiny.address, priority=3, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority" in err.value.details() and "got 3" in err.value.details()
    assert _generate(tiny.address, priority=0, max_tokens=2).usage.completion_tokens == 2


def test_repeated_prompt_reports_cached_tokens(tiny):
    info = tiny.info()
    assert info.enable_prefix_caching  # the default
    prompt = list(range(100, 100 + 3 * info.block_size + 5))
    first = _generate(tiny.address, prompt_token_ids=prompt, temperature=0, max_tokens=2)
    again = _generate(tiny.address, prompt_token_ids=prompt, temperature=0, max_tokens=2)
    assert again.token_ids == first.token_ids
    cached = again.usage.num_cached_tokens
    assert cached > 0 and cached % info.block_size == 0 and cached < len(prompt)
    assert again.usage.prompt_tokens == len(prompt)

