"""Process boundaries docs/architecture.md draws: the router, the scheduler and the SDK run
without torch, no tier imports the process layer (services/cli/), and the generated stubs
match the protos."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", ["services.scheduler.server", "services.router.server",
                                    "pagedserve_client"])
def test_module_does_not_import_torch(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_sdk_imports_nothing_of_services():
    """The SDK installs alone (its own pyproject): the router may import it, never the reverse."""
    code = ("import sys, pagedserve_client, pagedserve_client.structured_outputs\n"
            "bad = sorted(m for m in sys.modules if m == 'services' or m.startswith('services.'))\n"
            "assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_router_loads_cached_gguf_tokenizer_without_torch():
    from services.router.tokenizer import load_tokenizer

    load_tokenizer(None)  # make sure the conversion cache exists
    code = ("import sys\nfrom services.router.tokenizer import load_tokenizer, encode_chat\n"
            "tok = load_tokenizer(None)\n"
            "assert encode_chat(tok, [{'role': 'user', 'content': 'hi'}])\n"
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_generated_stubs_are_fresh(tmp_path):
    """The stubs on disk are what scripts/gen_protos.py makes from protos/ now."""
    from grpc_tools import protoc

    include = str(Path(protoc.__file__).parent / "_proto")
    protos = sorted(str(p) for p in (ROOT / "protos/pagedserve/v1").glob("*.proto"))
    assert protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{include}",
                        f"--python_out={tmp_path}", *protos]) == 0
    for proto in protos:
        name = Path(proto).stem + "_pb2.py"
        fresh = (tmp_path / "pagedserve/v1" / name).read_text()
        on_disk = (ROOT / "services/common/pb/pagedserve/v1" / name).read_text()
        fresh = fresh.replace("from pagedserve.v1 import",
                              "from services.common.pb.pagedserve.v1 import")
        assert fresh == on_disk, f"{name} is stale: run `make protos`"


# ---- the tiers never import the process layer (issue 33) -----------------------------------
TIERS = ("router", "scheduler", "worker", "common")  # the packages of services/ that serve


def _tier_imports_of_process_layer(graph) -> list[str]:
    """``tier module -> services.cli...`` for every edge of ``graph`` from a tier into the
    process layer (services/cli/: the command line, launchers, supervision)."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  if module.split(".")[:2] in [["services", t] for t in TIERS]
                  for target in targets
                  if target == "services.cli" or target.startswith("services.cli."))


def test_rule_sees_a_tier_importing_the_process_layer():
    graph = {"services.worker.server": {"services.cli.ranks", "services.common.config"},
             "services.cli.ranks": {"services.worker.server"},
             "services.common.x": {"services.cli"}}
    assert _tier_imports_of_process_layer(graph) == [
        "services.common.x -> services.cli", "services.worker.server -> services.cli.ranks"]


def test_no_tier_imports_the_process_layer():
    """The process layer starts the tiers (``python -m services.cli ...``) and may import them;
    never the reverse. Every import counts, function-local ones too."""
    from tests.test_import_cycles import import_graph

    graph = import_graph()
    assert {"services.cli", "services.cli.ranks", "services.worker.server"} <= set(graph)
    assert _tier_imports_of_process_layer(graph) == []
