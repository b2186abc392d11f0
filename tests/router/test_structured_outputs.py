"""The router's structured outputs: every request form -> one StructuredOutputs -> one validated
llguidance grammar (cached, compiled off the event loop), and the errors that name the field.

Whitespace and closed objects are checked by running the grammar in an llguidance matcher
over SmolLM2's tokenizer, as the worker will.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import llguidance
import llguidance.hf
import pytest

from pagedserve_client import build_request
from pagedserve_client.pb.pagedserve.v1 import api_pb2 as client_pb2
from services.common.pb.pagedserve.v1 import api_pb2
from services.router import structured_output_grammar as so_mod
from services.router.generation import EngineError
from services.router.openai.errors import OpenAIError
from services.router.openai.requests import from_error, parse_chat, parse_completion
from services.router.openai.structured_output_format import error_param
from services.router.structured_output_grammar import (
    MAX_GRAMMAR_BYTES,
    MAX_SCHEMA_DEPTH,
    GrammarCache,
    build_grammar,
    cache_key,
    compile_structured_outputs,
)
from services.router.validation import RequestError
from tests.router import smollm2_tokenizer
from tests.router.test_generation import FakeEngine, collect, out, prepared

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
SO = api_pb2.StructuredOutputs


@pytest.fixture(scope="module")
def lltok():
    return llguidance.hf.from_tokenizer(smollm2_tokenizer())


def accepts(lltok, grammar: str, text: str) -> bool:
    """The grammar's matcher consumes ``text``'s tokens and may stop after them."""
    m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    ids = smollm2_tokenizer()(text, add_special_tokens=False)["input_ids"]
    return m.consume_tokens(ids) and m.is_accepting()


# ---- HTTP fields -> StructuredOutputs ----------------------------------------------------
@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, SO(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     SO(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, SO(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, SO(json='{"type": "string"}')),
    ({"structured_outputs": {"regex": r"\d+", "json": None, "json_object": False}},
     SO(regex=r"\d+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     SO(choice=api_pb2.ChoiceList(choices=["yes", "no"]))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, SO(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, SO(json_object=True)),
])
@pytest.mark.parametrize("parse, base", [(parse_chat, {"messages": []}),
                                         (parse_completion, {"prompt": "a"})])
def test_http_forms_map_onto_structured_outputs(parse, base, fields, expected):
    parsed = parse({**base, **fields})
    request = parsed.request if parse is parse_chat else parsed.requests[0]
    sp = request.sampling_params
    if expected is None:
        assert not sp.HasField("structured_outputs")
    else:
        assert sp.structured_outputs == expected


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": "json"}, "response_format", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format", "json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format", "json_schema.strict"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "got regex, choice"),
    ({"structured_outputs": ["regex"]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs", "structured_outputs.json"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs",
     "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", "\ud800"]}}, "structured_outputs",
     r"structured_outputs.choice[1] is not valid Unicode"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs",
     "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs", "disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "cannot both"),
    ({"guided_json": SCHEMA}, "guided_json", "use structured_outputs"),
])
def test_http_refusals_name_the_field(fields, param, words):
    for parse, base in ((parse_chat, {"messages": []}), (parse_completion, {"prompt": "a"})):
        with pytest.raises(OpenAIError) as err:
            parse({**base, **fields})
        assert (err.value.status, err.value.param) == (400, param)
        assert words in err.value.message


def test_a_grammar_error_names_the_field_that_set_it():
    with pytest.raises(RequestError) as err:
        build_grammar("json", '{"type": "foo"}')
    assert err.value.param == "structured_outputs"
    message = err.value.message
    assert message.startswith("structured_outputs.json")
    fmt = parse_chat({"messages": [], "response_format": {"type": "json_object"}})
    e = from_error(err.value, fmt.prompt_param, fmt.structured_param)
    assert (e.status, e.param, e.message) == (400, "response_format", message)
    # the completions route names the field by error_param, over its whole body
    vllm = {"prompt": "a", "structured_outputs": {"regex": "a"}}
    e = from_error(err.value, "prompt", error_param(vllm))
    assert (e.status, e.param, e.message) == (400, "structured_outputs", message)


# ---- SDK kwargs -------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    ({"json": SCHEMA}, client_pb2.StructuredOutputs(json=json.dumps(SCHEMA))),
    ({"json": "{}"}, client_pb2.StructuredOutputs(json="{}")),
    ({"regex": "a+", "json": None}, client_pb2.StructuredOutputs(regex="a+")),
    ({"choice": ("a", "b")},
     client_pb2.StructuredOutputs(choice=client_pb2.ChoiceList(choices=["a", "b"]))),
    ({"grammar": "start: /x/"}, client_pb2.StructuredOutputs(grammar="start: /x/")),
    ({"json_object": True}, client_pb2.StructuredOutputs(json_object=True)),
    (client_pb2.StructuredOutputs(regex="z"), client_pb2.StructuredOutputs(regex="z")),
    (SO(regex="z"), client_pb2.StructuredOutputs(regex="z")),  # the server's stubs' class
])
def test_sdk_structured_outputs_kwarg(value, expected):
    assert build_request("hi", structured_outputs=value).sampling_params.structured_outputs == (
        expected)
    assert not build_request("hi").sampling_params.HasField("structured_outputs")


@pytest.mark.parametrize("value, error, words", [
    ({}, ValueError, "exactly one"), ({"regex": "a", "grammar": "b"}, ValueError, "exactly one"),
    ({"regexp": "a"}, ValueError, "regexp"), ("a+", TypeError, "dict"),
    ({"choice": "ab"}, TypeError, "choice"), ({"regex": 3}, TypeError, "regex"),
    ({"json_object": 1}, TypeError, "json_object"),
])
def test_sdk_structured_outputs_refusals(value, error, words):
    with pytest.raises(error, match=words):
        build_request("hi", structured_outputs=value)


# vLLM's structured_outputs dict, through the router's HTTP parser and the SDK's keyword: one
# mapping (pagedserve_client.structured_outputs), so the same message or the same refusal.
@pytest.mark.parametrize("value", [
    {"json": SCHEMA}, {"json": '{"type": "string"}'}, {"regex": r"\d+"},
    {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a"'}, {"json_object": True},
    {"regex": "a", "json": None, "json_object": False}, {"choice": ["a"], "json_object": False},
    {"json_object": False}, {"json_object": None, "json": None}, {}, {"json_object": 0},
    {"json_object": "yes"}, {"regex": "a", "choice": ["a"]}, {"json": [1]}, {"regex": 5},
    {"choice": "yes"}, {"choice": ["a", "\ud800"]}, {"grammar": "\ud800"},
])
def test_router_and_sdk_map_structured_outputs_alike(value):
    try:
        sdk = build_request("hi", structured_outputs=value).sampling_params.structured_outputs
    except (TypeError, ValueError) as e:
        sdk_error = str(e)
    else:
        sdk_error = None
    try:
        parsed = parse_chat({"messages": [], "structured_outputs": value})
    except OpenAIError as e:
        assert (e.status, e.param, e.message) == (400, "structured_outputs", sdk_error)
        return
    assert sdk_error is None
    router = parsed.request.sampling_params.structured_outputs
    assert client_pb2.StructuredOutputs.FromString(router.SerializeToString()) == sdk
    assert router.WhichOneof("kind") in ("json", "regex", "choice", "grammar", "json_object")


def test_json_object_false_is_unset_not_a_kind():
    """``json_object: false`` never reaches the proto (where it is a set kind that the server
    refuses): alone it is "no kind set", beside another kind it is ignored."""
    with pytest.raises(ValueError, match="exactly one"):
        build_request("hi", structured_outputs={"json_object": False})
    with pytest.raises(OpenAIError, match="exactly one"):
        parse_chat({"messages": [], "structured_outputs": {"json_object": False}})
    sp = build_request("hi", structured_outputs={"regex": "a", "json_object": False})
    assert sp.sampling_params.structured_outputs == client_pb2.StructuredOutputs(regex="a")


def test_sdk_logit_bias_kwarg():
    sp = build_request("hi", logit_bias={5: -100, 7: 2.5}).sampling_params
    assert dict(sp.logit_bias) == {5: -100.0, 7: 2.5}
    for bias, error in (({"5": 1}, TypeError), ({5: "x"}, TypeError), ([5], TypeError),
                        ({2**40: 1}, ValueError)):
        with pytest.raises(error, match="logit_bias"):
            build_request("hi", logit_bias=bias)


# ---- StructuredOutputs -> grammar --------------------------------------------------------
def test_each_kind_compiles_to_a_grammar_that_matches_it(lltok):
    cases = [
        (SO(json=json.dumps(SCHEMA)), '{"name": "Ann", "age": 3}', '{"name": "Ann"}'),
        (SO(json_object=True), '{"x": [1, {"y": null}]}', "[1]"),
        (SO(regex=r"[a-c]{2}\d"), "ab7", "abc"),
        (SO(choice=api_pb2.ChoiceList(choices=["yes", 'no "way"'])), 'no "way"', "no"),
        (SO(grammar='root ::= "a" ("," "a")*'), "a,a,a", "a,"),  # GBNF
        (SO(grammar='start: "b"+'), "bbb", "ba"),  # Lark
    ]
    for so, good, bad in cases:
        grammar = build_grammar(*cache_key(so))
        assert isinstance(json.loads(grammar)["grammars"], list)  # TopLevelGrammar JSON
        assert accepts(lltok, grammar, good), (so, good)
        assert not accepts(lltok, grammar, bad), (so, bad)


def test_a_choice_is_one_lexeme_however_many_strings_and_whatever_they_hold(lltok):
    """A choice compiles to one escaped regex: 20000 strings run (llguidance's parser refuses
    a rule of over 2000 alternatives, and only at the first token), and regex syntax in a
    choice is literal text."""
    many = [f"opt{i}" for i in range(20000)]
    grammar = build_grammar(*cache_key(SO(choice=api_pb2.ChoiceList(choices=many))))
    assert accepts(lltok, grammar, "opt19999") and accepts(lltok, grammar, "opt7")
    assert not accepts(lltok, grammar, "opt") and not accepts(lltok, grammar, "opt20000")
    odd = ["a.b", "x|y", "(1+2)*3?", "c:\\dir", "[]{}^$#&-~", "tab\there", "é ☃"]
    grammar = build_grammar(*cache_key(SO(choice=api_pb2.ChoiceList(choices=odd))))
    assert all(accepts(lltok, grammar, c) for c in odd)
    assert not any(accepts(lltok, grammar, c) for c in ["aXb", "x", "1+2", "a-b"])


def test_json_whitespace_is_bounded_but_pretty_json_matches(lltok):
    grammar = build_grammar("json", json.dumps(SCHEMA))
    value = {"name": "Ann", "age": 3}
    for text in (json.dumps(value), json.dumps(value, separators=(",", ":")),
                 json.dumps(value, indent=4)):
        assert accepts(lltok, grammar, text), text
    for text in ('{  "name": "Ann", "age": 3}', '{"name": "Ann", "age": 3\n\n}',
                 '{"name": "Ann",\n' + " " * 33 + '"age": 3}'):
        assert not accepts(lltok, grammar, text), text
    # the schema's own x-guidance wins: compact only
    compact = build_grammar("json", json.dumps({**SCHEMA, "x-guidance": {
        "whitespace_flexible": False}}))
    assert accepts(lltok, compact, json.dumps(value, separators=(",", ":")))
    assert not accepts(lltok, compact, json.dumps(value))


def test_objects_with_properties_are_closed_unless_the_schema_says(lltok):
    nested = {"type": "object", "properties": {"inner": SCHEMA}, "required": ["inner"]}
    extra = '{"inner": {"name": "A", "age": 1, "x": 2}}'
    assert not accepts(lltok, build_grammar("json", json.dumps(nested)), extra)
    assert not accepts(lltok, build_grammar("json", json.dumps(nested)),
                       '{"inner": {"name": "A", "age": 1}, "x": 2}')
    open_inner = {**nested, "properties": {"inner": {**SCHEMA, "additionalProperties": True}}}
    assert accepts(lltok, build_grammar("json", json.dumps(open_inner)), extra)
    # a schema without properties (and json_object) stays any object
    assert accepts(lltok, build_grammar("json", '{"type": "object"}'), '{"z": 1}')


def _nested(levels: int) -> dict:
    """An object schema with ``levels`` nested object properties "a" around an integer: 2 *
    levels + 1 nested JSON objects."""
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("so, words", [
    (SO(json='{"type": "foo"}'), "structured_outputs.json: Invalid type: foo"),
    (SO(json='{"type": "string", "pattern": "(("}'), "structured_outputs.json: regex parse"),
    (SO(json="{"), "structured_outputs.json is not valid JSON"),
    (SO(json="[1]"), "structured_outputs.json must be a JSON Schema object, got list"),
    (SO(json="[" * 100_000), "structured_outputs.json is nested too deeply"),
    (SO(json='{"type": "integer", "minimum": 5, "maximum": 1}'),
     "structured_outputs.json: Unsatisfiable schema"),
    (SO(regex="(("), "structured_outputs.regex: "),
    (SO(regex=""), "structured_outputs.regex is empty"),
    (SO(choice=api_pb2.ChoiceList()), "structured_outputs.choice must list at least one"),
    (SO(choice=api_pb2.ChoiceList(choices=["a", ""])), "structured_outputs.choice[1] is empty"),
    (SO(grammar="start: foo"), 'structured_outputs.grammar: at 1(8): unknown name: "foo"'),
    (SO(grammar="root ::= ("), "structured_outputs.grammar: Failed to convert the grammar"),
    (SO(grammar=""), "structured_outputs.grammar is empty"),
    (SO(json_object=False), "structured_outputs.json_object must be true"),
    (SO(regex="a" * (MAX_GRAMMAR_BYTES + 1)),
     f"structured_outputs.regex must be at most {MAX_GRAMMAR_BYTES} bytes, got "
     f"{MAX_GRAMMAR_BYTES + 1}"),
    (SO(grammar="é" * (MAX_GRAMMAR_BYTES // 2 + 1)),  # counted in UTF-8 bytes
     f"structured_outputs.grammar must be at most {MAX_GRAMMAR_BYTES} bytes, got "
     f"{MAX_GRAMMAR_BYTES + 2}"),
    (SO(json=json.dumps(_nested(MAX_SCHEMA_DEPTH // 2))),
     f"structured_outputs.json must nest at most {MAX_SCHEMA_DEPTH} JSON objects/arrays, got "
     f"{MAX_SCHEMA_DEPTH + 1}"),
])
def test_invalid_forms_are_invalid_argument_naming_the_kind(so, words):
    with pytest.raises(RequestError) as err:
        asyncio.run(compile_structured_outputs(so, GrammarCache()))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith(words), err.value.message
    if so.WhichOneof("kind") == "regex" and so.regex == "((":
        assert "unclosed group" in err.value.message  # llguidance's own message


def test_a_schema_at_the_depth_limit_compiles(lltok):
    schema = _nested(MAX_SCHEMA_DEPTH // 2 - 1)  # 63 nested objects
    grammar = build_grammar("json", json.dumps(schema))
    assert accepts(lltok, grammar, '{"a": ' * 31 + "7" + "}" * 31)


def test_unset_structured_outputs_is_no_grammar():
    assert asyncio.run(compile_structured_outputs(SO(), GrammarCache())) == ""


# ---- cache and event loop ----------------------------------------------------------------
def test_cache_returns_the_same_grammar_faster_and_is_bounded():
    cache = GrammarCache(max_entries=2)
    big = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x[0-9]+"} for i in range(200)}}
    so = SO(json=json.dumps(big))
    t0 = time.perf_counter()
    first = asyncio.run(compile_structured_outputs(so, cache))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    second = asyncio.run(compile_structured_outputs(so, cache))
    warm = time.perf_counter() - t0
    assert second is first and warm < cold, (cold, warm)
    for regex in ("a", "b"):
        asyncio.run(compile_structured_outputs(SO(regex=regex), cache))
    assert len(cache) == 2 and cache.lookup(cache_key(so)) is None  # least recently used left
    assert cache.lookup(("regex", "b")) is not None


def test_an_invalid_grammar_is_cached_as_its_error(monkeypatch):
    cache = GrammarCache()
    calls = []
    real = so_mod.build_grammar
    monkeypatch.setattr(so_mod, "build_grammar", lambda *key: calls.append(key) or real(*key))
    for _ in range(2):
        with pytest.raises(RequestError, match=r"structured_outputs\.regex"):
            asyncio.run(compile_structured_outputs(SO(regex="(("), cache))
    assert calls == [("regex", "((")]


def test_the_compile_runs_off_the_event_loop(monkeypatch):
    threads = []
    real = so_mod.build_grammar
    monkeypatch.setattr(so_mod, "build_grammar",
                        lambda *key: threads.append(threading.get_ident()) or real(*key))

    async def main():
        grammar = await compile_structured_outputs(SO(regex="x+"), GrammarCache())
        return grammar, threading.get_ident()

    grammar, loop_thread = asyncio.run(main())
    assert grammar and len(threads) == 1 and threads[0] != loop_thread


# ---- stream_responses waits for the grammar before submitting ------------------------------
def test_every_choice_is_submitted_with_the_grammar():
    req = prepared(n=3, seed=7)
    req.structured_outputs = SO(regex="[ab]+")
    engine = FakeEngine([out(child_request_id, finish=1) for child_request_id in
                         ("0_req", "1_req", "2_req")])
    asyncio.run(collect(engine, req))
    grammar = build_grammar("regex", "[ab]+")
    assert {rid: (p.structured_output, p.seed) for rid, (p, _) in engine.submitted.items()} == {
        "0_req": (grammar, 7), "1_req": (grammar, 8), "2_req": (grammar, 9)}
    assert req.params.structured_output == ""  # the prepared request is left as it was


def test_an_invalid_grammar_fails_before_anything_is_submitted():
    req = prepared(n=2)
    req.structured_outputs = SO(json='{"type": "foo"}')
    engine = FakeEngine([])
    with pytest.raises(EngineError) as err:
        asyncio.run(collect(engine, req))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("structured_outputs.json: Invalid type")
    assert engine.submitted == {} and engine.aborted == []
