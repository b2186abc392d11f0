"""The pooling runner's configuration, torch-free (the worker's flags are parsed before torch
is imported): ``--runner`` (``resolve_runner``: ``auto`` reads the checkpoint) and
``--pooler-config`` (``PoolerConfig``; ``checkpoint_pooler``: the checkpoint's default).
``services/worker/pooler.py`` does the pooling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.config import json_flag_object

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' 1_Pooling/config.json switches -> our pooling type (first set wins)
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_cls_token", "CLS"))


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a pooling runner turns a prompt's hidden states into one vector (vLLM's
    ``--pooler-config`` fields): ``pooling_type`` LAST (the last prompt token's state), MEAN
    (the mean over all prompt tokens) or CLS (the first token's); ``normalize``: divide by the
    L2 norm (float32)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, text: str | None, default: PoolerConfig | None = None) -> PoolerConfig:
        """``--pooler-config``'s JSON object; its fields override ``default`` (else ours).

        Raises:
            ValueError: not a JSON object, an unknown field, or a bad value, naming it.
        """
        base = default or cls()
        if not text:
            return base
        obj = json_flag_object(text, "--pooler-config", ("pooling_type", "normalize"),
                               '{"pooling_type": "LAST", "normalize": true}')
        kind = obj.get("pooling_type", base.pooling_type)
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {kind!r}")
        normalize = obj.get("normalize", base.normalize)
        if not isinstance(normalize, bool):
            raise ValueError(f"--pooler-config: normalize must be true or false, got "
                             f"{normalize!r}")
        return cls(kind.upper(), normalize)


def is_embedding_checkpoint(config: dict, folder: Path) -> bool:
    """Whether ``folder`` holds an embedding model: a sentence-transformers layout
    (``modules.json`` or ``1_Pooling/config.json``), or config.json ``architectures`` naming
    only bare models (``...Model``: no LM head)."""
    if (folder / "modules.json").is_file() or (folder / "1_Pooling" / "config.json").is_file():
        return True
    archs = config.get("architectures") or []
    return bool(archs) and all(a.endswith("Model") for a in archs)


def resolve_runner(runner: str, config: dict, folder: Path) -> str:
    """``--runner`` resolved: ``auto`` is ``pooling`` for an embedding checkpoint
    (``is_embedding_checkpoint``), else ``generate``.

    Raises:
        ValueError: a runner not in ``RUNNERS``.
    """
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner != "auto":
        return runner
    return "pooling" if is_embedding_checkpoint(config, folder) else "generate"


def checkpoint_pooler(folder: Path) -> PoolerConfig:
    """The pooling a sentence-transformers checkpoint declares (``1_Pooling/config.json``'s
    mode, normalized when ``modules.json`` lists a ``Normalize`` module); LAST + normalize
    (Qwen3-Embedding's) where it declares none."""
    pooling = folder / "1_Pooling" / "config.json"
    modules = folder / "modules.json"
    if not pooling.is_file():
        return PoolerConfig()
    st = json.loads(pooling.read_text())
    kind = next((k for key, k in _ST_MODES if st.get(key)), "LAST")
    normalize = modules.is_file() and any(
        "Normalize" in str(m.get("type", "")) for m in json.loads(modules.read_text()))
    return PoolerConfig(kind, normalize)
