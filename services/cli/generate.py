"""``pagedserve generate``: stream one completion from a running router to stdout (with
``--n`` > 1, print each choice whole once the request is done)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc

from services.common.config import add_flag
from services.common.tls import add_tls_flags, load_tls


def main(argv: list[str] | None = None) -> None:
    """Parse flags, stream the answer, print usage to stderr. Exits 1 on a gRPC error."""
    from pagedserve_client import Client

    p = argparse.ArgumentParser("pagedserve generate")
    add_flag(p, "--address", default="127.0.0.1:50051", help="router host:port")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="plain-text prompt")
    group.add_argument("--chat", help="one user message, rendered with the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--n", type=int, default=1, help="number of completions (choices)")
    p.add_argument("--priority", type=int, default=0,
                   help="lower runs sooner (needs --scheduling-policy priority on the server)")
    add_tls_flags(p)  # a router serving TLS: its CA (and, for mTLS, a client certificate)
    add_flag(p, "--api-key", default=None,
             help="sent as 'authorization: Bearer <key>' (a router started with --api-key)")
    a = p.parse_args(argv)
    sampling = {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p,
                "top_k": a.top_k, "seed": a.seed, "stop": a.stop or None, "n": a.n,
                "priority": a.priority}
    messages = [{"role": "user", "content": a.chat}] if a.chat is not None else None
    prompt = a.prompt if a.chat is None else None
    try:
        tls = load_tls(a.ssl_certfile, a.ssl_keyfile, a.ssl_ca_certs)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"pagedserve generate: {e}") from None
    tls_kwargs: dict[str, Any] = {} if tls is None else {
        "root_certificates": tls.root_certificates, "private_key": tls.private_key,
        "certificate_chain": tls.certificate_chain}
    # PAGEDSERVE_API_KEY may hold the router's comma-separated list: send the first key
    api_key = a.api_key.split(",")[0].strip() if a.api_key else None
    with Client(a.address, api_key=api_key, **tls_kwargs) as client:
        try:
            if sampling["seed"] is not None and sampling["seed"] < 0:
                raise ValueError(f"--seed must be >= 0, got {sampling['seed']}")
            if a.n > 1:
                for c in client.generate(prompt, messages=messages, **sampling).choices:
                    print(f"--- choice {c.index} ---\n{c.text}")
                    _print_usage(c.finish_reason, c.usage)
                return
            for d in client.stream(prompt, messages=messages, **sampling):
                sys.stdout.write(d.text)
                sys.stdout.flush()
                if d.finish_reason:
                    print()
                    _print_usage(d.finish_reason, d.usage)
        except grpc.RpcError as e:
            print(f"\npagedserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            raise SystemExit(1) from None
        except ValueError as e:
            print(f"pagedserve generate: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except KeyboardInterrupt:  # the stream is cancelled on the way out
            print(file=sys.stderr)
            raise SystemExit(130) from None


def _print_usage(finish_reason, usage) -> None:
    print(f"[finish_reason={finish_reason} prompt_tokens={usage.prompt_tokens} "
          f"completion_tokens={usage.completion_tokens} "
          f"cached_tokens={usage.num_cached_tokens}]", file=sys.stderr)
