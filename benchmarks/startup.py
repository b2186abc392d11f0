"""Start-up to first token of ``pagedserve serve``: a first start (Inductor compiles the forward
into an empty cache), then a restart on that cache, then (optionally) ``--enforce-eager``.

    .venv/bin/python benchmarks/startup.py [--model M] [--dtype float32] [--skip-eager]

Each run starts the whole stack in fresh processes and times, from the moment ``serve`` is
launched: until the router answers gRPC health SERVING (the worker has finished its warm-up
steps, so the compile is inside), and until the first token of a one-token greedy request.
The Inductor cache of the first two runs is a new temporary folder (``TORCHINDUCTOR_CACHE_DIR``),
so the first start really compiles whatever the machine's own cache holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def one_start(model: str | None, dtype: str, extra: list[str]) -> dict[str, float]:
    """Seconds from launching ``serve`` to healthy and to the first token."""
    from pagedserve_client import AsyncClient
    from throughput import running_stack

    t0 = time.perf_counter()
    with running_stack(model, dtype, ["--http-port", "-1", "--metrics-port", "-1", *extra]
                       ) as address:
        healthy = time.perf_counter() - t0

        async def first_token() -> None:
            async with AsyncClient(address) as client:
                await client.generate(prompt_token_ids=[1, 2, 3, 4], max_tokens=1,
                                      temperature=0)
        asyncio.run(first_token())
        return {"healthy_s": healthy, "first_token_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="folder or .gguf (default: packaged SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--skip-eager", action="store_true", help="no --enforce-eager run")
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    runs = {}
    with tempfile.TemporaryDirectory(prefix="startup-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # inherited by serve's children
        for name in ("first start (compile)", "cached restart"):
            runs[name] = one_start(a.model, a.dtype, [])
            print(f"{name:24s}: healthy {runs[name]['healthy_s']:6.1f} s, first token "
                  f"{runs[name]['first_token_s']:6.1f} s", flush=True)
    if not a.skip_eager:
        runs["--enforce-eager"] = one_start(a.model, a.dtype, ["--enforce-eager"])
        print(f"{'--enforce-eager':24s}: healthy {runs['--enforce-eager']['healthy_s']:6.1f} s, "
              f"first token {runs['--enforce-eager']['first_token_s']:6.1f} s")
    if a.json:
        a.json.write_text(json.dumps({"dtype": a.dtype, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
