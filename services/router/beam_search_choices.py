"""The router's side of a beam search (``use_beam_search``): one engine request, n choices.

Unlike n sampled choices (``services.router.choices``: n engine requests), a beam search runs
as ONE engine request, id = the request id, no parent: the scheduler searches its beam_width
beams on shared KV blocks (``services/scheduler/beam_search.py``) and sends nothing until its
one final RequestOutput, whose ``beams`` are the beam_width finished hypotheses, best score
first. The router returns the first n of them as choices 0 .. n-1, each whole in one message:

- ``token_ids``: the hypothesis's tokens (the EOS or stop token that ended it included, as
  the engine sends it); ``text``: their detokenization after the prompt (the same
  ``IncrementalDetokenizer`` and ``skip_special_tokens`` as a sampled choice; no stop strings,
  which beam search refuses);
- ``finish_reason``: the hypothesis's (STOP or LENGTH); ``usage``: the prompt, this
  hypothesis's length as ``completion_tokens`` and the request's cached prompt tokens;
- ``beam_score``: the hypothesis's score (cumulative logprob / length ** length_penalty).

A final output without hypotheses (the engine ended the request, e.g. ABORT) ends every
choice with its finish_reason and no tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.router.choices import Choice
from services.router.validation import TextOptions


class BeamSearch:
    """The n choices of one beam search, all fed by its one engine request.

    It has ``Choice``'s interface for ``generation.stream_responses``: ``engine_request_id``,
    ``finished``, ``on_output``.

    Args:
        request_id: the client-facing request id, also the engine request's id.
        n: choices to return, at most the request's beam_width.
        prompt_token_ids: the prompt (primes each choice's detokenizer).
        text: text options (``skip_special_tokens``; no stop strings).
        tokenizer: the model's fast tokenizer.
    """

    def __init__(self, request_id: str, n: int, prompt_token_ids: Sequence[int],
                 text: TextOptions, tokenizer):
        self.engine_request_id = request_id
        self.finished = False
        self._choices = [Choice(i, request_id, request_id, prompt_token_ids, text, tokenizer)
                         for i in range(n)]

    def on_output(self, out: engine_pb2.RequestOutput
                  ) -> tuple[list[api_pb2.GenerateResponse], bool]:
        """The n final messages of the search's final output (without error), best first;
        nothing for an output that is not final (the engine sends none before the end).

        Returns:
            (responses, False): a beam search never ends on a stop string.
        """
        if not out.finish_reason:
            return [], False
        self.finished = True
        responses = []
        for i, choice in enumerate(self._choices):
            hypothesis = out.beams[i] if i < len(out.beams) else None
            as_output = engine_pb2.RequestOutput(
                request_id=out.request_id, num_cached_tokens=out.num_cached_tokens,
                new_token_ids=hypothesis.token_ids if hypothesis else (),
                finish_reason=hypothesis.finish_reason if hypothesis else out.finish_reason)
            (response,), _ = choice.on_output(as_output)
            if hypothesis is not None:
                response.beam_score = hypothesis.score
            responses.append(response)
        return responses, False
