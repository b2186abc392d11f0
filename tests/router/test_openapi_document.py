"""``services.router.openapi.document``: routes and pydantic models -> an OpenAPI 3.1 document
that an OpenAPI validator accepts, with every model under components."""

import pytest
from pydantic import BaseModel

from services.router.openapi import Route, document


class _Ask(BaseModel):
    prompt: str
    n: int = 1


class _Answer(BaseModel):
    text: str


class _Error(BaseModel):
    message: str


def test_document_has_each_route_and_model():
    doc = document([Route("POST", "/v1/ask", "ask", _Ask, _Answer, _Answer, {400: "bad"},
                          _Error),
                    Route("GET", "/v1/things/{thing_id}", "a thing", response=_Answer,
                          open=True)], "t", "1")
    assert doc["openapi"] == "3.1.0"
    assert set(doc["components"]["schemas"]) == {"_Ask", "_Answer", "_Error"}
    ask = doc["paths"]["/v1/ask"]["post"]
    assert ask["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/_Ask"}
    assert set(ask["responses"]) == {"200", "400"}
    assert set(ask["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    thing = doc["paths"]["/v1/things/{thing_id}"]["get"]
    assert thing["parameters"][0]["name"] == "thing_id" and "security" not in thing


def test_a_route_declared_twice_is_refused():
    r = Route("GET", "/x", "x")
    with pytest.raises(ValueError, match="GET /x"):
        document([r, r], "t", "1")
