"""The router's HTTP contract: every route with the pydantic models of its request and response
bodies, and the OpenAPI 3.1 document built from them (``GET /openapi.json``).

One source: a route module declares its ``Route`` next to its handler, and the handler
validates the body with the same ``request`` model the document describes (``read_body``);
the models of the answers are the ones the handler builds its JSON from. So the document
cannot say one thing while the code does another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


@dataclass(frozen=True, slots=True)
class Route:
    """One HTTP route of the router.

    Attributes:
        method: "GET" or "POST".
        path: aiohttp's path, e.g. "/v1/responses/{response_id}" (the same in OpenAPI).
        summary: one line for the document.
        request: the JSON body's model (None: no body).
        response: the 200 ``application/json`` body's model (None: not JSON, or no body).
        stream: with ``stream: true``, the model of each server-sent event's data (None: the
            route does not stream).
        errors: status -> description of the error answers; each has ``error`` as its body.
        error: the error bodies' model.
        open: needs no API key (probes, scrapers).
        tags: the document's grouping.
        query: the model of the query parameters (one per field; None: none).
        text: the media type of a 200 answer that is text, not JSON (e.g. "text/plain");
            None: none.
    """

    method: str
    path: str
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None
    errors: dict[int, str] = field(default_factory=dict)
    error: type[BaseModel] | None = None
    open: bool = False
    tags: tuple[str, ...] = ()
    query: type[BaseModel] | None = None
    text: str | None = None


def document(routes: list[Route], title: str, version: str) -> dict:
    """The OpenAPI 3.1 document of ``routes``: one operation per route, the models' JSON
    schemas (pydantic's, validation mode for requests, serialization mode for answers) under
    ``components.schemas``.

    Raises:
        ValueError: two routes with the same method and path.
    """
    Mode = Literal["validation", "serialization"]
    models: dict[tuple[type[BaseModel], Mode], None] = {}
    for r in routes:
        if r.request is not None:
            models[(r.request, "validation")] = None
        for m in (r.response, r.stream, r.error):
            if m is not None:
                models[(m, "serialization")] = None
    refs, defs = models_json_schema(list(models), ref_template=REF)
    paths: dict[str, dict] = {}
    for r in routes:
        ops = paths.setdefault(r.path, {})
        if r.method.lower() in ops:
            raise ValueError(f"route {r.method} {r.path} declared twice")
        ops[r.method.lower()] = _operation(r, refs)
    components: dict = {"schemas": defs.get("$defs", {})}
    if any(not r.open for r in routes):
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": components}


def _operation(r: Route, refs: dict) -> dict:
    op: dict = {"summary": r.summary, "operationId": _operation_id(r)}
    if r.tags:
        op["tags"] = list(r.tags)
    if r.path.count("{"):
        op["parameters"] = [{"name": name, "in": "path", "required": True,
                             "schema": {"type": "string"}}
                            for name in (p[1:-1] for p in r.path.split("/") if p[:1] == "{")]
    if r.query is not None:
        op.setdefault("parameters", []).extend(_query_parameters(r.query))
    if r.request is not None:
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[(r.request, "validation")]}}}
    ok: dict = {"description": "OK"}
    content = {}
    if r.response is not None:
        content["application/json"] = {"schema": refs[(r.response, "serialization")]}
    if r.text is not None:
        content[r.text] = {"schema": {"type": "string"}}
    if r.stream is not None:
        # NOTE: before OpenAPI 3.2 (``itemSchema``) an event stream's ``schema`` describes one
        # event, as its fields (schemathesis reads it so); the JSON in ``data`` is described
        # by ``contentSchema``, an annotation (the server checks it: ``schema_check``).
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "description": f"one server-sent event: its data is one {r.stream.__name__} "
                           "as JSON (OpenAI's chat and completion streams end with `[DONE]`)",
            "properties": {"event": {"type": "string"}, "id": {"type": "string"},
                           "retry": {"type": "integer"},
                           "data": {"type": "string", "contentMediaType": "application/json",
                                    "contentSchema": refs[(r.stream, "serialization")]}}}}
    if content:
        ok["content"] = content
    responses: dict = {"200": ok}
    for status, why in sorted(r.errors.items()):
        answer: dict = {"description": why}
        if r.error is not None:
            answer["content"] = {"application/json": {
                "schema": refs[(r.error, "serialization")]}}
        responses[str(status)] = answer
    op["responses"] = responses
    if not r.open:
        op["security"] = [{"bearer": []}, {}]  # (empty: when the router has no API keys)
    return op


def _query_parameters(model: type[BaseModel]) -> list[dict]:
    """One ``in: query`` parameter per field of ``model`` (its validation schema inline)."""
    schema = model.model_json_schema(mode="validation")
    required = set(schema.get("required", ()))
    params = []
    for name, prop in schema.get("properties", {}).items():
        prop = dict(prop)
        description = prop.pop("description", None)
        prop.pop("title", None)
        if prop.get("default", 0) is None:  # an optional parameter: absent, never null
            del prop["default"]
            branches = [b for b in prop.pop("anyOf", ()) if b.get("type") != "null"]
            if len(branches) == 1:
                prop = {**branches[0], **prop}
            elif branches:
                prop["anyOf"] = branches
        param = {"name": name, "in": "query", "required": name in required, "schema": prop}
        if description:
            param["description"] = description
        params.append(param)
    return params


def _operation_id(r: Route) -> str:
    words = [w for w in r.path.replace("{", "").replace("}", "").split("/") if w]
    return "_".join([r.method.lower(), *(w.replace("-", "_") for w in words)])
