"""Exactness of GGUF models served as stored: greedy token ids through the whole stack at
``--dtype float32`` against transformers' float32 greedy on the same GGUF (issue 51).

For each model (the packaged SmolLM2 Q4_1, Gemma 3 270M Q4_K_M) the reference is transformers
on the worker's one-off conversion (``services.worker.checkpoint.convert_gguf``: transformers'
own GGUF reader, dequantized to float32 by the gguf package, saved as safetensors), greedy,
``ignore_eos``, one prompt at a time. For each mode (compiled = the default, eager =
``--enforce-eager``) an in-process stack (``benchmarks.stack_harness.InProcessStack``) serves
the GGUF file with no ``--quantization`` flag (as stored: the default for a ``.gguf``; the
worker's ``weights: ...`` log line is checked to say so) and gets the 8 prompts at once.

A divergence is reported with its first differing position, transformers' top-2 logit margin
there (a near-tie explains a float-summation-order divergence) and how far below transformers'
top token the served token scored. The exit status is 1 if any prompt diverges where that
margin exceeds ``--max-margin`` (1e-3), or a worker did not serve as stored / in the asked mode.

    .venv/bin/python benchmarks/gguf_exactness.py [--models smollm2,gemma3-270m]
        [--modes compiled,eager] [--new-tokens 64] [--max-margin 1e-3]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

MODELS = {"smollm2": None, "gemma3-270m": "gemma3-270m"}  # name -> resolve_model argument
TOP_K = 5  # transformers' top logits kept per generated position

_RIVER = ("The river ran past the mill, and the miller counted the sacks of grain that the "
          "farmers had brought from the hills before the first snow. ")
PROMPTS = {
    "fact": "The capital of France is",
    "code": "def fibonacci(n):\n    ",
    "story": "Once upon a time, in a small village by the sea,",
    "chat": "User: What are three good reasons to learn a second language?\nAssistant:",
    "numbers": "1, 2, 3, 5, 8, 13, 21, 34,",
    "json": '{"name": "Ada Lovelace", "born": 1815, "known_for": [',
    "howto": "To bake a loaf of bread at home, you will need flour, water, salt and",
    # ~600 tokens: longer than Gemma 3's sliding window (512) of the local layers
    "long": _RIVER * 20 + "When spring came, the miller",
}


@dataclass
class Reference:
    """transformers' greedy ids of one prompt and, per generated position, its top-``TOP_K``
    logits (values descending, token ids)."""

    ids: list[int]
    top_values: torch.Tensor  # [new_tokens, TOP_K] float32
    top_ids: torch.Tensor  # [new_tokens, TOP_K] int64


def reference(folder: str, prompts: list[list[int]], new_tokens: int) -> list[Reference]:
    """transformers' float32 greedy generation (``ignore_eos``) of each prompt, one at a time,
    with the top logits of every step."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), generation_config=cfg,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            logits = torch.cat(out.logits).float()  # [new_tokens, vocab]
            top = logits.topk(TOP_K, dim=-1)
            gen = out.sequences[0, len(ids):].tolist()
            assert gen == top.indices[:, 0].tolist(), "generate's ids are not its logits' argmax"
            refs.append(Reference(gen, top.values, top.indices))
    return refs


