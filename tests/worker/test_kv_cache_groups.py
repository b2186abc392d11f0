"""KV cache groups: the grouping rule (services/worker/kv_cache_groups.py), a rank's layout of
its layers over K/V tensor pairs, and a model runner whose model reports sliding windows: its
layers share pairs, the same memory holds more blocks, and with windows no shorter than the
sequences its logits equal the one-group run's (the model math applies no window yet)."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest, StepInput
from services.worker.config import WorkerConfig
from services.worker.kv_cache_groups import KVGroup, kv_cache_groups, local_kv_layout
from services.worker.model_runner import ModelRunner
from services.worker.models.llama import LlamaConfig

GEMMA3_270M = [0 if i in (5, 11, 17) else 512 for i in range(18)]


def as_pairs(groups: list[KVGroup]) -> list[tuple[int, list[int]]]:
    return [(g.sliding_window, list(g.layer_ids)) for g in groups]


def test_gemma3_270m_groups_three_layers_each_ordered_by_first_layer():
    assert as_pairs(kv_cache_groups(GEMMA3_270M)) == [
        (512, [0, 1, 2]), (512, [3, 4, 6]), (0, [5, 11, 17]), (512, [7, 8, 9]),
        (512, [10, 12, 13]), (512, [14, 15, 16])]


def test_one_attention_type_is_one_group_of_every_layer():
    assert as_pairs(kv_cache_groups([0] * 30)) == [(0, list(range(30)))]  # Llama
    assert as_pairs(kv_cache_groups([4096] * 32)) == [(4096, list(range(32)))]  # Mistral


def test_two_types_of_unequal_counts_cut_the_larger_leaving_a_short_last_chunk():
    # 2 full layers (1, 4), 5 sliding ones: G = 2, the sliding ones in chunks 2, 2, 1
    windows = [8, 0, 8, 8, 0, 8, 8]
    assert as_pairs(kv_cache_groups(windows)) == [
        (8, [0, 2]), (0, [1, 4]), (8, [3, 5]), (8, [6])]
    # three types: G = the rarest type's count (1)
    assert as_pairs(kv_cache_groups([4, 0, 4, 16])) == [(4, [0]), (0, [1]), (4, [2]), (16, [3])]


def test_every_layer_is_in_exactly_one_group_of_its_type():
    for windows in (GEMMA3_270M, [8, 0, 8, 8, 0, 8, 8], [0, 0, 3], [3, 3, 3, 0, 0, 5, 5, 5, 5]):
        groups = kv_cache_groups(windows)
        size = max(len(g.layer_ids) for g in groups)
        layers = sorted(i for g in groups for i in g.layer_ids)
        assert layers == list(range(len(windows)))
        assert all(windows[i] == g.sliding_window for g in groups for i in g.layer_ids)
        assert [g.layer_ids[0] for g in groups] == sorted(g.layer_ids[0] for g in groups)
        assert size == min(windows.count(w) for w in set(windows))


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="without layers"):
        kv_cache_groups([])
    with pytest.raises(ValueError, match=">= 0"):
        kv_cache_groups([0, -1])


def test_local_layout_shares_pairs_across_groups_and_a_stage_allocates_what_it_uses():
    groups = kv_cache_groups(GEMMA3_270M)
    whole = local_kv_layout(groups, range(18))
    assert whole.num_pairs == 3
    assert whole.layer_groups == (0, 0, 0, 1, 1, 2, 1, 3, 3, 3, 4, 2, 4, 4, 5, 5, 5, 2)
    assert whole.layer_pairs == (0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2)
    # the second of 2 pipeline stages (layers 9..17)
    stage = local_kv_layout(groups, range(9, 18))
    assert stage.layer_groups == whole.layer_groups[9:] and stage.num_pairs == 3
    # one full group (Llama) split over 2 stages: each stage one pair per layer it holds
    llama = kv_cache_groups([0] * 4)
    assert local_kv_layout(llama, range(2, 4)) == local_kv_layout(llama, range(2))
    assert local_kv_layout(llama, range(2, 4)).layer_pairs == (0, 1)
    assert local_kv_layout(llama, range(2, 4)).num_pairs == 2
    # a stage of layers 0..1 of [W, W, 0, 0, W, W, 0, 0] (G = 4) uses positions 0 and 1 only
    mixed = kv_cache_groups([8, 8, 0, 0, 8, 8, 0, 0])
    assert local_kv_layout(mixed, range(2)).num_pairs == 2
    assert local_kv_layout(mixed, range(4, 8)).layer_pairs == (0, 1, 0, 1)


# ---- the model runner -------------------------------------------------------------------------

GREEDY = EngineSamplingParams(temperature=0.0)
WINDOWS = [4096, 0, 4096, 0]  # (windows longer than any sequence here: the same math as full)


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory):
    from tests.helpers import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4"), num_hidden_layers=4)


def _steps(blocks) -> list[StepInput]:
    """A prefill of a long prompt in two chunks beside a short one, decodes (one crossing into
    a new block), a resume. ``blocks(request, logical blocks)`` gives the wire's block ids."""
    toks = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((40, 5))]
    return [
        StepInput(0, [NewRequest("long", toks[0], GREEDY, blocks("long", range(2)), 0, 24),
                      NewRequest("short", toks[1], GREEDY, blocks("short", range(1)), 0, 5)],
                  [], []),
        StepInput(1, [], [CachedRequest("long", [], blocks("long", range(2, 3)), False, 24, 16),
                          CachedRequest("short", [], [], False, 5, 1)], []),
        *(StepInput(2 + i, [], [CachedRequest("long", [], [], False, 40 + i, 1),
                                CachedRequest("short", [], [], False, 6 + i, 1)], [])
          for i in range(8)),
        StepInput(10, [], [CachedRequest("long", [], blocks("long", range(3, 4)), False, 48, 1),
                           CachedRequest("short", [], [], False, 14, 1)], []),
        StepInput(11, [], [CachedRequest("short", toks[1] + [7] * 8, blocks("short", range(1)),
                                         True, 0, 13)], []),  # (resumed: tokens may differ)
    ]


