"""Configs as types (issue 53): each setting's default written once, in its config dataclass,
read by its flag; rules between flags checked once, naming both flags; no flag read through a
``getattr(args, name, default)`` fallback that could restate (or contradict) its default."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import field_default
from services.common.spec_decode_config import SpeculativeConfig
from services.worker import server as worker_server
from services.worker.config import WorkerConfig
from services.worker.lora import LoRAConfig

ROOT = Path(__file__).resolve().parents[1]
# getattr on a parsed-flags namespace: getattr(args, ...), getattr(ns, ...), getattr(self.args, ...)
_FALLBACK = re.compile(r"getattr\(\s*(?:self\.)?(?:args|ns)\s*,")

# WorkerConfig fields that no one flag sets, and why.
_NO_FLAG = {
    "speculative": "parsed from --speculative-config (the flag keeps the text, to forward it)",
    "lora": "built from --enable-lora, --max-loras, --max-lora-rank and --max-cpu-loras",
}


def test_no_flag_is_read_through_a_getattr_fallback():
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in sorted((ROOT / "services").rglob("*.py"))
            if "/pb/" not in path.as_posix()
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if _FALLBACK.search(line)]
    assert not hits, "read the flag directly (every caller passes a complete namespace):\n" + (
        "\n".join(hits))


def _worker_flags(monkeypatch, *argv: str) -> argparse.Namespace:
    import os
    for name in list(os.environ):
        if name.startswith("PAGEDSERVE_") or name == "VLLM_PP_LAYER_PARTITION":
            monkeypatch.delenv(name)
    p = argparse.ArgumentParser()
    worker_server.add_args(p)
    return p.parse_args(list(argv))


def test_worker_config_defaults_are_the_flags_defaults(monkeypatch):
    ns = _worker_flags(monkeypatch)
    config = WorkerConfig.from_args(ns)
    assert config == WorkerConfig()
    for f in dataclasses.fields(WorkerConfig):
        default = field_default(WorkerConfig, f.name)
        if f.name in _NO_FLAG:
            assert default is None and getattr(config, f.name) is None, f.name
            continue
        assert vars(ns)[f.name] == default, f"--{f.name.replace('_', '-')}"
        assert getattr(config, f.name) == default, f.name
    assert ns.runner == config.runner == "auto"  # (the flag's real default)
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):  # LoRAConfig's, likewise
        assert vars(ns)[name] == field_default(LoRAConfig, name)


def test_worker_config_from_flags():
    ns = _flags_of(["--model", "m", "--block-size", "32", "--kv-cache-memory", "1GiB",
                    "--speculative-config", '{"num_speculative_tokens": 3}', "--enable-lora",
                    "--max-loras", "2", "--runner", "generate", "--tensor-parallel-size", "2"])
    config = WorkerConfig.from_args(ns)
    assert (config.model, config.block_size, config.kv_cache_memory) == ("m", 32, 1 << 30)
    assert config.speculative == SpeculativeConfig("ngram", 3)
    assert config.lora == LoRAConfig(max_loras=2)
    assert (config.runner, config.num_ranks) == ("generate", 2)


def _flags_of(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    worker_server.add_args(p)
    return p.parse_args(argv)


@pytest.mark.parametrize(("kwargs", "flags"), [
    ({"speculative": SpeculativeConfig("ngram", 2), "pipeline_parallel_size": 2},
     ("--speculative-config", "--pipeline-parallel-size 2")),
    ({"world_size": 3, "tensor_parallel_size": 2},
     ("--world-size 3", "--tensor-parallel-size 2", "--pipeline-parallel-size 1")),
    ({"pipeline_layer_partition": "10,20,30", "pipeline_parallel_size": 2},
     ("--pipeline-layer-partition 10,20,30", "--pipeline-parallel-size is 2")),
])
def test_cross_flag_errors_name_both_flags(kwargs, flags):
    with pytest.raises(ValueError) as e:
        WorkerConfig(**kwargs)
    for flag in flags:
        assert flag in str(e.value)


def test_the_flags_that_disagree_are_refused_from_the_command_line():
    ns = _flags_of(["--speculative-config", '{"num_speculative_tokens": 2}',
                    "--pipeline-parallel-size", "2"])
    with pytest.raises(ValueError, match="--speculative-config does not work with "
                                         "--pipeline-parallel-size 2"):
        worker_server.world_size(ns)
    assert worker_server.world_size(_flags_of(["--pipeline-parallel-size", "2",
                                               "--tensor-parallel-size", "3"])) == 6


def test_worker_config_imports_no_torch():
    code = ("import sys, services.worker.config\n"
            "assert 'torch' not in sys.modules, 'services.worker.config imported torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
