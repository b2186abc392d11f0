"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the
router's chat path: ``models`` (the request, answer, stream-event and error bodies),
``mapping`` (a request -> the chat request ``openai.requests.parse_chat`` maps), ``events``
(the engine's messages -> Anthropic's content blocks and stream events), ``errors`` (Anthropic's
error body and status), ``handler`` (the two routes, registered by ``openai.http``)."""
