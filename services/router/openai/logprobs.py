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
of a UTF-8 character decodes to U+FFFD, as in vLLM). Values are natural logs of the raw
distribution (see api.proto ``SamplingParams.logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence


class LogprobsFormatter:
    """Formats one choice's logprobs, chunk after chunk, keeping its text offset.

    Args:
        tokenizer: the model's tokenizer (``decode``).
        chat: chat (``content`` list) or completions (the four parallel lists) format.
    """

    def __init__(self, tokenizer, chat: bool):
        self._tokenizer = tokenizer
        self.chat = chat
        self._offset = 0  # characters of the token strings formatted so far (completions)
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The token's string (cached per id)."""
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
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

    def format_prompt(self, first_token_id: int, logprobs: Sequence) -> dict:
        """(completions, ``echo``) The logprobs object of a whole prompt: its first token
        (``first_token_id``) with logprob and top_logprobs null, as OpenAI's, then one entry
        per ``logprobs`` (the ``GenerateResponse.prompt_logprobs`` of the later tokens)."""
        return self._completion(
            [first_token_id] + [t.token_id for t in logprobs],
            [None] + [t.logprob for t in logprobs],
            [None] + [{self.token(x.token_id): x.logprob for x in t.top} for t in logprobs])

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
