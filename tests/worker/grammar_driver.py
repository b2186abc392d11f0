"""A small scheduler stand-in for the structured-output and logit_bias tests (kept free of
test imports: the TP test's spawned ranks run it too).

``generate`` runs requests to completion through ``runner.execute_step`` the way the scheduler
would: each step every running request gets all its remaining tokens, new ones in full once,
then diffs; a request finishes on an EOS id (unless ignore_eos; an EOS at output index <
min_tokens does not finish, as the scheduler's ``stop_checks.check_stop``) or at max_tokens;
``preempt = (step, i)`` frees request i's blocks at that step and resumes it with its whole
token list (``resumed_from_preemption``) less its last output token, as after a step whose
result the scheduler dropped (the worker had appended it). The tokens are read back from the
runner's own token lists, so a tp rank that returns no tokens drives the same steps. A request
the step reports broken (``StepOutput.broken_request_ids``: only the driver's) ends there, as
the scheduler ends it, without that step's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput


@dataclass
class _Req:
    request_id: str
    tokens: list[int]
    params: EngineSamplingParams
    num_prompt: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    seen: bool = False
    resumed: bool = False
    done: bool = False


def generate(runner, prompts: list[list[int]], params: list[EngineSamplingParams],
             preempt: tuple[int, int] | None = None, max_steps: int = 500,
             broken: dict[str, str] | None = None) -> list[list[int]]:
    """The output token ids of each prompt (EOS included when it ended the request);
    ``broken`` (if given) gets the message of each request whose grammar broke, by request id
    (``req-<i>``)."""
    eos = set(runner.eos_token_ids)
    free = list(range(runner.num_kv_blocks))[::-1]
    bs = runner.block_size
    reqs = [_Req(f"req-{i}", list(p), sp, len(p)) for i, (p, sp) in enumerate(
        zip(prompts, params, strict=True))]
    finished: list[str] = []
    for step_id in range(max_steps):
        if all(r.done for r in reqs):
            break
        if preempt is not None and step_id == preempt[0]:
            victim = reqs[preempt[1]]
            assert victim.seen and not victim.done and len(victim.tokens) > victim.num_prompt
            free.extend(victim.blocks)
            victim.blocks, victim.computed, victim.resumed = [], 0, True
            victim.tokens.pop()
        new, cached, running = [], [], []
        for r in reqs:
            if r.done:
                continue
            n = len(r.tokens) - r.computed
            added = [free.pop() for _ in range(-(-len(r.tokens) // bs) - len(r.blocks))]
            r.blocks += added
            if not r.seen:
                new.append(NewRequest(r.request_id, list(r.tokens), r.params, list(r.blocks),
                                      r.computed, n))
            else:
                cached.append(CachedRequest(r.request_id, list(r.tokens) if r.resumed else [],
                                            list(r.blocks) if r.resumed else added, r.resumed,
                                            r.computed, n))
            r.seen, r.resumed = True, False
            r.computed += n
            running.append(r)
        out = runner.execute_step(StepInput(step_id, new, cached, finished))
        finished = []
        batch = runner.input_batch
        gone = dict(zip(out.broken_request_ids, out.broken_messages, strict=True))
        for r in running:
            if r.request_id in gone:
                if broken is not None:
                    broken[r.request_id] = gone[r.request_id]
                r.done = True
                free.extend(r.blocks)
                finished.append(r.request_id)
                continue
            row = batch.requests[r.request_id].row
            token = int(batch.token_ids[row, batch.num_tokens[row] - 1])
            r.tokens.append(token)
            outputs = len(r.tokens) - r.num_prompt
            p = r.params
            if ((token in eos and not p.ignore_eos and outputs > p.min_tokens)
                    or outputs == p.max_tokens):
                r.done = True
                free.extend(r.blocks)
                finished.append(r.request_id)
    else:
        raise AssertionError(f"not done after {max_steps} steps")
    runner.execute_step(StepInput(max_steps, [], [], finished))
    return [r.tokens[r.num_prompt:] for r in reqs]


def tp_rank(rank: int, port: int, model: str, prompts: list[list[int]], grammars: list[str],
            out_path: str) -> None:
    """Rank ``rank`` of a TP=2 group (gloo; run in a spawned process): sample ``prompts``
    under ``grammars`` (seeded, temperature 1) and write ``[holds matchers, outputs]`` as JSON
    to ``out_path``."""
    import json
    import os

    import torch

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
                                      kv_cache_memory=16 << 20, attention_backend="torch"), ps)
    params = [EngineSamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_output=g)
              for i, g in enumerate(grammars)]
    outputs = generate(runner, prompts, params)
    with open(out_path, "w") as f:
        json.dump([runner.structured is not None, outputs], f)
    destroy_distributed()  # (see tests/parallel/vocab_check.py: exit cleanly)
