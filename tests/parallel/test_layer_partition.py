"""``--pipeline-layer-partition``: uneven pipeline splits give the greedy tokens of the even
one, each rank's memory metrics follow its share of the layers, and a partition that does not
sum to the model's layers is refused at start, naming both numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from services.common.ports import free_port_range
from services.worker.parallel.distributed import ParallelConfig
from services.worker.parallel.layer_partition import parse_partition
from tests.helpers import make_servable_tiny_llama
from tests.parallel.conftest import PROMPTS, ParallelStack, reference_greedy, stack_greedy

MAX_TOKENS = 4
LAYERS = 5  # even split over 2 stages: 3,2


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory) -> str:
    return make_servable_tiny_llama(Path(tmp_path_factory.mktemp("tiny-5")),
                                    num_hidden_layers=LAYERS)


def _rank_memory(metrics_port: int, world: int) -> list[dict[str, float]]:
    """Per rank, its ``pagedserve:worker_*_bytes`` gauges."""
    out = []
    for r in range(world):
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + r}/metrics",
                                      timeout=5).read().decode()
        out.append({line.split("{")[0].removeprefix("pagedserve:worker_"): float(line.split()[-1])
                    for line in text.splitlines()
                    if line.startswith("pagedserve:worker_") and "_bytes{" in line})
    return out


def _layer_bytes(model: str) -> int:
    """float32 bytes of one decoder layer of ``model``."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model)
    return sum(p.numel() * 4 for p in m.model.layers[0].parameters())


@pytest.mark.slow  # three PP=2 stacks
def test_uneven_splits_give_the_even_split_tokens(five_layers):
    expected = reference_greedy(five_layers, PROMPTS, MAX_TOKENS)  # one rank: all 5 layers
    layer_bytes = _layer_bytes(five_layers)
    small = ["--max-num-batched-tokens", "256"]  # (a quicker memory-measuring step)
    memory = {}
    for split in ("1,4", "4,1", "2,3"):  # the even split, 3,2, is test_pipeline_parallel's
        metrics = free_port_range(2)
        stack = ParallelStack(five_layers, pp=2, scheduler_argv=small, worker_argv=[
            *small, "--metrics-port", str(metrics), "--pipeline-layer-partition", split]).start()
        try:
            assert stack_greedy(stack, PROMPTS, MAX_TOKENS) == expected, split
            memory[split] = _rank_memory(metrics, 2)
        finally:
            stack.stop()
    for a, b in (("1,4", "4,1"), ("1,4", "2,3"), ("4,1", "2,3")):
        for stage in (0, 1):  # the same embedding / norm / LM head; layers make the difference
            more = parse_partition(a)[stage] - parse_partition(b)[stage]
            assert (memory[a][stage]["weights_bytes"] - memory[b][stage]["weights_bytes"]
                    == more * layer_bytes), (a, b, stage)
    for ranks in memory.values():
        assert all(r["kv_cache_bytes"] > 0 and r["peak_activation_bytes"] > 0 for r in ranks)


@pytest.mark.slow  # two rank processes
def test_a_partition_that_does_not_sum_to_the_layers_is_refused_at_start(five_layers):
    port = free_port_range(2)
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", "worker", "--model", five_layers, "--dtype",
         "float32", "--kv-cache-memory", "16MiB", "--pipeline-parallel-size", "2",
         "--pipeline-layer-partition", "2,2", "--port", str(port), "--metrics-port", "-1"],
        capture_output=True, text=True, timeout=120, env={**os.environ})
    assert p.returncode == 1
    assert "--pipeline-layer-partition 2,2 sums to 4 layers but the model has 5" in p.stderr


def test_partition_checks_name_the_numbers():
    assert [list(ParallelConfig(1, 2, r, (1, 4)).layer_range(5)) for r in (0, 1)] == [
        [0], [1, 2, 3, 4]]
    assert [list(ParallelConfig(1, 2, r).layer_range(5)) for r in (0, 1)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="has 3 stages but --pipeline-parallel-size is 2"):
        ParallelConfig(1, 2, 0, (1, 1, 3))
    with pytest.raises(ValueError, match="every stage needs at least 1 layer"):
        parse_partition("0,5")
    with pytest.raises(ValueError, match="comma-separated layer counts"):
        parse_partition("3;2")
    assert parse_partition("") is None


def test_a_single_cpu_rank_reports_weights_and_kv_cache_without_a_dummy_step():
    from prometheus_client import generate_latest

    from services.worker.memory_report import MemoryReport
    from services.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics(rank=3)
    metrics.set_memory(MemoryReport(1000, 2000, None))
    text = generate_latest(metrics.registry).decode()
    assert 'pagedserve:worker_weights_bytes{rank="3"} 1000.0' in text
    assert 'pagedserve:worker_kv_cache_bytes{rank="3"} 2000.0' in text
    assert "peak_activation_bytes{" not in text  # not measured: not exported as 0
    assert MemoryReport(1000, 2000, None).describe().endswith("peak activations not measured")
