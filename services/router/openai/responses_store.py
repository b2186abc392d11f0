"""The router's bounded store of Responses API answers (``--enable-responses-api-store``).

A stored response can be continued (``previous_response_id``: its conversation comes before
the new input) and fetched (``GET /v1/responses/{id}``). The store keeps the last
``--responses-api-store-size`` responses of this router in memory, least recently used first
out; it is per router and lost on restart, so behind several routers a client must reach the
one that answered (or resend the conversation: the route works without the store).

Each entry holds the answer and the conversation as chat messages (the earlier turns, this
request's input, and the answer as an assistant turn; the ``instructions`` are not kept, as
OpenAI does not carry them over). A conversation is stored only after its request passed
validation, so it fit the model's context then; its size is bounded by that.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_STORE_SIZE = 256  # router --responses-api-store-size


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored answer.

    Attributes:
        response: the Response object as it was sent.
        conversation: the chat messages up to and including the answer's assistant turn.
    """

    response: dict
    conversation: list[dict]


class ResponseStore:
    """The last ``capacity`` responses, by id (an LRU: ``get`` and ``put`` refresh an entry).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE):
        if capacity < 1:
            raise ValueError(f"--responses-api-store-size must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, or evicted)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict, messages: list[dict]) -> None:
        """Store ``response`` (a Response object) after the chat ``messages`` that asked for
        it, evicting the least recently used entry when full."""
        conversation = messages + answer_messages(response["output"])
        self._entries[response["id"]] = StoredResponse(response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def answer_messages(output: list[dict]) -> list[dict]:
    """A Response's output items as chat messages: one assistant turn with its text and tool
    calls (reasoning items are dropped, as chat templates drop earlier thinking)."""
    text = "".join(item["content"][0]["text"] for item in output if item["type"] == "message")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]
