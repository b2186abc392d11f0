"""Five bounded JSON schemas (flat, nested, enum, array, pattern) that a random model always
finishes within a few hundred tokens (maxLength, maxItems, integer ranges, closed objects): the
structured-outputs benchmark's workload and the stack test's acceptance set
(``tests/stack/test_structured_outputs.py``). All but "flat" (which keeps the router's bounded
whitespace) ask for compact JSON through llguidance's ``x-guidance``.
"""

from __future__ import annotations

NAME = {"type": "string", "maxLength": 8}
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"}}, "required": ["name", "age", "admin"],
        "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "address": {"type": "object", "properties": {"city": NAME, "zip": {
                "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
            "required": ["id", "address"]}}, "required": ["user"], **COMPACT},
    "enum": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        "count": {"enum": [1, 2, 3, None]}}, "required": ["color", "size", "count"], **COMPACT},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99},
              "minItems": 2, "maxItems": 6, **COMPACT},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "note": {"type": "string", "pattern": "^[a-z]{1,6}( [a-z]{1,6})?$"}},
        "required": ["code"], **COMPACT},
}


def wide(n: int) -> dict:
    """An object schema of ``n`` integer properties ``p0``.., all optional but the last (so
    ``{}`` is not an answer): from about 500 on llguidance's parser refuses it once the output
    enters the object (a row of ~3n Earley items over ``max_items_in_row``, 2000), not at
    compile time (issue 56: such a request must end as an error, never "stop")."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            "required": [f"p{n - 1}"]}
