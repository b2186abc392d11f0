"""Per-step cost of tensor parallelism on CPU: TP=1 vs TP=N in one command.

Runs the same engine steps (one prefill of ``--batch`` prompts of ``--prompt-len`` tokens, then
``--steps`` decode steps of one token each) through ``ModelRunner`` directly (no gRPC), first as
one rank, then as N rank processes joined by gloo, and reports the mean step times, their ratio,
and the time the ranks spent inside all-reduce / all-gather (timed around each collective on
tp rank 0, so it includes waiting for the slower rank).

Model: ``--model`` (its head counts must divide by N), else a random-weight Llama shaped like
SmolLM2-135M (30 layers, hidden 576, MLP 1536, vocab 49152, tied) but with 8 heads / 4 KV heads,
since SmolLM2's 9 heads do not split over 2 ranks.

Threads: every rank gets ``--threads`` torch threads (default 1), so a TP=N rank does 1/N of
the single rank's matmul work on as many threads; the difference left is what TP costs. (With
more threads than free cores, OpenMP's spinning makes step times meaningless on a shared VM.)

    .venv/bin/python benchmarks/tensor_parallel.py --tp 2 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time


def _run_rank(rank: int, tp: int, port: int, ns: dict, results) -> None:
    """One rank: load, run the steps, put {step times, collective time} on ``results``."""
    import torch

    from services.common.sampling_params import EngineSamplingParams
    from services.common.step import CachedRequest, NewRequest, StepInput
    from services.worker.config import WorkerConfig
    from services.worker.model_runner import ModelRunner
    from services.worker.parallel.distributed import (
        ParallelConfig,
        destroy_distributed,
        init_distributed,
    )

    torch.set_num_threads(ns["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    parallel = None
    if tp > 1:
        parallel = init_distributed(ParallelConfig(tp, 1, rank), torch.device("cpu"))
    runner = ModelRunner(WorkerConfig(model=ns["model"], dtype=ns["dtype"], device="cpu",
                                      kv_cache_memory=256 << 20), parallel)
    comm = [0.0, 0]  # seconds, calls
    if parallel is not None:
        for name in ("all_reduce", "all_gather_last_dim"):
            fn = getattr(parallel, name)

            def timed(x, fn=fn):
                t0 = time.perf_counter()
                out = fn(x)
                comm[0] += time.perf_counter() - t0
                comm[1] += 1
                return out
            setattr(parallel, name, timed)
    b, n, steps = ns["batch"], ns["prompt_len"], ns["steps"]
    per_req = -(-(n + steps + 1) // runner.block_size)
    greedy = EngineSamplingParams(temperature=0.0)
    new = [NewRequest(f"r{i}", [(7 * i + j) % 1000 + 5 for j in range(n)], greedy,
                      list(range(i * per_req, (i + 1) * per_req)), 0, n) for i in range(b)]
    t0 = time.perf_counter()
    runner.execute_step(StepInput(1, new, [], []))
    prefill = time.perf_counter() - t0
    comm_prefill, comm[0], comm[1] = comm[0], 0.0, 0
    times = []
    for s in range(steps):
        cached = [CachedRequest(f"r{i}", [], [], False, n + s, 1) for i in range(b)]  # (own tokens)
        t0 = time.perf_counter()
        runner.execute_step(StepInput(2 + s, [], cached, []))
        times.append(time.perf_counter() - t0)
    if rank == 0:
        results.put(dict(prefill_s=prefill, decode_s=times, comm_prefill_s=comm_prefill,
                         comm_decode_s=comm[0] / steps, comm_calls_per_step=comm[1] / steps))
    destroy_distributed()


def measure(tp: int, ns: dict) -> dict:
    """Run ``tp`` ranks as processes (spawned: fresh torch state); rank 0's numbers."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    from services.common.ports import free_port

    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(r, tp, port, ns, results)) for r in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 900
    while True:
        try:
            out = results.get(timeout=1)
            break
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed (exit codes {failed}) or timed out")
    for p in procs:
        p.join(60)
    return out


def smollm2_shaped_model(folder: str) -> str:
    """Write the random SmolLM2-shaped Llama (8 heads, 4 KV heads) into ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="default: a random SmolLM2-shaped Llama with 8 heads (see above)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=2, help="alternated runs of each")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--output", default=None, help="write the numbers as JSON here")
    ns = vars(p.parse_args())
    with tempfile.TemporaryDirectory() as tmp:
        label = ns["model"] or "random SmolLM2-shaped Llama, 8 heads / 4 KV heads"
        ns["model"] = ns["model"] or smollm2_shaped_model(tmp)
        report = run(ns, label)
    if ns["output"]:
        with open(ns["output"], "w") as f:
            json.dump(report, f, indent=2)


def run(ns: dict, label: str) -> dict:
    """Both measurements, alternated ``--repeats`` times (the best median of each is kept: on a
    shared machine the slow outliers are other processes' load), and the printed report."""
    runs: dict[int, list[dict]] = {1: [], ns["tp"]: []}
    for _ in range(ns["repeats"]):
        for tp in runs:
            runs[tp].append(measure(tp, ns))
    one, many = (min(runs[tp], key=lambda r: statistics.median(r["decode_s"])) for tp in runs)
    d1, dn = statistics.median(one["decode_s"]), statistics.median(many["decode_s"])
    report = dict(config={**{k: v for k, v in ns.items() if k != "output"}, "model": label},
                  tp1_decode_medians_s=[statistics.median(r["decode_s"]) for r in runs[1]],
                  tpn_decode_medians_s=[statistics.median(r["decode_s"]) for r in runs[ns["tp"]]],
                  tp1_prefill_s=one["prefill_s"], tpn_prefill_s=many["prefill_s"],
                  tp1_decode_step_s=d1, tpn_decode_step_s=dn, decode_ratio=dn / d1,
                  prefill_ratio=many["prefill_s"] / one["prefill_s"],
                  tpn_comm_decode_step_s=many["comm_decode_s"],
                  tpn_comm_prefill_s=many["comm_prefill_s"],
                  tpn_comm_calls_per_step=many["comm_calls_per_step"])
    print(json.dumps(report, indent=2))
    print(f"decode step: TP=1 {d1 * 1e3:.1f} ms, TP={ns['tp']} {dn * 1e3:.1f} ms "
          f"(x{dn / d1:.2f}); all-reduce/gather {many['comm_decode_s'] * 1e3:.1f} ms/step in "
          f"{many['comm_calls_per_step']:.0f} calls; prefill TP=1 {one['prefill_s']:.2f} s, "
          f"TP={ns['tp']} {many['prefill_s']:.2f} s (comm {many['comm_prefill_s']:.2f} s)")
    return report


if __name__ == "__main__":
    main()
