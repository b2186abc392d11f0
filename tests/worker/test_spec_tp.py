"""Speculative decoding under tensor parallelism (TP=2, gloo, two spawned rank processes):
the peer verifies the same drafts and appends what the driver kept (its padded broadcast), so
both ranks hold the same token lists, equal to a single rank's greedy run."""

from __future__ import annotations

import json
import random

import pytest
import torch

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput

GREEDY = EngineSamplingParams(temperature=0.0)


def plan(prompts: list[list[int]], refs: list[list[int]], new_tokens: int, seed: int = 0
         ) -> tuple[list[StepInput], list[dict[str, list[int]]]]:
    """Steps that decode ``prompts`` greedily with drafts partly right (against ``refs``, the
    greedy outputs), and each step's expected new tokens per request."""
    rng = random.Random(seed)
    ids = [f"tp{i}" for i in range(len(prompts))]
    steps = [StepInput(0, [NewRequest(rid, p, GREEDY, list(range(8 * i, 8 * i + 8)), 0, len(p))
                           for i, (rid, p) in enumerate(zip(ids, prompts, strict=True))], [], [])]
    expected = [{rid: [ref[0]] for rid, ref in zip(ids, refs, strict=True)}]
    done = [1] * len(ids)
    while min(done) < new_tokens:
        cached, got = [], {}
        for i, rid in enumerate(ids):
            right = refs[i][done[i]:done[i] + 4]
            good = rng.randrange(len(right) + 1)
            drafts = right[:good] + [(t + 1) % 512 for t in right[good:]]
            cached.append(CachedRequest(rid, [], [], False, len(prompts[i]) + done[i] - 1,
                                        1 + len(drafts), spec_token_ids=drafts))
            got[rid] = refs[i][done[i]:done[i] + good + 1]
            done[i] += good + 1
        steps.append(StepInput(len(steps), [], cached, []))
        expected.append(got)
    return steps, expected


def tp_rank(rank: int, port: int, model: str, steps: list[StepInput], out_path: str) -> None:
    """Rank ``rank`` of a TP=2 group: run ``steps``; write each step's output and the final
    token lists as JSON to ``out_path``."""
    import os

    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from services.worker.parallel.distributed import (
        ParallelConfig,
        destroy_distributed,
        init_distributed,
    )

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ps = init_distributed(ParallelConfig(2, 1, rank), torch.device("cpu"), timeout_s=60)
    runner = ModelRunner(WorkerConfig(model=model, dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="torch"), ps)
    outputs = [runner.execute_step(s) for s in steps]
    ib = runner.input_batch
    tokens = {rid: ib.token_ids[s.row, :ib.num_tokens[s.row]].tolist()
              for rid, s in ib.requests.items()}
    with open(out_path, "w") as f:
        json.dump({"tokens": tokens, "outputs": [
            [o.request_ids, o.sampled_token_ids, o.num_sampled_token_ids] for o in outputs]}, f)
    destroy_distributed()


@pytest.mark.slow  # two rank processes (spawned: torch imported twice)
def test_tp2_peer_appends_what_the_driver_verified(tiny_llama, tmp_path):
    import multiprocessing as mp

    from services.common.ports import free_port_range
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from tests.worker.test_spec_runner import reference

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (7, 20)]
    single = ModelRunner(WorkerConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                      kv_cache_memory=4 << 20, attention_backend="torch"))
    refs = reference(single, prompts, [GREEDY] * 2, new_tokens=20)
    steps, expected = plan(prompts, refs, new_tokens=12)
    ctx = mp.get_context("spawn")
    port = free_port_range(1)
    paths = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=tp_rank, args=(r, port, str(tiny_llama), steps, str(paths[r])))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    driver, peer = (json.loads(p.read_text()) for p in paths)
    for (ids, sampled, counts), want in zip(driver["outputs"], expected, strict=True):
        assert ids == list(want)
        assert sampled == [t for rid in ids for t in want[rid]]
        assert counts == (None if all(len(v) == 1 for v in want.values())
                          else [len(want[rid]) for rid in ids])
    assert all(o == [[], [], None] for o in peer["outputs"])
    assert peer["tokens"] == driver["tokens"]
    for i, rid in enumerate(("tp0", "tp1")):
        n = len(driver["tokens"][rid]) - len(prompts[i])
        assert driver["tokens"][rid] == prompts[i] + refs[i][:n]
