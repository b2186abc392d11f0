"""A/B of one engine setting on compare.py's workload, in one process: the same requests run
through Scheduler + ModelRunner once per value, alternating (A B A B ...) so that drift in the
machine's speed falls on both.

    .venv/bin/python benchmarks/ab_engine.py --num-requests 32 \\
        --knob kernels.torch_attention.DECODE_PADDING_FACTOR --values inf 1.25

``--knob module.NAME`` is a module-level constant read at run time; each value is parsed as a
Python bool/int/float literal (``True``, ``inf`` allowed), else kept as a string, and set before the run, e.g.
``--knob services.worker.attention.CPU_AUTO_BACKEND --values torch cpu``. ``--knob runner.NAME``
varies a ``ModelRunner`` keyword instead, e.g. ``--knob runner.batch_invariant --values False
True`` (the cost of ``--batch-invariant``). Prints output tokens/s per
run, the median per value and the ratio of each value's median to the first value's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def parse_value(text: str) -> bool | float | int | str:
    """``"True"`` / ``"False"`` → bool, ``"inf"`` → math.inf, ``"2"`` → 2, ``"1.25"`` → 1.25;
    anything else stays a string (``"cpu"``)."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    from compare import add_workload_args

    add_workload_args(p)
    p.add_argument("--knob", required=True,
                   help="module.CONSTANT to vary, or runner.KEYWORD (a ModelRunner argument)")
    p.add_argument("--values", nargs="+", required=True, type=parse_value)
    p.add_argument("--rounds", type=int, default=2, help="runs of each value, interleaved")
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    from compare import workload
    from throughput import bench_engine

    from services.router.tokenizer import load_tokenizer

    module_name, _, attr = a.knob.rpartition(".")
    module = None if module_name == "runner" else importlib.import_module(module_name)
    if module is not None:
        getattr(module, attr)  # AttributeError now, not after the first run
    items = workload(load_tokenizer(a.model), a.num_requests, a.seed)
    runs: dict[str, list[float]] = {str(v): [] for v in a.values}
    for r in range(a.rounds):
        for v in a.values:
            if module is not None:
                setattr(module, attr, v)
            tok_s = bench_engine(a.model, [it.prompt_token_ids for it in items],
                                 [it.output_len for it in items], a.dtype,
                                 **({attr: v} if module is None else {}))
            runs[str(v)].append(tok_s)
            print(f"round {r + 1} {a.knob}={v}: {tok_s:.1f} output tok/s", flush=True)
    base = statistics.median(runs[str(a.values[0])])
    for v, xs in runs.items():
        med = statistics.median(xs)
        print(f"{a.knob}={v}: median {med:.1f} tok/s, {med / base:.2f}x of {a.values[0]}")
    if a.json:
        a.json.write_text(json.dumps({"knob": a.knob, "num_requests": a.num_requests,
                                      "dtype": a.dtype, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
