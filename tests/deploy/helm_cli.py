"""``helm lint --strict`` and ``helm template`` through the helm-python-sdk package (PyPI
``helm-python-sdk``), which binds Helm's Go SDK (``libhelm_c.so`` inside the wheel) with ctypes:
no ``helm`` binary and no download at run time.

    python -m tests.deploy.helm_cli lint CHART [-f VALUES]...          # strict: warnings fail
    python -m tests.deploy.helm_cli template NAME CHART [-f VALUES]... [--namespace NS] \
        [--output-dir DIR]

Exit status 0 on success, 1 when lint reports a finding or rendering fails (message on stderr),
as the helm CLI. ``template`` prints the manifests as one multi-document YAML stream (``---``
separated, with ``# Source:`` comments) or writes one file per template under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

SEVERITY = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}


def _merge(dst: dict, src: dict) -> dict:
    """Deep-merge ``src`` into ``dst`` (later -f files win, as helm's)."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = value
    return dst


def load_values(files: list[str]) -> dict:
    values: dict = {}
    for f in files:
        _merge(values, yaml.safe_load(Path(f).read_text()) or {})
    return values


def lint(chart: str, values: dict, strict: bool = True) -> int:
    import helm_python as helm

    report = helm.lint(chart, values or None, strict=strict)
    findings = [m for m in report["messages"] if m["severity"] >= (2 if strict else 3)]
    for m in report["messages"]:
        print(f"[{SEVERITY.get(m['severity'], m['severity'])}] {m['path']}: {m['error'].strip()}",
              file=sys.stderr if m in findings else sys.stdout)
    for e in report["errors"]:
        if not any(e.strip() == m["error"].strip() for m in report["messages"]):
            print(f"[ERROR] {e.strip()}", file=sys.stderr)
    failed = bool(findings or report["errors"])
    print(f"1 chart(s) linted, {'1 chart(s) failed' if failed else '0 chart(s) failed'}",
          file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


def template(name: str, chart: str, values: dict, namespace: str) -> dict[str, str]:
    """Render like ``helm template``: {template path: manifest}, NOTES.txt and empty ones left
    out."""
    import helm_python as helm

    with helm.Chart.load(chart) as c:
        out = c.render(values or None, name=name, namespace=namespace, is_install=True)
    return {path: text for path, text in sorted(out.items())
            if not path.endswith("NOTES.txt") and yaml.safe_load_all(text) and
            any(doc for doc in yaml.safe_load_all(text))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("helm_cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("lint")
    pl.add_argument("chart")
    pl.add_argument("-f", "--values", action="append", default=[])
    pl.add_argument("--no-strict", action="store_true")
    pt = sub.add_parser("template")
    pt.add_argument("name")
    pt.add_argument("chart")
    pt.add_argument("-f", "--values", action="append", default=[])
    pt.add_argument("--namespace", default="default")
    pt.add_argument("--output-dir")
    args = p.parse_args(argv)
    values = load_values(args.values)
    if args.cmd == "lint":
        return lint(args.chart, values, strict=not args.no_strict)
    import helm_python as helm
    try:
        manifests = template(args.name, args.chart, values, args.namespace)
    except helm.HelmError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    if args.output_dir:
        for path, text in manifests.items():
            target = Path(args.output_dir) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(f"wrote {target}")
    else:
        for path, text in manifests.items():
            print(f"---\n# Source: {path}\n{text.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
