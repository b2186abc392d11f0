"""The worker's guards on a decoded step (``services/common/step_wire.py`` checks only its
structure): what its sampler and block copy can use. The router validated everything a client
sent; these refuse a malformed internal message instead of sampling garbage.
"""

from __future__ import annotations

import json
import math

from services.common.sampling_params import EngineSamplingParams


def check_sampling(params: EngineSamplingParams, vocab_size: int) -> None:
    """Refuse parameters the sampler cannot use: a temperature, top_p, min_p, penalty or
    logit bias that is not a finite number in its domain, a stop token id, logit_bias token id,
    reasoning_end_token_id or logprobs count outside the vocabulary (a beam asks for more than
    the router's 20 top logprobs, up to the vocabulary), a negative beam_width, or a
    structured_output that is not llguidance grammar JSON (an object with a ``grammars`` list;
    the grammar itself is the router's to validate, and a matcher that fails anyway only lets
    the request end).

    Not a second validation: the router's (``services/router/validation.py``) names fields and
    limits, and all it accepts passes here. This is the worker's guard against a malformed
    internal message, which would otherwise sample garbage (a NaN temperature, a top_p of 0)
    or fail inside the step (an index outside the vocabulary). Called once per new request.

    Raises:
        ValueError: naming the parameters.
    """
    p = params
    floats = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty)
    if not (all(map(math.isfinite, floats)) and p.temperature >= 0 and 0 < p.top_p <= 1
            and 0 <= p.min_p <= 1 and p.repetition_penalty > 0 and p.beam_width >= 0
            and all(0 <= t < vocab_size for t in p.stop_token_ids)
            and (p.reasoning_end_token_id is None or 0 <= p.reasoning_end_token_id < vocab_size)
            and all(k is None or 0 <= k <= vocab_size for k in (p.logprobs, p.prompt_logprobs))):
        raise ValueError(f"sampling parameters the sampler cannot use (vocab_size {vocab_size}; "
                         f"the router never sends these): {p}")
    bad_bias = [(t, b) for t, b in p.logit_bias if not (0 <= t < vocab_size and math.isfinite(b))]
    if bad_bias or len({t for t, _ in p.logit_bias}) != len(p.logit_bias):
        raise ValueError(f"logit_bias the sampler cannot use (token ids distinct in [0, "
                         f"{vocab_size}), finite biases; the router never sends these): "
                         f"{bad_bias[:5] or 'a repeated token id'}")
    if p.structured_output:
        try:
            grammar = json.loads(p.structured_output)
        except ValueError as e:
            raise ValueError(f"structured_output is not llguidance grammar JSON: {e}") from None
        if not (isinstance(grammar, dict) and isinstance(grammar.get("grammars"), list)):
            raise ValueError("structured_output is not llguidance grammar JSON: expected an "
                             "object with a \"grammars\" list (llguidance.grammar_from's result)")


def check_block_copies(pairs: list[tuple[int, int]], num_kv_blocks: int) -> None:
    """Refuse copy-on-write pairs ``(src, dst)`` the block copy cannot run as asked: a block
    id outside ``[0, num_kv_blocks)``, a destination named twice, or a destination that is
    also a source (the copy reads every source before it writes any destination,
    ``kernels.copy_blocks``, which equals copying the pairs in order only without those; the
    scheduler never sends them).

    Raises:
        ValueError: naming the offending ids.
    """
    if not pairs:
        return
    ids = [b for pair in pairs for b in pair]
    if min(ids) < 0 or max(ids) >= num_kv_blocks:
        raise ValueError(f"block copies must name block ids in [0, {num_kv_blocks}), got "
                         f"[{min(ids)}, {max(ids)}]")
    dst = [d for _, d in pairs]
    chained = set(dst) & {s for s, _ in pairs}
    if len(set(dst)) != len(dst) or chained:
        raise ValueError("block copies must write distinct blocks that no copy of the step "
                         f"reads; got {pairs[:8]}{' ...' if len(pairs) > 8 else ''}")

