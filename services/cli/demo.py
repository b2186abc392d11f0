"""The ``make run`` demo: several prompts sent at once, the first streamed live.

Under ``serve --demo`` the services' logs go to a file (``open_service_log``), not to the
terminal, so the answers print clean; the file's path is printed once, at start.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import IO

from services.common.model_files import cache_root

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain what a KV cache is in one sentence.",
]


async def _one(client, i: int, prompt: str, live: bool) -> tuple[int, str, float, float, int]:
    t0 = time.perf_counter()
    ttft, parts, n = None, [], 0
    async for d in client.stream(messages=[{"role": "user", "content": prompt}],
                                 max_tokens=96, temperature=0):
        if ttft is None and d.token_ids:
            ttft = time.perf_counter() - t0
        n += len(d.token_ids)
        parts.append(d.text)
        if live:
            sys.stdout.write(d.text)
            sys.stdout.flush()
    if live:
        print()
    return i, "".join(parts), ttft or 0.0, time.perf_counter() - t0, n


async def _demo(address: str, **client_kwargs) -> None:
    from pagedserve_client import AsyncClient
    async with AsyncClient(address, **client_kwargs) as client:
        print(f"\n>>> {len(PROMPTS)} prompts sent at once; streaming the first live:\n"
              f"[0] {PROMPTS[0]}\n", flush=True)
        results = await asyncio.gather(*(_one(client, i, p, i == 0)
                                         for i, p in enumerate(PROMPTS)))
        for i, text, *_ in results:
            if i:
                print(f"\n[{i}] {PROMPTS[i]}\n{text.strip()}")
        print()
        for i, _text, ttft, total, n in results:
            print(f"[{i}] {n} tokens, TTFT {ttft * 1000:.0f} ms, {n / total:.1f} tok/s")
        print(flush=True)


def open_service_log() -> IO[bytes]:
    """Open a new log file for the services that ``serve --demo`` starts (their stderr) and
    say where it is on serve's stderr: ``$PAGEDSERVE_CACHE_DIR/logs/serve-TIME-PID.log``
    (default cache ``~/.cache/pagedserve``). The caller passes it as each child's stderr.

    Raises:
        OSError: the folder or file cannot be created.
    """
    folder = cache_root() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    log = open(path, "ab")  # noqa: SIM115 -- the children write it for serve's whole life
    print(f"pagedserve: --demo: the services' logs go to {path}", file=sys.stderr, flush=True)
    return log


def run_demo(address: str, **client_kwargs) -> None:
    """Send the demo prompts to the router at ``address`` and print the answers
    (``client_kwargs``: ``AsyncClient``'s TLS and ``api_key`` arguments)."""
    asyncio.run(_demo(address, **client_kwargs))
