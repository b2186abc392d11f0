"""Worker memory and eager step time per weight mode: a model (default SmolLM2, the packaged
GGUF) loaded by ``ModelRunner`` in a fresh process per (dtype, ``--quantization``), eager, a
128 MiB KV cache. Modes: ``unset`` (a GGUF's quantized tensors as stored), ``none`` (a GGUF
dequantized at load to the dtype), ``int8``, ``w8a8``.

Memory: the process's resident memory after load and the structured-output tokenizer's
background build (``VmRSS``; ``- imports`` subtracts the RSS before the model was built;
``trimmed``: the same after ``malloc_trim(0)``, which returns the freed memory glibc still
holds, e.g. of the float weights quantization replaced) and its peak (``VmHWM``), from
/proc/self/status, and the weight bytes the loader counts (its ``weights: ...`` line).
Time: the model's forward plus LM head (the eager module, not the compiled forward), the
minimum of ``--reps`` calls, for a 128-token prefill of one sequence and a decode step of 1 and
of 16 sequences at 128 tokens of context.

    .venv/bin/python benchmarks/weight_modes.py [--dtypes bfloat16,float32] [--reps 10]
        [--model gemma3-270m] [--modes none,unset]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, logging, sys
def status():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}  # MiB
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("services.worker.loader").addHandler(Keep())
logging.getLogger("services.worker.loader").setLevel(logging.INFO)
import torch
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
before = status()
runner = ModelRunner(WorkerConfig(model=sys.argv[4] or None, dtype=sys.argv[1], enforce_eager=True,
                                  kv_cache_memory=128 << 20, quantization=sys.argv[2] or None))
if runner.structured is not None:
    runner.structured._ready.result()  # (its tokenizer is built in the background)
after = status()
import ctypes
ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the allocator still holds of freed memory, out
trimmed = status()
weights = next(line for line in lines if line.startswith("weights: "))

import time
from services.worker.attention import AttentionMetadata
model, bs, reps = runner.model, runner.block_size, int(sys.argv[3])
def step(batch, query, context):  # batch sequences, query new tokens each after context
    seq = context + query
    nb = -(-seq // bs)
    tables = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb)
    pos = torch.arange(context, seq).repeat(batch)
    rows = torch.arange(batch).repeat_interleave(query)
    meta = AttentionMetadata(
        slot_mapping=tables[rows, pos // bs].long() * bs + pos % bs, block_tables=tables,
        seq_lens=torch.full((batch,), seq, dtype=torch.int32),
        query_start_loc=torch.arange(0, batch * query + 1, query, dtype=torch.int32),
        max_query_len=query, max_seq_len=seq)
    ids = torch.randint(0, runner.vocab_size, (batch * query,))
    last = torch.arange(query - 1, batch * query, query)
    def run():
        with torch.inference_mode():
            hidden = model(ids, pos, runner.kv_caches, [meta] * runner.num_layers)
            model.compute_logits(hidden[last])
    for _ in range(2):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)
ms = {"prefill 128": step(1, 128, 0), "decode x1": step(1, 1, 128),
      "decode x16": step(16, 1, 128)}
print(json.dumps({"before": before["VmRSS"], "rss": after["VmRSS"], "peak": after["VmHWM"],
                  "trimmed": trimmed["VmRSS"],
                  "weights_mib": float(weights.rsplit("; ", 1)[1].split()[0]), "ms": ms}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--model", default="", help="--model (default: the packaged SmolLM2)")
    p.add_argument("--modes", default="unset,none,int8,w8a8",
                   help="--quantization values, comma-separated (unset: the flag not given)")
    a = p.parse_args()
    print(f"{'dtype':9s} {'--quantization':14s} {'weights MiB':>11s} {'RSS MiB':>8s} "
          f"{'- imports':>9s} {'trimmed':>8s} {'peak MiB':>9s} {'prefill 128 ms':>15s} "
          f"{'decode x1 ms':>13s} "
          f"{'decode x16 ms':>14s}")
    for dtype in a.dtypes.split(","):
        for mode in a.modes.split(","):
            mode = "" if mode == "unset" else mode
            out = subprocess.run([sys.executable, "-c", _CHILD, dtype, mode, str(a.reps),
                                  a.model],
                                 cwd=ROOT,
                                 capture_output=True, text=True, check=True,
                                 env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                      **_passthrough()})
            r = json.loads(out.stdout.strip().splitlines()[-1])
            ms = r["ms"]
            print(f"{dtype:9s} {mode or 'unset':14s} {r['weights_mib']:11.1f} {r['rss']:8.0f} "
                  f"{r['rss'] - r['before']:9.0f} {r['trimmed'] - r['before']:8.0f} "
                  f"{r['peak']:9.0f} {ms['prefill 128']:15.1f} "
                  f"{ms['decode x1']:13.1f} {ms['decode x16']:14.1f}", flush=True)


def _passthrough() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()
            if k.startswith(("PAGEDSERVE_", "HOME", "OMP_", "TORCH"))}


if __name__ == "__main__":
    main()
