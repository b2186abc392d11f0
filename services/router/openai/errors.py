"""OpenAI's error body, and the checks shared by the modules that parse OpenAI JSON requests.

The request parsers (``openai.requests``, ``openai.messages``, ``openai.tools``,
``openai.structured``) raise ``OpenAIError``; ``openai.http`` sends it as
``{"error": {message, type, param, code}}`` with its HTTP status. This module imports none of
them, so each can import it.
"""

from __future__ import annotations


class OpenAIError(Exception):
    """A request answered with OpenAI's error body ``{"error": {message, type, param, code}}``.

    Attributes:
        status: the HTTP status (400, 404, 429, 503, ...).
        message: what is wrong; names the field for a 400.
        type: OpenAI's error type, e.g. "invalid_request_error".
        param: the request field at fault, or None.
        code: a machine-readable code (e.g. "model_not_found"), or None.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                        param, code)

    def body(self) -> dict:
        """The JSON body to send."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """An HTTP 400 ``invalid_request_error``."""
    return OpenAIError(400, message, param=param)


def utf8(text: str, name: str, param: str | None = None) -> str:
    """``text``, checked to be valid Unicode: JSON's ``\\ud800`` escapes decode to lone
    surrogates, which neither protobuf strings (UTF-8) nor the tokenizer accept.

    Args:
        name: the field holding ``text`` as the message names it, e.g. "messages[2].content".
        param: the error's ``param``; None: ``name``.

    Raises:
        OpenAIError: 400 naming the field and the character's position.
    """
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(f"{name} is not valid Unicode: lone surrogate "
                              f"U+{ord(text[e.start]):04X} at character {e.start}",
                              param or name) from None
    return text
