"""Fuzz the router's HTTP API against its own ``GET /openapi.json`` with schemathesis: for every
operation, cases generated from the document (valid bodies, and invalid ones: a wrong type, a
value out of a documented range, a required field missing), each sent to a live router and its
answer checked: no 5xx, the status, media type and body as the document says, invalid data
refused with a 4xx. tests/stack/test_openapi_schemathesis.py runs it with a few hundred cases;
run it here with many more:

    python -m benchmarks.openapi_fuzz --cases 200          # per operation and mode

It starts the tiny random-weight stack (``InProcessStack``, max_model_len 128, the hermes tool
template, the Responses store, runtime LoRA loading) unless ``--url`` names a running router,
and prints the cases sent, the 5xx answers and the check failures (each with a curl command
that reproduces it). Exit status 1 when any.

Generation is bounded: a body that sets no token limit gets a small one (``MAX_NEW``), so a
valid case costs a few decode steps, not the whole context.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import requests

MAX_NEW = 4  # tokens a generated body without a limit is given
# The field that limits new tokens, per route (added when the generated body has none).
_LIMITS = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens",
           "/v1/responses": "max_output_tokens"}
TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "tool_chat_template_hermes.jinja"


@dataclass
class Report:
    """What a run found.

    Attributes:
        cases: requests sent.
        statuses: status -> count.
        server_errors: (operation, status, curl) of each 5xx.
        violations: (operation, check failure text) of each failed check.
        seconds: wall time.
    """

    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[tuple[str, int, str]] = field(default_factory=list)
    violations: list[tuple[str, str]] = field(default_factory=list)
    per_operation: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def summary(self) -> str:
        """Cases, 5xx, violations and the statuses seen, one line each."""
        return (f"cases: {self.cases} in {self.seconds:.1f} s "
                f"({dict(sorted(self.per_operation.items()))})\n"
                f"5xx: {len(self.server_errors)}\nviolations: {len(self.violations)}\n"
                f"statuses: {dict(sorted(self.statuses.items()))}")


def _bounded(case):
    """A case whose body sets no token limit, given ``MAX_NEW``; a valid body's random
    ``model`` name dropped (it would stop every such case at the 404 of an unknown model)."""
    if (isinstance(case.body, dict) and isinstance(case.body.get("model"), str)
            and case.meta is not None and case.meta.generation.mode.is_positive):
        case.body = {k: v for k, v in case.body.items() if k != "model"}
    name = _LIMITS.get(case.operation.path)
    if name and isinstance(case.body, dict) and not any(
            k in case.body for k in ("max_tokens", "max_completion_tokens",
                                     "max_output_tokens")):
        case.body = {**case.body, name: MAX_NEW}
    return case


def fuzz(base_url: str, cases: int = 20, seed: int = 0, timeout: float = 60.0,
         deadline: float | None = None) -> Report:
    """Fuzz every operation of ``base_url``'s ``/openapi.json``, ``cases`` examples per
    operation and generation mode (positive, negative; an operation with nothing to vary
    gets fewer).

    Args:
        seed: hypothesis' seed (the same seed generates the same cases).
        timeout: seconds one request may take (a slower answer is a violation).
        deadline: stop generating once this many seconds have passed (None: no limit).

    Raises:
        requests.RequestException: the document cannot be fetched.
    """
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import Failure, FailureGroup
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_headers_conformance, response_schema_conformance,
              negative_data_rejection]
    document = requests.get(f"{base_url}/openapi.json", timeout=timeout).json()
    schema = schemathesis.openapi.from_dict(document)
    report = Report()
    start = time.monotonic()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        # (negative cases of an operation without a body: nothing to break, its only
        # parameter, a stored response's id, being any string)
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE]
                                             if list(operation.body) else [])
        for mode in modes:
            if deadline is not None and time.monotonic() - start > deadline:
                break

            @given(operation.as_strategy(generation_mode=mode).map(_bounded))
            @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @hypothesis.seed(seed)
            def one(case) -> None:
                label = case.operation.label
                response = case.call(base_url=base_url, session=session, timeout=timeout)
                report.cases += 1
                report.per_operation[label] += 1
                report.statuses[response.status_code] += 1
                if response.status_code >= 500:
                    report.server_errors.append((label, response.status_code,
                                                 case.as_curl_command(base_url=base_url)))
                try:
                    case.validate_response(response, checks=checks)
                except (Failure, FailureGroup) as e:
                    report.violations.append((label, str(e)[:3000]))

            one()
    report.seconds = time.monotonic() - start
    return report


def fuzz_stack(model: str):
    """The stack the fuzzer runs against, started: ``model`` (a tiny model folder) with
    max_model_len 128, the hermes tool template and parser, the Responses store and runtime
    LoRA loading, so every route serves."""
    from benchmarks.stack_harness import InProcessStack

    return InProcessStack(
        model, worker_argv=["--dtype", "float32", "--kv-cache-memory", "64MiB",
                            "--enforce-eager", "--max-model-len", "128", "--enable-lora",
                            "--max-loras", "2", "--max-lora-rank", "16"],
        scheduler_argv=["--max-num-batched-tokens", "256", "--max-loras", "2"],
        router_argv=["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes", "--enable-responses-api-store",
                     "--enable-lora", "--allow-runtime-lora-updating"]).start()


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status (1: a 5xx or a violation)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=200,
                   help="examples per operation and generation mode (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="a running router's HTTP base URL (default: "
                   "start the tiny stack)")
    p.add_argument("--show", type=int, default=5, help="failures printed in full")
    args = p.parse_args(argv)
    import os

    os.environ.setdefault("PAGEDSERVE_CHECK_RESPONSES", "1")  # (the in-process router's)
    with tempfile.TemporaryDirectory() as folder:
        if args.url is None:
            from benchmarks.tiny_models import make_servable_tiny_llama

            stack = fuzz_stack(make_servable_tiny_llama(Path(folder) / "tiny"))
        else:
            stack = None
        try:
            report = fuzz(args.url or stack.http_url, args.cases, args.seed)
            print(report.summary())
        finally:
            if stack is not None:
                stack.stop()
    for label, status, curl in report.server_errors[:args.show]:
        print(f"\n{status} from {label}:\n{curl}")
    for label, text in report.violations[:args.show]:
        print(f"\nviolation in {label}:\n{text}")
    return 1 if report.server_errors or report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
