"""Time one scheduler step: ``Scheduler.schedule()`` plus encoding it as the worker StepRequest.

    .venv/bin/python benchmarks/scheduler_step.py [--num-requests 256 --steps 1000]

Pure Python, no model: ``--num-requests`` requests with ``--prompt-len``-token prompts are
prefilled, then every step is a decode step of all of them (each gets one new token, so every
``block_size`` steps each request fills a block: allocation and prefix-cache registration are
in the measured path). The sampled tokens are fed back with ``update_from_output`` outside the
timed section. Prints the median, p90 and p99 over ``--steps`` steps, for prefix caching on and
off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.step import StepOutput  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.request import EngineSamplingParams, Request  # noqa: E402
from services.scheduler.scheduler import Scheduler  # noqa: E402
from services.scheduler.worker_client import step_requests  # noqa: E402


def _sampled(out, token: int) -> StepOutput:
    """A worker's answer giving every request of ``out`` the token ``token``."""
    rids = list(out.num_scheduled_tokens)
    return StepOutput(out.step_id, rids, [token] * len(rids))


def measure(num_requests: int, prompt_len: int, steps: int, block_size: int,
            prefix_caching: bool) -> dict:
    """Seconds per step (schedule + ``step_requests``, the encoding ``WorkerGroup.send`` does)
    over ``steps`` decode steps."""
    max_model_len = prompt_len + steps + 72
    blocks_per_request = -(-max_model_len // block_size)
    config = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=8192,
                             max_model_len=max_model_len, block_size=block_size,
                             enable_prefix_caching=prefix_caching,
                             async_scheduling=False)  # (the tokens go on the wire: encoded)
    scheduler = Scheduler(config, num_kv_blocks=num_requests * blocks_per_request + 1,
                          eos_token_ids=[0])
    params = EngineSamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 64)
    for i in range(num_requests):
        prompt = [1 + (i * 31 + j) % 30000 for j in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params))
    # prefill (untimed): as many steps as the budget needs
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        out = scheduler.schedule()
        scheduler.update_from_output(out, _sampled(out, 7))
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        step_requests(out, [True])  # (what WorkerGroup.send encodes for one stage)
        times.append(time.perf_counter() - t0)
        assert len(out.num_scheduled_tokens) == num_requests
        scheduler.update_from_output(out, _sampled(out, 7 + step % 1000))
    times.sort()
    return {"prefix_caching": prefix_caching, "median_ms": statistics.median(times) * 1e3,
            "p90_ms": times[int(0.9 * len(times))] * 1e3,
            "p99_ms": times[int(0.99 * len(times))] * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    results = [measure(args.num_requests, args.prompt_len, args.steps, args.block_size, pc)
               for pc in (True, False)]
    for r in results:
        print(json.dumps({"num_requests": args.num_requests, **{k: round(v, 4) if isinstance(
            v, float) else v for k, v in r.items()}}))


if __name__ == "__main__":
    main()
