"""Drive one request through a ``ModelRunner`` in different step shapes, as a scheduler would:
alone, chunked, after a prefix-cache hit, beside other requests, resumed after preemption.
Returns its greedy tokens and raw logprobs, for the tests that compare them bitwise."""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.model_runner import ModelRunner

TOP = 5  # top logprobs compared per token


@dataclass(frozen=True)
class Shape:
    """How the request is scheduled. ``chunk``: prompt tokens per step (0 = whole);
    ``prefix``: tokens another request computed into its first blocks just before (a
    prefix-cache hit; a multiple of the block size); ``others``: random requests running
    beside it from its first step; ``preempt_after``: output tokens after which it is
    preempted and resumed (recomputed from 0 into other blocks), 0 = never."""

    chunk: int = 0
    prefix: int = 0
    others: int = 0
    preempt_after: int = 0


def _params(logprobs: int | None) -> EngineSamplingParams:
    return EngineSamplingParams(temperature=0.0, logprobs=logprobs)


def generate(runner: ModelRunner, prompt: list[int], max_tokens: int, shape: Shape = Shape(),
             vocab: int = 500, seed: int = 0) -> tuple[list[int], list[tuple]]:
    """The request's output tokens and, per token, ``(logprob, top ids, top logprobs)``.

    Block ids are handed out from 0 up each call (the runner holds no request afterwards)."""
    bs = runner.block_size
    rng = random.Random(seed)
    next_block, step_id = 0, 0

    def blocks(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = n_tokens // bs + 2
        next_block += n
        return list(range(next_block - n, next_block))

    def run(new=(), cached=(), finished=()):
        nonlocal step_id
        step_id += 1
        return runner.execute_step(StepInput(step_id, list(new), list(cached), list(finished)))

    table = blocks(len(prompt) + max_tokens)
    if shape.prefix:
        assert shape.prefix % bs == 0
        run(new=[NewRequest("pre", prompt[:shape.prefix], _params(None),
                            table[:shape.prefix // bs], 0, shape.prefix)])
        run(finished=["pre"])
    others = []
    for i in range(shape.others):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 90))]
        # (room for a token per step of x's: its prompt, chunked, and its output)
        others.append([f"other{i}", ids, blocks(len(ids) + len(prompt) + max_tokens), 0])
    tokens, out, logprobs = list(prompt), [], []
    done, first, others_new = shape.prefix, True, True
    while len(out) < max_tokens:
        n = len(tokens) - done
        if shape.chunk:
            n = min(n, shape.chunk)
        new, cached = [], []
        if first:
            new.append(NewRequest("x", list(prompt), _params(TOP), table, done, n))
            first = False
        elif shape.preempt_after and len(out) == shape.preempt_after and done == len(tokens) - 1:
            table, done, n = blocks(len(tokens) + max_tokens), 0, len(tokens)  # recompute all
            cached.append(CachedRequest("x", list(tokens), table, True, 0, n))
        else:
            cached.append(CachedRequest("x", [], [], False, done, n))
        for o in others:
            if others_new:
                new.append(NewRequest(o[0], o[1], _params(2), o[2], 0, len(o[1])))
                o[3] = len(o[1])
            else:
                cached.append(CachedRequest(o[0], [], [], False, o[3], 1))
                o[3] += 1
        others_new = False
        result = run(new=new, cached=cached)
        done += n
        if "x" not in result.request_ids:
            continue
        i = result.request_ids.index("x")
        token = result.sampled_token_ids[i]
        out.append(token)
        tokens.append(token)
        lp = result.logprobs
        assert lp is not None
        ks = lp.num_top_logprobs
        at = sum(k for k in ks[:i] if k > 0)
        logprobs.append((lp.sampled_logprobs[sum(1 for k in ks[:i] if k >= 0)],
                         tuple(lp.top_token_ids[at:at + TOP]),
                         tuple(lp.top_logprobs[at:at + TOP])))
    run(finished=["x"] + [o[0] for o in others])
    return out, logprobs
