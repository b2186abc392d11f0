"""What one engine step asks of a worker, and what it answers (plain dataclasses, no torch).

The gRPC servicer converts the StepRequest protobuf into a ``StepInput`` and a ``StepOutput``
back into a StepResult. vLLM V1 style: a request is sent in full once (``NewRequest``), then
only as diffs (``CachedRequest``); the worker keeps the rest (token ids, block table, sampling
options, RNG) in its per-request state. The worker owns its tokens: the last pipeline stage
appends what it samples; ``new_token_ids`` carries tokens only to the earlier stages and, as
the whole list, for a request resumed from preemption (see worker.proto's CachedRequests).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingOptions:
    """The sampling parameters the worker applies (vLLM SamplingParams names)."""

    temperature: float = 1.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    seed: int | None = None  # per-request RNG seed: output independent of the batch
    min_p: float = 0.0  # keep tokens with prob >= min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # over prompt + output tokens (transformers'); 1 = off
    presence_penalty: float = 0.0  # over output tokens (OpenAI's); 0 = off
    frequency_penalty: float = 0.0  # per output occurrence (OpenAI's); 0 = off
    min_tokens: int = 0  # stop ids get -inf while fewer outputs than this; 0 = off
    stop_token_ids: tuple[int, ...] = ()  # masked under min_tokens (with EOS unless ignore_eos)
    ignore_eos: bool = False  # min_tokens then masks stop_token_ids only
    logprobs: int | None = None  # top raw logprobs to return per sampled token; None = none
    prompt_logprobs: int | None = None  # top raw logprobs per prompt token; None = none

    @property
    def uses_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass(slots=True)
class NewRequest:
    """A request the worker has not seen (or has dropped), sent in full once."""

    request_id: str
    prompt_token_ids: list[int]  # every token the worker must hold (prompt + any output so far)
    sampling: SamplingOptions
    block_ids: list[int]  # the block table, in logical order
    num_computed_tokens: int  # tokens whose K/V are already in the cache (e.g. a prefix hit)
    num_scheduled_tokens: int  # tokens to compute this step


@dataclass(slots=True)
class CachedRequest:
    """A request the worker already holds: what changed since the previous step."""

    request_id: str
    new_token_ids: list[int]  # appended to the token list (earlier pipeline stages), or the
    # whole token list if resumed
    new_block_ids: list[int]  # appended to the block table, or the whole table if resumed
    resumed_from_preemption: bool  # True: new_block_ids and new_token_ids REPLACE table and list
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class StepInput:
    """One engine step. Requests are computed in the order new_requests, then cached_requests."""

    step_id: int
    new_requests: list[NewRequest]
    cached_requests: list[CachedRequest]
    finished_request_ids: list[str]  # dropped before anything else in this step


@dataclass(slots=True)
class StepOutput:
    """The sampled tokens of the requests whose chunk reached the end of their token list."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]  # parallel to request_ids
    logprobs: SampledLogprobs | None = None  # None when no request of the step asked
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobs:
    """Raw logprobs of the prompt tokens one request's chunk scored this step.

    Prompt token ``first_position + j`` (``j < len(logprobs)``) has logprob ``logprobs[j]``
    given the tokens before it; ``top_token_ids`` / ``top_logprobs`` hold k pairs per scored
    token (k = their length / len(logprobs)), most likely first. Position 0 is never scored.
    """

    request_id: str
    first_position: int
    logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SampledLogprobs:
    """Columnar logprobs of one step (the StepResult's layout; see worker.proto).

    ``num_top_logprobs[i]`` is k for request i of the StepOutput, or -1 when it asked for none;
    ``sampled_logprobs`` has one float (natural log) per request with k >= 0, in order;
    ``top_token_ids`` / ``top_logprobs`` hold k entries per such request, most likely first.
    """

    num_top_logprobs: list[int]
    sampled_logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]
