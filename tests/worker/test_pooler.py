"""The pooling runner's parts: --pooler-config and --runner auto (pooler_config.py), and the
Pooler, whose vectors over a prompt's chunks equal pooling the whole prompt at once."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.common.step import StepInput
from services.worker.pooler import Pooler, make_pooler
from services.worker.pooler_config import PoolerConfig, checkpoint_pooler, resolve_runner


@pytest.mark.parametrize("text, words", [
    ("[1]", "JSON object"), ("{", "not valid JSON"), ('{"pooling": "LAST"}', "'pooling'"),
    ('{"pooling_type": "MAX"}', "pooling_type must be one of LAST, MEAN, CLS"),
    ('{"normalize": 1}', "normalize must be true or false")])
def test_bad_pooler_config_names_the_field(text, words):
    with pytest.raises(ValueError, match="--pooler-config") as err:
        PoolerConfig.parse(text)
    assert words in str(err.value)
    with pytest.raises(ValueError):  # refused at start whatever the runner
        make_pooler("generate", text, None)


def test_pooler_config_overrides_the_checkpoints_default():
    default = PoolerConfig("CLS", False)
    assert PoolerConfig.parse(None, default) == default
    assert PoolerConfig.parse('{"normalize": true}', default) == PoolerConfig("CLS", True)
    assert PoolerConfig.parse('{"pooling_type": "mean"}') == PoolerConfig("MEAN", True)


def test_runner_auto_reads_the_checkpoint(tmp_path):
    assert resolve_runner("auto", {"architectures": ["Qwen3Model"]}, tmp_path) == "pooling"
    assert resolve_runner("auto", {"architectures": ["Qwen3ForCausalLM"]}, tmp_path) == "generate"
    assert resolve_runner("pooling", {"architectures": ["LlamaForCausalLM"]}, tmp_path) == "pooling"
    with pytest.raises(ValueError, match="--runner"):
        resolve_runner("embed", {}, tmp_path)
    # Qwen3-Embedding: architectures still Qwen3ForCausalLM, a sentence-transformers layout
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert resolve_runner("auto", {"architectures": ["Qwen3ForCausalLM"]}, tmp_path) == "pooling"
    assert checkpoint_pooler(tmp_path) == PoolerConfig("MEAN", False)
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"type": "sentence_transformers.models.Transformer"},
         {"type": "sentence_transformers.models.Normalize"}]))
    assert checkpoint_pooler(tmp_path) == PoolerConfig("MEAN", True)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [True, False])
def test_chunks_pool_to_the_whole_prompts_vector(kind, normalize):
    """Two requests of 7 and 3 tokens, the first in chunks of 3, 2, 2 beside the second (and a
    restart from 0, as after a preemption): each vector is its whole prompt's pooled."""
    torch.manual_seed(0)
    h = {"a": torch.randn(7, 8), "b": torch.randn(3, 8)}
    pooler = Pooler(PoolerConfig(kind, normalize))
    steps = [[("a", 0, 3), ("b", 0, 3)], [("a", 0, 3)], [("a", 3, 2)], [("a", 5, 2)]]
    got = {}
    for i, chunks in enumerate(steps):
        hidden = torch.cat([h[r][c:c + n] for r, c, n in chunks])
        out = pooler.step_output(StepInput(i, [], [], []), hidden, [r for r, _, _ in chunks],
                                 np.array([c for _, c, _ in chunks]),
                                 np.array([n for _, _, n in chunks]),
                                 np.array([len(h[r]) for r, _, _ in chunks]), True)
        assert out.sampled_token_ids == []
        got.update(zip(out.request_ids, out.embeddings or [], strict=True))
    assert sorted(got) == ["a", "b"] and not pooler._partial
    for r, x in h.items():
        want = x[-1] if kind == "LAST" else x.mean(0) if kind == "MEAN" else x[0]
        if normalize:
            want = torch.nn.functional.normalize(want, dim=-1)
        np.testing.assert_allclose(got[r], want.numpy(), atol=1e-6)
