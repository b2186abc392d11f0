"""The one sampling-parameters type, from the router's validation to the worker's rows.

The router checks the client's ``SamplingParams`` once (``services/router/validation.py``) and
turns them into an ``EngineSamplingParams`` with every default filled in, so nothing behind the
router reads an unset field or a 0 that means "off". engine.proto's ``EngineSamplingParams``
message carries it to the scheduler, and worker.proto's ``NewRequest`` carries the same message
on to the workers (``to_pb`` / ``from_pb``, field for field). The scheduler and the workers
trust it: they do not check it again (a worker only refuses values its sampler cannot use,
``services/worker/step_checks.check_sampling``). Names and meanings follow vLLM's
``SamplingParams``; stop strings and detokenization are not here (the router applies them to
the text, ``validation.TextOptions``).

One request's parameters on their way::

    JSON body ─(openai.requests)─▶ api.proto SamplingParams          fields may be unset
      ─(validate_sampling, router)─▶ EngineSamplingParams            checked, defaults filled
      ─▶ SubmitRequest.sampling_params ─▶ Request.sampling_params    (scheduler)
      ─▶ NewRequest.sampling_params    ─▶ RequestState.sampling      (worker)
      ─▶ InputBatch row (temperature, top_p, top_k, min_p, ...)  ─▶ SamplingTensors per step
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from services.common.pb.pagedserve.v1 import engine_pb2

TOP_K_OFF = -1  # top_k meaning "off" (the router sends it for 0, -1 and k >= vocab_size)


@dataclass(frozen=True, slots=True)
class EngineSamplingParams:
    """The sampling parameters of one engine request, checked and with defaults filled in.

    The ranges are the router's (``validate_sampling``); each default is what the public field
    means when unset. The scheduler reads ``max_tokens``, ``min_tokens``, ``stop_token_ids``,
    ``ignore_eos`` and the logprobs counts; the worker the rest (and ``min_tokens``,
    ``stop_token_ids`` and ``ignore_eos`` again, to mask stop tokens).
    """

    temperature: float = 1.0  # >= 0; 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = TOP_K_OFF  # in [1, vocab_size), or TOP_K_OFF
    seed: int | None = None  # per-request generator seed (uint64); None = the shared generator
    max_tokens: int | None = None  # output tokens, >= 1; None = up to max_model_len
    stop_token_ids: tuple[int, ...] = ()  # finish STOP when sampled (besides EOS); in [0, V)
    ignore_eos: bool = False  # keep generating past the model's EOS token(s)
    min_p: float = 0.0  # in [0, 1]: keep tokens with prob >= min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # > 0, over prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # in [-2, 2], over output tokens; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2], per output occurrence; 0 = off
    min_tokens: int = 0  # in [0, max_tokens]: no EOS / stop token finishes before this many
    logprobs: int | None = None  # top raw logprobs per new token, in [0, 20]; None = none
    prompt_logprobs: int | None = None  # top raw logprobs per prompt token; None = none
    # llguidance grammar (TopLevelGrammar JSON) the output must match; "" = unconstrained
    structured_output: str = ""
    # (token id, bias) pairs added to the raw logits, ids distinct in [0, V), bias in [-100, 100]
    logit_bias: tuple[tuple[int, float], ...] = ()
    # beam search (services/scheduler/beam_search.py): beams k >= 1; 0 = no beam search. A
    # worker's row with it set returns its top ``logprobs`` candidates and never appends its
    # own sample (the scheduler picks each beam's next token and sends it to every rank).
    beam_width: int = 0
    length_penalty: float = 1.0  # beam search: score = cumulative logprob / len ** this
    early_stopping: str = "false"  # beam search: "true" | "false" | "never" (transformers')
    # structured_output is enforced only after this token id (the reasoning's end, </think>)
    # is generated; the matcher starts at the token after it. None = from the first token.
    reasoning_end_token_id: int | None = None

    @property
    def uses_penalties(self) -> bool:
        """A repetition, presence or frequency penalty is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def to_pb(self) -> engine_pb2.EngineSamplingParams:
        """The wire form: every field as it is (None leaves an optional field unset);
        ``logit_bias`` as two parallel columns."""
        msg = engine_pb2.EngineSamplingParams(**{name: getattr(self, name) for name in _FIELDS})
        if self.logit_bias:
            msg.logit_bias_token_ids.extend(t for t, _ in self.logit_bias)
            msg.logit_bias_values.extend(b for _, b in self.logit_bias)
        return msg

    @classmethod
    def from_pb(cls, msg: engine_pb2.EngineSamplingParams) -> EngineSamplingParams:
        """Read the wire form back, field for field (an unset optional field is None); no
        checks, no defaults: the router sent every field."""
        values: dict = {name: getattr(msg, name) for name in _FIELDS}
        values["stop_token_ids"] = tuple(msg.stop_token_ids)
        values["logit_bias"] = tuple(zip(msg.logit_bias_token_ids, msg.logit_bias_values,
                                         strict=True))
        for name in _OPTIONAL:
            if not msg.HasField(name):
                values[name] = None
        return cls(**values)


# the fields that are message fields of the same name (logit_bias travels as two columns)
_FIELDS = tuple(f.name for f in fields(EngineSamplingParams) if f.name != "logit_bias")
# proto3 optional: None unset
_OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "reasoning_end_token_id")