def _run(runner: ModelRunner, steps: list[StepInput]) -> tuple[list, list[torch.Tensor]]:
    """Every step's output, and the logits it sampled from."""
    seen = []
    compute = runner._compute_logits

    def recording(hidden):
        logits = compute(hidden)
        seen.append(logits)
        return logits

    runner._compute_logits = recording  # type: ignore[method-assign]
    outs = [runner.execute_step(s) for s in steps]
    return [(o.request_ids, o.sampled_token_ids) for o in outs], seen


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_runner_with_sliding_groups_shares_pairs_and_matches_the_one_group_run(
        tiny_llama4, monkeypatch, backend):
    def make():
        return ModelRunner(WorkerConfig(model=str(tiny_llama4), dtype="float32", device="cpu",
                                        kv_cache_memory=1 << 20, attention_backend=backend,
                                        enforce_eager=True))

    plain = make()
    assert as_pairs(plain.kv_cache_groups) == [(0, [0, 1, 2, 3])]
    assert plain.num_kv_pairs == 4 and plain.input_batch.num_groups == 1
    monkeypatch.setattr(LlamaConfig, "sliding_windows", property(lambda self: list(WINDOWS)))
    grouped = make()
    assert as_pairs(grouped.kv_cache_groups) == [(4096, [0, 2]), (0, [1, 3])]
    assert grouped.num_kv_pairs == 2 and grouped.input_batch.num_groups == 2
    # K and V x 2 pairs x 16 tokens x 2 kv heads x 16 dims x 4 bytes: half of 4 layers' pairs
    assert grouped.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4 == plain.bytes_per_block // 2
    assert grouped.num_kv_blocks == (1 << 20) // grouped.bytes_per_block
    assert grouped.num_kv_blocks == 2 * plain.num_kv_blocks
    caches = grouped.kv_caches
    assert len(caches) == 4 and caches[0] is caches[1] and caches[2] is caches[3]
    assert caches[0][0] is not caches[2][0] and caches[0][0] is not caches[0][1]
    assert caches[0][0].shape == (grouped.num_kv_blocks, 16, 2, 16)

    # the same logical blocks; each group its own physical ones (they share the pairs)
    first = {"long": 0, "short": 10}
    plain_out, plain_logits = _run(plain, _steps(
        lambda r, js: [first[r] + j for j in js]))
    grouped_out, grouped_logits = _run(grouped, _steps(
        lambda r, js: [first[r] + j + 50 * g for g in range(2) for j in js]))
    assert grouped_out == plain_out
    assert sum(len(ids) for ids, _ in plain_out) == 1 + 2 * 10 + 1
    assert len(grouped_logits) == len(plain_logits)
    for got, want in zip(grouped_logits, plain_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_model_config_must_give_one_window_per_layer(tiny_llama4, monkeypatch):
    monkeypatch.setattr(LlamaConfig, "sliding_windows", property(lambda self: [0] * 5))
    with pytest.raises(ValueError, match="5 sliding windows for 4 layers"):
        ModelRunner(WorkerConfig(model=str(tiny_llama4), dtype="float32", device="cpu",
                                 kv_cache_memory=1 << 20, attention_backend="torch"))


def test_a_pipeline_stage_plans_the_pairs_of_its_own_layers():
    """The runner's planning under PP=2 (the second stage: layers 9..17 of Gemma 3 270M's
    layout, 2..3 of a 4-layer Llama), on stand-ins for the loaded model and the rank group."""
    from types import SimpleNamespace

    from services.worker.parallel.distributed import ParallelConfig

    def plan(windows, stage_layers):
        runner = SimpleNamespace(
            model=SimpleNamespace(config=SimpleNamespace(num_hidden_layers=len(windows))),
            parallel=SimpleNamespace(config=ParallelConfig(1, 2, 1)), num_layers=stage_layers)
        ModelRunner._plan_kv_cache_groups(runner, windows)  # type: ignore[arg-type]
        return runner

    gemma = plan(GEMMA3_270M, 9)
    assert len(gemma.kv_cache_groups) == 6 and gemma.num_kv_pairs == 3
    assert gemma.layer_groups == (3, 4, 2, 4, 4, 5, 5, 5, 2)  # layers 9..17
    assert gemma._layer_pairs == (2, 0, 1, 1, 2, 0, 1, 2, 2)
    llama = plan([0] * 4, 2)
    assert llama.layer_groups == (0, 0) and llama._layer_pairs == (0, 1)
    assert llama.num_kv_pairs == 2
