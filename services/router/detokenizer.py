"""Incremental detokenization: token ids in, text deltas out, never half a UTF-8 character.

Built on ``tokenizers.decoders.DecodeStream`` (the tokenizers library's streaming decoder; the
same one vLLM V1's ``FastIncrementalDetokenizer`` uses). DecodeStream decodes a short window
of ids and emits the new text only when the window does not end in U+FFFD, i.e. when no byte
sequence is left incomplete; a character split across byte tokens comes out whole.

How the text relates to ``tokenizer.decode(output_ids, skip_special_tokens=...)``:

- Byte-level BPE tokenizers (GPT-2 style, e.g. SmolLM2, Llama 3, Qwen): the joined deltas plus
  ``flush()`` equal the decode of the output ids, for any ids (tested with hypothesis).
- The stream is primed with the end of the prompt, as vLLM does, so the first output token is
  decoded in context: SentencePiece-style (Metaspace) tokenizers keep the leading space of the
  first word, which ``decode(output_ids)`` alone would strip; and a character whose bytes
  begin in the prompt and end in the output comes out whole, where ``decode(output_ids)`` shows
  U+FFFD for the orphan bytes.
- ``clean_up_tokenization_spaces`` is not applied (vLLM's streaming does not apply it either).
- Non-monotonic decoders (a later token rewrites earlier text; vLLM issue #17448) make
  DecodeStream raise "Invalid prefix"; like vLLM we restart the stream (at the ids not yet
  emitted), so already streamed text stands and the text may then differ from the decode.
  Llama-2 style byte fallback is one: an invalid byte run decodes to one U+FFFD per byte,
  including bytes already streamed as valid text.

NOTE: we do not use ``DecodeStream(ids=prompt)``: when the prompt ends inside a character,
its first step emits the whole prompt's text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

# vLLM's priming rule: the shortest prompt suffix of 4..23 tokens that decodes without U+FFFD.
_MIN_PRIME, _MAX_PRIME = 4, 24
_INVALID_PREFIX = "Invalid prefix"


def _prime_suffix(tokenizer, prompt_token_ids: Sequence[int]) -> Sequence[int]:
    """The prompt tail the stream is primed with (from vLLM ``FastIncrementalDetokenizer``)."""
    if len(prompt_token_ids) <= _MIN_PRIME:
        return prompt_token_ids
    for n in range(_MIN_PRIME, min(len(prompt_token_ids) + 1, _MAX_PRIME)):
        suffix = prompt_token_ids[-n:]
        if "\ufffd" not in tokenizer.decode(suffix):
            return suffix
    # Every short suffix has a broken character (vLLM then primes with the whole prompt; the
    # caller passes at most 96 tokens): stepping them one by one still leaves the stream in the
    # state "everything complete is emitted", whatever the prompt ends with.
    return prompt_token_ids


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas.

    Args:
        tokenizer: the model's fast tokenizer (its Rust ``backend_tokenizer`` does the work).
        prompt_token_ids: the request's prompt; its last few tokens give the first output token
            its context (they are never emitted).
        skip_special_tokens: leave special tokens (e.g. ``<|im_end|>``) out of the text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []  # the id that completed the last delta (for flush)
        self._unemitted: list[int] = []  # ids stepped since the last non-empty delta
        self._chunks: list[str] = []
        tail = list(prompt_token_ids[-4 * _MAX_PRIME:])  # never copy a long prompt
        for token_id in _prime_suffix(self._tokenizer, tail):
            self._step_one(token_id)
        self._unemitted.clear()  # prompt bytes left incomplete are completed by the output

    @property
    def text(self) -> str:
        """All output text emitted so far (the joined deltas; O(length) per call)."""
        return "".join(self._chunks)

    def step(self, token_ids: Iterable[int]) -> str:
        """Add new output token ids; return the new text ("" while a character is incomplete).

        Ids >= the vocabulary size decode to nothing (as in ``tokenizer.decode``).

        Raises:
            TypeError: a negative id (tokenizers takes u32).
            Exception: a decoder error from the tokenizers library other than "Invalid prefix".
        """
        delta = "".join(self._step_one(t) for t in token_ids)
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """End of the request: return the text of ids still held back (an incomplete
        character decodes to U+FFFD, as in ``tokenizer.decode``), usually ""."""
        if not self._unemitted:
            return ""
        ctx = self._tokenizer.decode(self._context, skip_special_tokens=self._skip)
        full = self._tokenizer.decode(self._context + self._unemitted,
                                      skip_special_tokens=self._skip)
        delta = full[len(ctx):] if full.startswith(ctx) else self._tokenizer.decode(
            self._unemitted, skip_special_tokens=self._skip)
        self._unemitted.clear()
        if delta:
            self._chunks.append(delta)
        return delta

    def _step_one(self, token_id: int) -> str:
        try:
            return self._raw_step(token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if _INVALID_PREFIX not in str(e):
                raise
        # NOTE: vLLM (issue #17448) restarts the stream at the current token, dropping the text
        # of the ids held since the last delta; we restart at those ids, so none is lost.
        replay, self._unemitted, self._context = [*self._unemitted, token_id], [], []
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        out = []
        for t in replay:
            try:
                out.append(self._raw_step(t))
            except Exception as e:
                if _INVALID_PREFIX not in str(e):
                    raise
                self._stream = DecodeStream(skip_special_tokens=self._skip)  # vLLM's way
                out.append(self._raw_step(t))
        return "".join(out)

    def _raw_step(self, token_id: int) -> str:
        out = self._stream.step(self._tokenizer, token_id)
        self._unemitted.append(token_id)
        if out:
            self._context, self._unemitted = self._unemitted[-1:], []
            return out
        return ""
