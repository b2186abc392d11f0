"""What the worker remembers about each request it holds, besides its row of the InputBatch.

Its own module so that ``input_batch`` (which creates, parks and frees it) and
``sampling_rows`` (which reads its sampling state) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.sampling_params import EngineSamplingParams
from services.worker.sample.penalties import TokenCounts
from services.worker.sample.structured_output_masks import RequestGrammar


@dataclass(slots=True)
class RequestState:
    """What the worker remembers about a request between steps, besides its row's data."""

    request_id: str
    sampling: EngineSamplingParams
    generator: torch.Generator | None  # seeded once from sampling.seed, advanced per sample
    num_prompt_tokens: int  # tokens [num_prompt_tokens:] of its token list are outputs
    counts: TokenCounts | None = None  # only when a penalty is on
    min_tokens_stop_ids: tuple[int, ...] = ()  # masked while outputs < min_tokens
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None  # (ids [N] int64, bias [N] float32)
    grammar: RequestGrammar | None = None  # its matcher (the sampling rank, a grammar only)
    row: int = -1  # its row of the InputBatch; -1 while parked
    parked: tuple[np.ndarray, np.ndarray] | None = None  # (token ids [n], block ids
    # [groups, num_blocks]) while rowless
    # a seeded request's last few samples: (its token count then, its generator's state just
    # before the draw); a resume rewinds the generator past draws of steps whose results the
    # scheduler dropped (``InputBatch._replace_tokens``, ``sampling_rows.rewind_generator``)
    rng_history: list[tuple[int, torch.Tensor]] = field(default_factory=list)