class _Lines(logging.Handler):
    """Keeps the messages of the loggers it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def serve(model_path: str, mode: str, prompts: list[list[int]], new_tokens: int
          ) -> tuple[list[list[int]], list[str], float]:
    """Start a stack on ``model_path`` at float32 (``mode``: compiled or eager), send every
    prompt at once (greedy, ``ignore_eos``); return the generated ids, the worker's loader /
    forward log lines and the seconds the requests took."""
    from benchmarks.stack_harness import InProcessStack
    from pagedserve_client import Client

    keep = _Lines()
    loggers = [logging.getLogger(n) for n in ("services.worker.loader",
                                              "services.worker.model_runner",
                                              "services.worker.compiled")]
    for lg in loggers:
        lg.addHandler(keep)
        lg.setLevel(logging.INFO)
    argv = ["--dtype", "float32", "--kv-cache-memory", "512MiB"]
    if mode == "eager":
        argv.append("--enforce-eager")
    try:
        stack = InProcessStack(model_path, worker_argv=argv,
                               scheduler_argv=["--max-model-len", "2048"]).start()
    finally:
        for lg in loggers:
            lg.removeHandler(keep)
    try:
        def one(ids):
            with Client(stack.address) as c:
                return c.generate(prompt_token_ids=ids, temperature=0, max_tokens=new_tokens,
                                  ignore_eos=True).token_ids
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = [list(g) for g in pool.map(one, prompts)]
        seconds = time.perf_counter() - start
    finally:
        stack.stop()
    return got, keep.lines, seconds


def check_worker(lines: list[str], mode: str) -> list[str]:
    """Problems with how the worker served: its weights not as stored, or the forward not in
    ``mode``. Returns the ``weights: ...`` line and the forward's line (compiled or eager)
    first, then the problems (if any)."""
    weights = next((x for x in lines if x.startswith("weights: ")), "")
    forward = next((x for x in lines if x.startswith("forward ")), "(no forward line)")
    problems = [weights or "(no 'weights: ...' line logged)", forward]
    if "as stored" not in weights or "float32" in weights.split(";")[0]:
        problems.append("the decoder's linear layers are not served as stored")
    eager = [x for x in lines if x.startswith("forward runs eagerly")]
    if mode == "eager" and not any("--enforce-eager" in x for x in eager):
        problems.append("asked eager, but no 'forward runs eagerly: --enforce-eager' line")
    if mode == "compiled" and (eager or not any(x.startswith("forward ") for x in lines)):
        problems.append(f"asked compiled, but: {eager or 'no compiled forward line'}")
    return problems


def compare(names: list[str], got: list[list[int]], refs: list[Reference]) -> list[dict]:
    """Per diverging prompt: its name, the first differing position, transformers' top-2
    margin there, and the served token's logit gap below transformers' top (None when it is
    not among transformers' top ``TOP_K``)."""
    out = []
    for name, g, r in zip(names, got, refs, strict=True):
        if g == r.ids:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(g, r.ids, strict=False)) if a != b),
                   min(len(g), len(r.ids)))
        if pos >= len(r.ids) or pos >= len(g):
            out.append({"prompt": name, "pos": pos, "margin": float("inf"), "gap": None,
                        "note": f"served {len(g)} tokens, expected {len(r.ids)}"})
            continue
        values, ids = r.top_values[pos], r.top_ids[pos].tolist()
        gap = (float(values[0] - values[ids.index(g[pos])]) if g[pos] in ids else None)
        out.append({"prompt": name, "pos": pos, "margin": float(values[0] - values[1]),
                    "gap": gap, "note": f"served {g[pos]}, transformers {r.ids[pos]}"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--modes", default="compiled,eager", help="of compiled, eager")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-margin", type=float, default=1e-3,
                   help="a divergence where transformers' top-2 margin exceeds this fails")
    args = p.parse_args(argv)
    from services.common.model_files import resolve_model
    from services.common.tokenizer_loading import load_tokenizer
    from services.worker.checkpoint import convert_gguf

    failed = False
    rows = []
    for model in args.models.split(","):
        source = resolve_model(MODELS[model])
        tokenizer = load_tokenizer(source.path)
        names = list(PROMPTS)
        prompts = [tokenizer.encode(PROMPTS[n]) for n in names]
        t0 = time.perf_counter()
        refs = reference(str(convert_gguf(source)), prompts, args.new_tokens)
        closest = min((float(r.top_values[i, 0] - r.top_values[i, 1]), n, i)
                      for n, r in zip(names, refs, strict=True) for i in range(len(r.ids)))
        print(f"{model}: {source.path}; prompt tokens {[len(x) for x in prompts]}; "
              f"transformers' reference in {time.perf_counter() - t0:.0f} s; its smallest "
              f"top-2 margin over the {len(names) * args.new_tokens} positions: "
              f"{closest[0]:.3g} ({closest[1]!r}, position {closest[2]})", flush=True)
        for mode in args.modes.split(","):
            got, lines, seconds = serve(source.path, mode, prompts, args.new_tokens)
            weights, forward, *problems = check_worker(lines, mode)
            print(f"  {mode}: {weights}\n  {mode}: {forward}", flush=True)
            for problem in problems:
                print(f"  {mode}: FAIL {problem}", flush=True)
            diverged = compare(names, got, refs)
            bad = [d for d in diverged if d["margin"] > args.max_margin]
            failed |= bool(problems or bad)
            rows.append((model, mode, len(names) - len(diverged), len(names), diverged,
                         closest))
            print(f"  {mode}: {len(names) - len(diverged)}/{len(names)} equal "
                  f"({seconds:.0f} s for the requests)", flush=True)
    print("\n| model | mode | prompts equal | divergences (prompt: first differing position, "
          "transformers' top-2 margin, served token's gap below transformers' top) | "
          "transformers' smallest top-2 margin (prompt, position) |")
    print("|---|---|---|---|---|")
    for model, mode, equal, total, diverged, closest in rows:
        text = "; ".join(
            f"{d['prompt']}: position {d['pos']}, margin {d['margin']:.3g}, gap "
            f"{'not in top 5' if d['gap'] is None else format(d['gap'], '.3g')} ({d['note']})"
            for d in diverged) or "none"
        print(f"| {model} | {mode} | {equal} / {total} | {text} | "
              f"{closest[0]:.3g} ({closest[1]}, {closest[2]}) |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
