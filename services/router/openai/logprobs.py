"""OpenAI's logprobs objects built from the gRPC API's per-token ``TokenLogprob``s.

- Completions (``logprobs: k``): ``{tokens, token_logprobs, top_logprobs, text_offset}``, one
  entry per token; ``top_logprobs`` is a list of ``{token string: logprob}`` dicts (two ids
  that decode to the same string collapse into one key, as in OpenAI's and vLLM's format) and
  ``text_offset`` the character offset of each token in the choice's text, counted over the
  decoded token strings. With ``echo`` the prompt's tokens come first (the first one with
  null logprob and top_logprobs, OpenAI's shape) and the offsets run on across them.
- Chat (``logprobs: true``, ``top_logprobs: k``): ``{content: [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}]}``; ``bytes`` are the UTF-8 bytes of ``token``.

A token string is ``tokenizer.decode([id])`` with special tokens kept (a token that holds part
of a UTF-8 character decodes to U+FFFD, as in vLLM), or ``token_id:<id>`` with vLLM's
``return_tokens_as_token_ids``. Values are natural logs of the raw distribution (see
api.proto ``SamplingParams.logprobs``).

vLLM's ``prompt_logprobs`` (``prompt_logprobs``, below) have their own shape: one entry per
prompt token, ``null`` for the first, then ``{token_id: {"logprob", "rank", "decoded_token"}}``
holding the prompt's token and the k most likely ones (ranks 1..k; the prompt's token's rank
is null when it is not among them: the engine ranks only its top k).
"""

from __future__ import annotations

from collections.abc import Sequence


class LogprobsFormatter:
    """Formats one choice's logprobs, chunk after chunk, keeping its text offset.

    Args:
        tokenizer: the model's tokenizer (``decode``).
        chat: chat (``content`` list) or completions (the four parallel lists) format.
        token_ids: spell every token ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``).
    """

    def __init__(self, tokenizer, chat: bool, token_ids: bool = False):
        self._tokenizer = tokenizer
        self.chat = chat
        self._token_ids = token_ids
        self._offset = 0  # characters of the token strings formatted so far (completions)
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The token's string (cached per id)."""
        text = self._cache.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self._token_ids
                    else self._tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text

    def format(self, logprobs: Sequence) -> dict:
        """The OpenAI logprobs object of ``logprobs`` (``api_pb2.TokenLogprob``s, in order)."""
        if self.chat:
            return {"content": [self._chat_entry(t.token_id, t.logprob, t.top)
                                for t in logprobs]}
        return self._completion([t.token_id for t in logprobs], [t.logprob for t in logprobs],
                                [{self.token(x.token_id): x.logprob for x in t.top}
                                 for t in logprobs])

    def format_prompt(self, first_token_id: int, logprobs: Sequence, k: int | None = None
                      ) -> dict:
        """(completions, ``echo``) The logprobs object of a whole prompt: its first token
        (``first_token_id``) with logprob and top_logprobs null, as OpenAI's, then one entry
        per ``logprobs`` (the ``GenerateResponse.prompt_logprobs`` of the later tokens), each
        with its ``k`` most likely tokens (None: all that came)."""
        return self._completion(
            [first_token_id] + [t.token_id for t in logprobs],
            [None] + [t.logprob for t in logprobs],
            [None] + [{self.token(x.token_id): x.logprob for x in t.top[:k]}
                      for t in logprobs])

    def _completion(self, token_ids: list[int], lps: list, tops: list) -> dict:
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float, top: Sequence | None) -> dict:
        token = self.token(token_id)
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        if top is not None:
            entry["top_logprobs"] = [self._chat_entry(x.token_id, x.logprob, None) for x in top]
        return entry


def merge(parts: list[dict], chat: bool) -> dict:
    """Concatenate the logprobs objects of one choice's chunks into one."""
    if chat:
        return {"content": [e for p in parts for e in p["content"]]}
    return {key: [v for p in parts for v in p[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprobs(tokenizer, logprobs: Sequence, k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` list of a prompt: ``None`` for its first token, then per
    ``logprobs`` entry (``GenerateResponse.prompt_logprobs``) a dict ``{token_id: {"logprob",
    "rank", "decoded_token"}}`` of the prompt's token and its ``k`` most likely tokens (ranks
    1..k; the prompt token's rank is None when it is not among them). JSON writes the ids as
    strings, as vLLM's."""
    cache: dict[int, str] = {}

    def decoded(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    out: list[dict | None] = [None]
    for t in logprobs:
        entry = {t.token_id: {"logprob": t.logprob, "rank": None,
                              "decoded_token": decoded(t.token_id)}}
        for rank, x in enumerate(t.top[:k], 1):
            entry[x.token_id] = {"logprob": x.logprob, "rank": rank,
                                 "decoded_token": decoded(x.token_id)}
        out.append(entry)
    return out
