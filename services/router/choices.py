"""One choice of a Generate call: its engine request, detokenizer and stop-string matcher.

A request for n choices runs as n independent engine requests, as in vLLM V1's parallel
sampling (``vllm/v1/engine/parallel_sampling.py``): the router fans the request out and merges
the children's outputs into one stream, each message tagged with its choice ``index``.

- Engine request id: the request id itself when n == 1; ``f"{i}_{request_id}"`` for choice i
  when n > 1 (vLLM's form).
- Seed: with a seed, choice i samples with ``(seed + i) mod 2**64``, so the choices differ but a
  repeated request reproduces all of them; without one every child uses the engine's shared
  generator.
- Each choice detokenizes and matches stop strings on its own text; a stop-string hit ends (and
  aborts in the engine) that choice only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.sampling_params import EngineSamplingParams
from services.router.detokenizer import IncrementalDetokenizer
from services.router.stop_strings import StopResult, StopStringMatcher
from services.router.validation import TextOptions

SEED_MODULUS = 2**64  # seeds are uint64 on the wire


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine request id of choice ``index`` of ``n``: ``request_id`` when n == 1, else
    ``f"{index}_{request_id}"`` (vLLM's child id)."""
    return request_id if n == 1 else f"{index}_{request_id}"


def child_params(params: EngineSamplingParams, index: int) -> EngineSamplingParams:
    """The sampling parameters of choice ``index``: ``params`` with the seed, if set, moved to
    ``(seed + index) mod 2**64``. Returns ``params`` itself for choice 0."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + index) % SEED_MODULUS)


class Choice:
    """The router-side state of one choice: text so far, held-back stop-string prefix, counts.

    Args:
        index: the choice's index in [0, n).
        engine_request_id: its engine request id (see ``child_request_id``).
        request_id: the client-facing request id, echoed in every response.
        prompt_token_ids: the shared prompt (primes the detokenizer; its length is
            ``usage.prompt_tokens``).
        text: stop strings and text options.
        tokenizer: the model's fast tokenizer.
    """

    def __init__(self, index: int, engine_request_id: str, request_id: str,
                 prompt_token_ids: Sequence[int], text: TextOptions, tokenizer):
        self.index = index
        self.engine_request_id = engine_request_id
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        # True once the choice has sent its final message (or failed): later outputs of its
        # engine request, e.g. the ABORT after a stop-string hit, are ignored.
        self.finished = False
        self._logprobs: list[api_pb2.TokenLogprob] = []  # of the output being handled
        self._prompt_tokens = list(prompt_token_ids)
        self._prompt_logprobs: list[api_pb2.TokenLogprob] | None = []  # None once sent
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             skip_special_tokens=text.skip_special_tokens)
        self._stops = StopStringMatcher(text.stop, text.include_stop_str_in_output)
        self._stop_token_ids = text.stop_token_ids
        self._last_token_id: int | None = None

    def on_output(self, out: engine_pb2.RequestOutput
                  ) -> tuple[list[api_pb2.GenerateResponse], bool]:
        """Turn one RequestOutput (without error) of this choice's engine request into the
        message to send, if any.

        Returns:
            (responses, stop_string_hit): the GenerateResponse to stream, as a list of one
            (empty when there is nothing new to show, e.g. a prefill step or text held back),
            and whether a stop string ended the choice, in which case the caller must abort
            its engine request. ``finished`` is True after the final message.
        """
        ids = list(out.new_token_ids)
        self._logprobs = token_logprobs(out)
        if out.prompt_logprobs:
            # NOTE: they all come with the prompt's steps, up to the choice's first message
            assert self._prompt_logprobs is not None
            self._prompt_logprobs.extend(prompt_logprobs(out, self._prompt_tokens))
        match, ids = self._feed(ids)
        self.num_output_tokens += len(ids)
        if ids:
            self._last_token_id = ids[-1]
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        text = match.text_to_emit if match else ""
        if match is not None and match.stopped:
            return [self._final(ids, text, api_pb2.FINISH_REASON_STOP, match.stop_str)], True
        if out.finish_reason:
            # release what the detokenizer and the stop matcher still hold back
            tail = self._stops.feed(self._detok.flush())
            text += tail.text_to_emit
            if tail.stopped:
                return [self._final(ids, text, api_pb2.FINISH_REASON_STOP, tail.stop_str)], False
            return [self._final(ids, text + self._stops.flush(), out.finish_reason)], False
        if ids or text:
            return [api_pb2.GenerateResponse(
                request_id=self.request_id, token_ids=ids, text=text, index=self.index,
                logprobs=self._logprobs, prompt_logprobs=self._take_prompt_logprobs())], False
        return [], False

    def _feed(self, ids: list[int]) -> tuple[StopResult | None, list[int]]:
        """Detokenize ``ids`` and match stop strings in the text. Several tokens at once
        (speculative decoding's accepted drafts) go one at a time when there are stop strings,
        so the one that completes a stop string ends the choice as if it had come alone: the
        tokens after it are dropped (from ids, logprobs and usage). Returns the match (None
        for no tokens) and the tokens kept."""
        if not ids:
            return None, ids
        if len(ids) == 1 or not self._stops.has_stops:
            return self._stops.feed(self._detok.step(ids)), ids
        text = []
        for n, token_id in enumerate(ids, 1):
            match = self._stops.feed(self._detok.step([token_id]))
            text.append(match.text_to_emit)
            if match.stopped:
                self._logprobs = self._logprobs[:n]
                return StopResult("".join(text), True, match.stop_str), ids[:n]
        return StopResult("".join(text)), ids

    def _take_prompt_logprobs(self) -> list[api_pb2.TokenLogprob]:
        """The prompt logprobs gathered so far, once (for the choice's first message)."""
        taken, self._prompt_logprobs = self._prompt_logprobs or [], None
        return taken

    def _final(self, ids: list[int], text: str, reason: api_pb2.FinishReason,
               stop_str: str | None = None) -> api_pb2.GenerateResponse:
        self.finished = True
        response = api_pb2.GenerateResponse(
            request_id=self.request_id, token_ids=ids, text=text, finish_reason=reason,
            usage=api_pb2.Usage(prompt_tokens=self.num_prompt_tokens,
                                completion_tokens=self.num_output_tokens,
                                num_cached_tokens=self.num_cached_tokens),
            stop_reason=stop_str or "", index=self.index, logprobs=self._logprobs,
            prompt_logprobs=self._take_prompt_logprobs())
        if (reason == api_pb2.FINISH_REASON_STOP and stop_str is None
                and self._last_token_id in self._stop_token_ids):
            response.stop_token_id = self._last_token_id  # (the engine stopped on it)
        return response


def prompt_logprobs(out: engine_pb2.RequestOutput, prompt: Sequence[int]
                    ) -> list[api_pb2.TokenLogprob]:
    """The public logprobs of the prompt tokens one RequestOutput scored: prompt tokens
    ``prompt_logprobs_start, ...`` (k top pairs each, k = their count / the token count)."""
    lps, start = out.prompt_logprobs, out.prompt_logprobs_start
    k = len(out.prompt_top_token_ids) // len(lps)
    top_ids, top_lps = out.prompt_top_token_ids, out.prompt_top_logprobs
    return [api_pb2.TokenLogprob(
        token_id=prompt[start + i], logprob=lp,
        top=[api_pb2.TopLogprob(token_id=top_ids[j], logprob=top_lps[j])
             for j in range(i * k, (i + 1) * k)])
        for i, lp in enumerate(lps)]


def token_logprobs(out: engine_pb2.RequestOutput) -> list[api_pb2.TokenLogprob]:
    """The public per-token logprobs of one RequestOutput, aligned with its new_token_ids
    (empty when the request did not ask). The top pairs are k per token, k = their count
    divided by the token count.

    NOTE: every token the engine sent is kept, also the one that completed a stop string:
    token_ids are never cut at a stop string (only the text is), so the two stay aligned.
    """
    ids, lps = out.new_token_ids, out.new_token_logprobs
    if not lps or len(lps) != len(ids):
        return []
    k = len(out.top_token_ids) // len(ids)
    top_ids, top_lps = out.top_token_ids, out.top_logprobs
    return [api_pb2.TokenLogprob(
        token_id=t, logprob=lp,
        top=[api_pb2.TopLogprob(token_id=top_ids[j], logprob=top_lps[j])
             for j in range(i * k, (i + 1) * k)])
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True))]
