"""Beams and a copy-on-write fork driven through ``ModelRunner.execute_step`` the way the
scheduler would (kept free of test imports: the TP test's spawned ranks run it too).

``run_fork``: beam "a" computes the prompt into two blocks, the second partial; beam "b", a
fork of it, holds the same table. At the first decode step the scheduler gives "b" a copy of
the shared partial block (``blocks_to_copy``) and puts it in b's table (``first_new_block``);
each step it sends each beam its next token (``new_token_ids``), as it does for beams.
``run_unshared``: the same two token sequences as two requests with their own blocks.
"""

from __future__ import annotations

import torch

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput, StepOutput


def beam_params(vocab_size: int) -> EngineSamplingParams:
    """A beam asking for every token as a candidate (so its logprobs are the whole [V])."""
    return EngineSamplingParams(temperature=0.0, beam_width=2, logprobs=vocab_size)


def logprobs_of(out: StepOutput, vocab_size: int) -> dict[str, torch.Tensor]:
    """Each returned request's logprobs ``[V]`` float32, put back together from its top-V
    candidates (NaN where a token was not among them); empty on a rank that returns none."""
    lp, result, offset = out.logprobs, {}, 0
    if lp is None:
        return {}
    for request_id, k in zip(out.request_ids, lp.num_top_logprobs, strict=True):
        if k < 0:
            continue
        full = torch.full((vocab_size,), float("nan"))
        full[torch.tensor(lp.top_token_ids[offset:offset + k])] = torch.tensor(
            lp.top_logprobs[offset:offset + k])
        result[request_id] = full
        offset += k
    return result


def token_lists(runner, request_ids: list[str]) -> dict[str, list[int]]:
    """The token lists the runner holds for ``request_ids``."""
    batch = runner.input_batch
    rows = {rid: batch.requests[rid].row for rid in request_ids}
    return {rid: batch.token_ids[row, :batch.num_tokens[row]].tolist()
            for rid, row in rows.items()}


def run_fork(runner, prompt: list[int], a_tokens: list[int], b_tokens: list[int],
             blocks: list[int], step_id: int = 0, copy: bool = True, replace: bool = True
             ) -> tuple[list[dict[str, torch.Tensor]], dict[str, list[int]]]:
    """Beam "a" computes ``prompt`` (between one and two blocks long) into ``blocks[:2]``;
    fork "b" shares that table; then one decode step per token pair of ``a_tokens`` /
    ``b_tokens``. At the first, "b" gets ``blocks[2]``: a copy of the shared partial block
    (unless ``copy`` is False) written into its table from index 1 (unless ``replace`` is
    False: then b writes into the shared block, as without copy-on-write).

    Returns the logprobs ``{request id: [V]}`` of every decode step (empty dicts on a rank
    that returns none), and both beams' token lists before they finish.
    """
    n, bs, vocab = len(prompt), runner.block_size, runner.vocab_size
    assert bs < n and n + len(a_tokens) <= 2 * bs
    shared, fresh = blocks[:2], blocks[2]
    params = beam_params(vocab)
    runner.execute_step(StepInput(step_id, [NewRequest("a", prompt, params, shared, 0, n),
                                            NewRequest("b", prompt, params, shared, n, 0)],
                                  [], []))
    steps = []
    for t, (x, y) in enumerate(zip(a_tokens, b_tokens, strict=True)):
        fork_now = t == 0
        b_blocks = [fresh] if fork_now and replace else []
        cached = [CachedRequest("a", [x], [], False, n + t, 1),
                  CachedRequest("b", [y], b_blocks, False, n + t, 1,
                                first_new_block=1 if b_blocks else -1)]
        copies = [(shared[1], fresh)] if fork_now and copy else []
        out = runner.execute_step(StepInput(step_id + 1 + t, [], cached, [], copies))
        steps.append(logprobs_of(out, vocab))
    tokens = token_lists(runner, ["a", "b"])
    runner.execute_step(StepInput(step_id + 1 + len(a_tokens), [], [], ["a", "b"]))
    return steps, tokens


def run_unshared(runner, prompt: list[int], a_tokens: list[int], b_tokens: list[int],
                 blocks: list[int], step_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """``run_fork``'s token sequences as two requests of their own blocks (``blocks[:2]``
    and ``blocks[2:4]``), prefilled together, then decoded step by step."""
    n, vocab = len(prompt), runner.vocab_size
    params = beam_params(vocab)
    runner.execute_step(StepInput(step_id, [NewRequest("a", prompt, params, blocks[:2], 0, n),
                                            NewRequest("b", prompt, params, blocks[2:4], 0, n)],
                                  [], []))
    steps = []
    for t, (x, y) in enumerate(zip(a_tokens, b_tokens, strict=True)):
        cached = [CachedRequest("a", [x], [], False, n + t, 1),
                  CachedRequest("b", [y], [], False, n + t, 1)]
        steps.append(logprobs_of(runner.execute_step(StepInput(step_id + 1 + t, [], cached, [])),
                                 vocab))
    runner.execute_step(StepInput(step_id + 1 + len(a_tokens), [], [], ["a", "b"]))
    return steps


def tp_rank(rank: int, port: int, model: str, prompt: list[int], a_tokens: list[int],
            b_tokens: list[int], blocks: list[int], out_path: str) -> None:
    """Rank ``rank`` of a TP=2 group (gloo; run in a spawned process): ``run_fork``, then write
    ``{"tokens", "copied", "logprobs"}`` as JSON to ``out_path`` (copied: the fresh block holds
    the shared block's K and V of the prompt's tokens in every layer of this rank's heads)."""
    import json
    import os

    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from services.worker.parallel.distributed import (
        ParallelConfig,
        destroy_distributed,
        init_distributed,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ps = init_distributed(ParallelConfig(2, 1, rank), torch.device("cpu"), timeout_s=60)
    runner = ModelRunner(WorkerConfig(model=model, dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="torch"), ps)
    steps, tokens = run_fork(runner, prompt, a_tokens, b_tokens, blocks)
    in_block = len(prompt) - runner.block_size  # the prompt's tokens in the shared block
    copied = all(torch.equal(t[blocks[2], :in_block], t[blocks[1], :in_block])
                 for kv in runner.kv_caches for t in kv)
    with open(out_path, "w") as f:
        json.dump({"tokens": tokens, "copied": copied,
                   "logprobs": [{rid: v.tolist() for rid, v in s.items()} for s in steps]}, f)
    destroy_distributed()  # (see tests/parallel/vocab_check.py: exit cleanly)
