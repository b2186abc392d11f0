"""Pydantic models of the OpenAI-compatible HTTP API's request and answer bodies: the one source
of ``GET /openapi.json`` (``services.router.openapi``) and of the checks the handlers run
(``openai.schema_check``).

Request models accept what the hand parsers (``openai.requests`` and friends) accept, typed as
loosely (``extra="allow"``: OpenAI clients send extras; a number where those take int or float);
the ranges stay the parsers' and ``validation``'s (their messages name each limit), and the
document shows the fixed ones (``bounds``). Answer models describe exactly what the handlers
send, nulls included (``extra="forbid"``), so the stack tests and the fuzzer hold the code to
them.

- ``common``: the error body, usage, ``bounds``.
- ``completions``: /v1/completions and /v1/chat/completions (whole and streamed).
- ``responses``: /v1/responses (whole, stream events, stored).
- ``embeddings``: /v1/embeddings.
- ``misc``: /v1/models, /tokenize, /detokenize, /version, the LoRA routes.
"""
