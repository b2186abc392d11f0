"""``--speculative-config``: speculative decoding's settings, as vLLM spells them (no torch).

Both the scheduler and the worker take the flag (``pagedserve serve`` passes it to both); the
scheduler sends its normalised form (``to_json``) in GetWorkerInfoRequest and a rank with
another refuses it. JSON object fields (vLLM's ``SpeculativeConfig`` names):

- ``method``: ``"ngram"`` (prompt lookup) or ``"draft_model"``; default ``"draft_model"`` when
  ``model`` is given, else ``"ngram"``.
- ``num_speculative_tokens`` (required): draft tokens per step, k in 1..16.
- ``prompt_lookup_max`` / ``prompt_lookup_min`` (ngram): the longest / shortest context suffix
  looked up, 1..64; one given sets the other, none gives 5 and 5 (vLLM's defaults).
- ``model`` (draft_model): the draft's transformers folder or ``.gguf`` file; it must share
  the target's vocabulary.
- ``disable_by_batch_size``: no drafts in a step when this many requests or more are running
  (the verify cost of k extra tokens per row then exceeds what acceptance saves); default
  ``DEFAULT_DISABLE_BY_BATCH_SIZE``, measured in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from services.common.config import json_flag_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # see docs/benchmarks.md "Issue 21"
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
           "model", "disable_by_batch_size")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings (see the module docstring).

    Attributes:
        method: "ngram" or "draft_model".
        num_speculative_tokens: k, draft tokens proposed per request per step.
        prompt_lookup_max / prompt_lookup_min: ngram suffix lengths (tokens).
        model: the draft model (draft_model only), else "".
        disable_by_batch_size: running requests at which a step carries no drafts.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    model: str = ""
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots the scheduler allocates past a step's tokens: a draft model writes its own
        K/V for the k - 1 drafts it feeds itself (and the last accepted token) there, in the
        request's blocks (ngram needs none)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def to_json(self) -> str:
        """The normalised JSON form (every field, sorted keys); ``parse`` reads it back."""
        return json.dumps(asdict(self), sort_keys=True)

    def as_flag_value(self) -> str:
        """The flag's value that gives this config (``pagedserve serve`` forwards it)."""
        return self.to_json()

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """``--speculative-config``'s value -> a config, or None for none (None or "").

        Raises:
            ValueError: not a JSON object, an unknown field or method, a value out of its
                range (naming the field and the range), ``model`` missing for draft_model or
                given for ngram, or prompt_lookup_min > prompt_lookup_max.
        """
        if text is None or not text.strip():
            return None
        raw = json_flag_object(text, "--speculative-config", _FIELDS,
                               '{"method": "ngram", "num_speculative_tokens": 4}')
        model = raw.get("model") or ""
        if not isinstance(model, str):
            raise ValueError("--speculative-config: model must be a path (string)")
        method = raw.get("method") or ("draft_model" if model else "ngram")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(METHODS)}, "
                             f"got {method!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config: num_speculative_tokens is required")

        def integer(name: str, lo: int, hi: int | None, default: int | None) -> int:
            value = raw.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
                    hi is not None and value > hi):
                limit = f"{lo}..{hi}" if hi is not None else f">= {lo}"
                raise ValueError(f"--speculative-config: {name} must be an integer {limit}, "
                                 f"got {value!r}")
            return value

        k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, None)
        hi, lo = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        hi = integer("prompt_lookup_max", 1, 64, lo if hi is None else hi) if (
            hi is not None or lo is not None) else 5
        lo = integer("prompt_lookup_min", 1, 64, hi)
        if lo > hi:
            raise ValueError(f"--speculative-config: prompt_lookup_min {lo} is more than "
                             f"prompt_lookup_max {hi}")
        disable = integer("disable_by_batch_size", 1, None, DEFAULT_DISABLE_BY_BATCH_SIZE)
        if method == "draft_model" and not model:
            raise ValueError("--speculative-config: method draft_model needs model (the "
                             "draft's folder or .gguf file)")
        if method == "ngram" and model:
            raise ValueError("--speculative-config: method ngram takes no model")
        return cls(method, k, hi, lo, model, disable)


def speculative_config_arg(text: str) -> SpeculativeConfig | None:
    """argparse ``type=`` for ``--speculative-config`` (``PAGEDSERVE_SPECULATIVE_CONFIG``):
    ``SpeculativeConfig.parse``, its ValueError as argparse's error (naming the field)."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config: ")) from None


def check_spec_decode_parallelism(speculative: SpeculativeConfig | None,
                                  pipeline_parallel_size: int) -> None:
    """The one rule between speculative decoding and pipeline parallelism, checked by the
    worker's and the scheduler's configs: drafts are verified and appended where the tokens
    are sampled (the last stage), and the stages before it would need them in the same step.

    Raises:
        ValueError: ``speculative`` is set and ``pipeline_parallel_size`` > 1, naming both flags.
    """
    if speculative is not None and pipeline_parallel_size > 1:
        raise ValueError("--speculative-config does not work with --pipeline-parallel-size "
                         f"{pipeline_parallel_size} (> 1): drafts are verified and appended "
                         "where the tokens are sampled; use tensor parallelism or no "
                         "speculation")
