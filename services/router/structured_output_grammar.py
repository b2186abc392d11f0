"""A request's ``StructuredOutputs`` -> one validated llguidance grammar, compiled off the loop.

Every request form (gRPC ``StructuredOutputs``; OpenAI ``response_format`` and vLLM
``structured_outputs`` through ``openai.structured``; tool_choice required/named) ends here as
one ``api_pb2.StructuredOutputs``. ``compile_structured_outputs`` turns it into the
llguidance grammar text (the TopLevelGrammar JSON of ``llguidance.grammar_from``) that the
router puts into ``EngineSamplingParams.structured_output``; the driver worker builds its
matcher from that text. The router validates once, without a tokenizer
(``LLMatcher.validate_grammar_with_warnings``: llguidance's lexer is lazy, so the check
does not depend on the vocabulary), so a bad schema is a 400 before anything is submitted.

    kind          grammar
    json          the schema (JSON object text), objects closed, bounded whitespace (below)
    json_object   the schema {"type": "object"}, bounded whitespace
    regex         grammar_from("regex", text)      Rust ``regex`` syntax, whole output
    choice        grammar_from("regex", the strings escaped, joined by |)   one lexeme
    grammar       grammar_from("grammar", text)    Lark, or GBNF (llguidance tells them apart)

JSON options (the router's defaults; a schema's own ``"x-guidance"`` object overrides them):

- Whitespace between tokens is one space, or one newline followed by at most
  ``MAX_INDENT`` spaces/tabs (so compact, ``json.dumps`` default and indented output all
  match), never more: llguidance's default (vLLM's ``guidance`` backend) allows any run of
  whitespace in every gap, which lets a weak model fill max_tokens with blanks.
- An object schema with ``properties`` or ``patternProperties`` and no
  ``additionalProperties`` gets ``additionalProperties: false`` (what vLLM's default backend,
  xgrammar, and OpenAI's strict mode do), so the output has only the listed keys.

Limits (checked before anything is compiled, so a hostile request costs little):
``MAX_GRAMMAR_BYTES`` of UTF-8 text per constraint (a schema's JSON text, a regex, a grammar,
a choice list's JSON) and ``MAX_SCHEMA_DEPTH`` nested JSON objects/arrays in a schema.

Errors are ``RequestError`` INVALID_ARGUMENT ``structured_outputs.<kind>: <why>``; the
compiled grammars, and the errors, are cached by (kind, text) in a bounded LRU shared by the
router's requests (thread-safe: the compile runs on worker threads).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from services.common.pb.pagedserve.v1 import api_pb2
from services.router.validation import RequestError, invalid

log = logging.getLogger(__name__)

# Most cached grammars (each the grammar text, about the size of its schema).
DEFAULT_CACHE_ENTRIES = 1024
MAX_INDENT = 32  # most spaces/tabs after a newline between JSON tokens
# NOTE: the limits of one constraint. 1 MiB holds any hand-written schema or grammar many
# times over (OpenAI's strict mode allows 100,000 characters of property names and enums in
# all) and a choice list of tens of thousands of strings; 64 nested JSON objects/arrays is 32
# levels of subschemas (properties -> name -> ...), where OpenAI's strict mode allows 10. Both
# bound the work llguidance does on one request.
MAX_GRAMMAR_BYTES = 1024 * 1024
MAX_SCHEMA_DEPTH = 64
# llguidance's whitespace lexeme between JSON tokens (each gap matches it at most once)
WHITESPACE_PATTERN = rf"(?:\x20|\n[\x20\t]{{0,{MAX_INDENT}}})"
_WHITESPACE_OPTIONS = ("whitespace_flexible", "whitespace_pattern")
# JSON Schema keywords whose value is a map of name -> subschema, a list of subschemas, or
# one subschema: where ``_close_objects`` looks for nested object schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "not",
               "if", "then", "else", "contains", "propertyNames")


def cache_key(so: api_pb2.StructuredOutputs) -> tuple[str, str] | None:
    """``(kind, text)`` naming the grammar of ``so`` (the cache key), or None when unset.
    ``choice`` is keyed by its JSON list, ``json_object`` by "true"/"false"."""
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return kind, json.dumps(list(so.choice.choices), ensure_ascii=False)
    if kind == "json_object":
        return kind, json.dumps(so.json_object)
    return kind, getattr(so, kind)


def check_size(kind: str, text: str) -> None:
    """Refuse a constraint text over ``MAX_GRAMMAR_BYTES`` (UTF-8 bytes).

    Raises:
        RequestError(INVALID_ARGUMENT): ``structured_outputs.<kind> must be at most 1048576
            bytes, got 1100000``.
    """
    if len(text) > MAX_GRAMMAR_BYTES // 4:  # shorter texts cannot exceed it
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise invalid(f"structured_outputs.{kind} must be at most {MAX_GRAMMAR_BYTES} "
                          f"bytes, got {size}", "structured_outputs")


def build_grammar(kind: str, text: str) -> str:
    """The validated llguidance grammar for ``(kind, text)`` (see the module's table). CPU
    work (schema parsing, llguidance's grammar checks): run it off the event loop.

    Raises:
        RequestError(INVALID_ARGUMENT): ``structured_outputs.<kind>: ...``, e.g. an empty
            choice list, a schema that is not a JSON object or over the limits (module
            note), or llguidance's message.
    """
    check_size(kind, text)
    try:
        grammar = _grammar(kind, text)
    except ValueError as e:  # llguidance refused the text before validation
        raise invalid(f"structured_outputs.{kind}: {e}", "structured_outputs") from None
    except RecursionError:
        raise invalid(f"structured_outputs.{kind} is nested too deeply",
                      "structured_outputs") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise invalid(f"structured_outputs.{kind}: {messages[0].strip()}", "structured_outputs")
    for warning in messages:
        log.info("structured_outputs.%s: llguidance warning: %s", kind, warning)
    return grammar


def _grammar(kind: str, text: str) -> str:
    """The TopLevelGrammar JSON of ``(kind, text)`` (kind: one of StructuredOutputs' five),
    unvalidated."""
    if kind == "json":
        return _json_grammar(_schema(text))
    if kind == "json_object":
        if text != "true":
            raise invalid("structured_outputs.json_object must be true", "structured_outputs")
        return _json_grammar({"type": "object"})
    if kind == "choice":
        choices = json.loads(text)
        if not choices:
            raise invalid("structured_outputs.choice must list at least one string",
                          "structured_outputs")
        empty = next((i for i, c in enumerate(choices) if not c), None)
        if empty is not None:
            raise invalid(f"structured_outputs.choice[{empty}] is empty", "structured_outputs")
        # NOTE: one regex (a single lexeme), not llguidance's "choice" (a rule of alternatives,
        # whose parser refuses rows of over 2000 items only once it runs, in the worker)
        return llguidance.grammar_from("regex", "|".join(map(_literal, choices)))
    if not text:
        raise invalid(f"structured_outputs.{kind} is empty", "structured_outputs")
    if kind == "regex":
        return llguidance.grammar_from("regex", text)
    return _lark(llguidance.grammar_from("grammar", text))


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")  # what Rust's regex syntax lets one escape


def _literal(text: str) -> str:
    """``text`` as a regex matching exactly it (Rust ``regex`` syntax, llguidance's)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _lark(lark: str) -> str:
    """A Lark grammar as TopLevelGrammar JSON (``grammar_from`` returns Lark text as it is for
    lark and gbnf; the worker takes only the JSON form)."""
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


def _schema(text: str) -> dict:
    """``text`` parsed as a JSON Schema object.

    Raises:
        RequestError(INVALID_ARGUMENT): not JSON, nested too deeply, or not an object.
    """
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise invalid(f"structured_outputs.json is not valid JSON: {e}",
                      "structured_outputs") from None
    except RecursionError:
        raise invalid("structured_outputs.json is nested too deeply",
                      "structured_outputs") from None
    if not isinstance(schema, dict):
        raise invalid("structured_outputs.json must be a JSON Schema object, got "
                      f"{type(schema).__name__}", "structured_outputs")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise invalid(f"structured_outputs.json must nest at most {MAX_SCHEMA_DEPTH} JSON "
                      f"objects/arrays, got {depth}", "structured_outputs")
    return schema


def _depth(value: Any) -> int:
    """How many JSON objects/arrays nest in ``value`` (1 for ``{}``), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        node, d = level.pop()
        children = (node.values() if isinstance(node, dict)
                    else node if isinstance(node, list) else None)
        if children is None:
            continue
        deepest = max(deepest, d)
        level.extend((c, d + 1) for c in children)
    return deepest


def _json_grammar(schema: dict) -> str:
    """The grammar of a JSON Schema with the router's defaults (bounded whitespace unless the
    schema's x-guidance sets whitespace; closed objects)."""
    own = schema.get("x-guidance")
    sets_whitespace = isinstance(own, dict) and any(k in own for k in _WHITESPACE_OPTIONS)
    defaults = None if sets_whitespace else {"whitespace_pattern": WHITESPACE_PATTERN}
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(_close_objects(schema)), defaults=defaults)  # type: ignore[arg-type]


def _close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema listing ``properties`` or
    ``patternProperties`` without ``additionalProperties`` (or ``unevaluatedProperties``)
    has ``additionalProperties: false``; subschemas are found through the keywords above.

    NOTE: as in vLLM's ``process_for_additional_properties``, ``allOf`` branches are closed
    too, so two branches listing different properties admit only objects with neither;
    such a schema should set additionalProperties itself.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close_objects(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close_objects(s) for s in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close_objects(out[key])
    if (("properties" in out or "patternProperties" in out)
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


class GrammarCache:
    """A bounded LRU of ``build_grammar`` results (grammar text or error message) by
    (kind, text); safe to use from several threads and event loops.

    Args:
        max_entries: most entries kept (>= 1); the least recently used goes first.
    """

    def __init__(self, max_entries: int = DEFAULT_CACHE_ENTRIES):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[bool, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: tuple[str, str]) -> str | None:
        """The cached grammar of ``key``, or None on a miss.

        Raises:
            RequestError(INVALID_ARGUMENT): ``key`` was compiled before and was invalid.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        ok, value = entry
        if not ok:
            raise invalid(value, "structured_outputs")
        return value

    def compile(self, key: tuple[str, str]) -> str:
        """``build_grammar(*key)``, cached (also its error). Blocking: call on a thread.

        NOTE: two threads missing on the same key at once both compile it (the result is the
        same); the lock is held only around the dict, never around llguidance.

        Raises:
            RequestError(INVALID_ARGUMENT): as ``build_grammar``.
        """
        cached = self.lookup(key)
        if cached is not None:
            return cached
        try:
            entry = (True, build_grammar(*key))
        except RequestError as e:
            entry = (False, e.message)
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        ok, value = entry
        if not ok:
            raise invalid(value, "structured_outputs")
        return value


_CACHE = GrammarCache()  # the router process's grammars


async def compile_structured_outputs(so: api_pb2.StructuredOutputs,
                                     cache: GrammarCache | None = None) -> str:
    """The llguidance grammar of ``so``, "" when no kind is set. A cache hit answers at once;
    a miss compiles on a worker thread (``asyncio.to_thread``), so the event loop keeps
    serving other requests while this one waits for its grammar.

    Args:
        cache: the cache to use; the router process's by default.

    Raises:
        RequestError(INVALID_ARGUMENT): ``structured_outputs.<kind>: <why>``.
    """
    key = cache_key(so)
    if key is None:
        return ""
    check_size(*key)  # before the cache: a huge text is not kept, nor hashed again
    cache = _CACHE if cache is None else cache
    hit = cache.lookup(key)
    if hit is not None:
        return hit
    return await asyncio.to_thread(cache.compile, key)
