"""Structured outputs in the worker: the real runner and model (a tiny random Llama with
SmolLM2's vocabulary and tokenizer) sampling under llguidance grammars."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from benchmarks.structured_output_schemas import wide
from services.common.sampling_params import EngineSamplingParams
from services.common.tokenizer_loading import load_tokenizer
from services.router.structured_output_grammar import build_grammar
from services.worker.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.sample.structured_output_masks import (
    RequestGrammar,
    StructuredOutputs,
    grammar_kind,
)
from services.worker.step_checks import check_sampling
from tests.helpers import make_servable_tiny_llama
from tests.worker.grammar_driver import generate

EOS = 2  # the tiny Llama's (LlamaConfig's default) and SmolLM2's <|im_end|>
SCHEMA = {  # bounded: every output ends within a few dozen tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # a random model would emit blanks forever
}
REGEX = r"[a-z]{2,6}( [0-9]{1,3}){1,2}"
CHOICES = ["red", "green", "blue violet"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_servable_tiny_llama(tmp_path_factory.mktemp("tiny-grammar"))


@pytest.fixture(scope="module")
def runner(model):
    runner = ModelRunner(WorkerConfig(model=model, dtype="float32", device="cpu",
                                      kv_cache_memory=16 << 20, attention_backend="torch"))
    assert list(runner.eos_token_ids) == [EOS]
    return runner


@pytest.fixture(scope="module")
def tok(model):
    return load_tokenizer(model)


def sampled(grammar: str, seed: int, **kw) -> EngineSamplingParams:
    return EngineSamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 60),
                                structured_output=grammar, **kw)


def text(tok, output: list[int]) -> str:
    assert output[-1] == EOS, output  # ended by the grammar, not max_tokens
    return tok.decode(output[:-1], clean_up_tokenization_spaces=False)


def test_sampled_outputs_match_their_grammars(runner, tok):
    """3 seeds x (JSON schema, regex, choice) in one batch at temperature 1, next to an
    unconstrained greedy request that must not notice them."""
    grammars = {"json": llguidance.grammar_from("json", json.dumps(SCHEMA)),
                "regex": llguidance.grammar_from("regex", REGEX),
                "choice": llguidance.grammar_from("choice", json.dumps(CHOICES))}
    prompt = tok.encode("Answer:")
    greedy = EngineSamplingParams(temperature=0.0, max_tokens=12)
    kinds = [k for k in grammars for _ in range(3)]
    params = [sampled(grammars[k], seed) for seed, k in enumerate(kinds)]
    outputs = generate(runner, [prompt] * (len(params) + 1), [*params, greedy])
    assert outputs[-1] == generate(runner, [prompt], [greedy])[0]
    by_kind: dict[str, list[str]] = {k: [] for k in grammars}
    for kind, out in zip(kinds, outputs, strict=False):
        by_kind[kind].append(text(tok, out))
    for value in by_kind["json"]:
        jsonschema.validate(json.loads(value), SCHEMA)
    assert all(re.fullmatch(REGEX, value) for value in by_kind["regex"]), by_kind["regex"]
    assert all(value in CHOICES for value in by_kind["choice"]), by_kind["choice"]
    # the seeds sampled different outputs (the grammar constrains, it does not decide)
    assert len(set(by_kind["json"])) > 1 and len(set(by_kind["regex"])) > 1


def test_greedy_under_a_grammar_that_admits_it_is_unchanged(runner, tok):
    """The mask never disturbs an allowed token: greedy under a grammar that admits the
    unconstrained greedy text (exactly its length, in the characters it uses: most tokens are
    masked at every step) gives the same tokens, then EOS (the grammar is complete).

    NOTE: not a grammar of the literal text: llguidance then allows only the canonical
    tokenization of the forced bytes, which a random model's greedy tokens need not be.
    """
    greedy = EngineSamplingParams(temperature=0.0, max_tokens=8)
    special = set(tok.all_special_ids)
    for word in ("Hello", "The answer is", "JSON:", "Once upon a time"):
        free = generate(runner, [tok.encode(word)], [greedy])[0]
        value = tok.decode(free, clean_up_tokenization_spaces=False)
        if "\ufffd" not in value and not special & set(free):  # text a grammar can name
            break
    else:
        pytest.fail("no prompt with a plain-text greedy answer")
    chars = "".join(f"\\x{{{ord(c):x}}}" for c in sorted(set(value)))
    grammar = llguidance.grammar_from("regex", f"[{chars}]{{{len(value)}}}")
    constrained = EngineSamplingParams(temperature=0.0, max_tokens=20, structured_output=grammar)
    assert generate(runner, [tok.encode(word)], [constrained])[0] == [*free, EOS]


def test_resumed_request_replays_its_outputs(runner, tok):
    """Preempted after 3 outputs and resumed with only 2 of them (the scheduler dropped a
    step): the matcher is rebuilt from those 2, so exactly 6 digits come out in the end."""
    digits = llguidance.grammar_from("regex", r"[0-9]{6}")
    schema = llguidance.grammar_from("json", json.dumps(SCHEMA))
    prompt = tok.encode("Digits:")
    outputs = generate(runner, [prompt, prompt], [sampled(digits, 1), sampled(schema, 2)],
                       preempt=(3, 0))
    assert re.fullmatch(r"[0-9]{6}", text(tok, outputs[0])), outputs[0]
    jsonschema.validate(json.loads(text(tok, outputs[1])), SCHEMA)


def test_finished_grammar_allows_only_eos_despite_min_tokens_or_ignore_eos(runner, tok):
    """A choice is complete after a token or two; min_tokens (which masks EOS) must not leave
    an all -inf row: the grammar wins, EOS comes until min_tokens lets it finish. With
    ignore_eos it keeps sampling EOS until max_tokens."""
    grammar = llguidance.grammar_from("choice", json.dumps(["yes", "no"]))
    prompt = tok.encode("Sure?")
    min_tokens = sampled(grammar, 3, min_tokens=4)
    ignore_eos = sampled(grammar, 4, ignore_eos=True, max_tokens=5)
    outputs = generate(runner, [prompt, prompt], [min_tokens, ignore_eos])
    for out in outputs:  # the answer (1 or 2 tokens: "yes" may come as "y" "es"), then EOS
        end = out.index(EOS)
        assert len(out) == 5 and out[end:] == [EOS] * (5 - end), out
        assert tok.decode(out[:end]) in ("yes", "no")


def test_broken_grammar_is_reported_with_a_warning(runner, caplog):
    """A grammar the matcher refuses (here an invalid regex the router would have caught): the
    first step reports the request broken (``StepOutput.broken_request_ids``, once, naming the
    kind and llguidance's error; the driver ends it there without its token), and the worker
    warns, naming the request."""
    bad = llguidance.grammar_from("regex", "(unclosed")
    check_sampling(sampled(bad, 0), runner.vocab_size)  # (grammar JSON: not refused)
    broken: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, "services.worker.sample.structured_output_masks"):
        assert generate(runner, [[1, 2, 3]], [sampled(bad, 0)], broken=broken) == [[]]
    assert list(broken) == ["req-0"]
    assert broken["req-0"].startswith("structured output (regex) cannot be honoured: the "
                                      "grammar failed:") and "unclosed" in broken["req-0"]
    (record,) = [r for r in caplog.records if "structured output broke" in r.getMessage()]
    assert record.request_id == "req-0" and "unclosed" in record.getMessage()


def test_a_wide_schema_breaks_after_accepting_its_first_lexeme(runner, tok):
    """Issue 56: a schema of 1000 optional properties compiles, masks, and then llguidance's
    parser refuses the row after ``{`` (over max_items_in_row). That request is reported
    broken without the token that broke it (no EOS, no ``{``), next to a constrained request
    and an unconstrained one in the same batch that finish as usual."""
    wide_grammar = build_grammar("json", json.dumps(wide(1000)))
    digits = llguidance.grammar_from("regex", r"[0-9]{4}")
    prompt = tok.encode("Answer:")
    broken: dict[str, str] = {}
    outputs = generate(runner, [prompt] * 3,
                       [sampled(wide_grammar, 0), sampled(digits, 1),
                        EngineSamplingParams(temperature=0.0, max_tokens=6)], broken=broken)
    assert list(broken) == ["req-0"], broken
    message = broken["req-0"]
    assert message.startswith("structured output (json_schema) cannot be honoured: the "
                              "matcher refused token"), message
    assert "max is 2000" in message and "\n" not in message and len(message) < 400
    assert EOS not in outputs[0] and "{" not in tok.decode(outputs[0])
    assert re.fullmatch(r"[0-9]{4}", text(tok, outputs[1]))
    assert len(outputs[2]) == 6


def test_broken_rows_are_reported_once_and_a_resume_starts_over(tok):
    """``GrammarStep.broken`` hands a broken grammar over once; ``reset`` (a resume) clears it,
    so a grammar that breaks again is reported again."""
    so = StructuredOutputs(lambda: tok, len(tok), (EOS,))
    g = RequestGrammar("r", build_grammar("json", json.dumps(wide(1000))))
    brace = tok.encode("{")[0]
    for _ in range(2):
        step = so.start(np.array([0]), [g])
        assert step.mask(torch.device("cpu")).disallowed[0, brace].item() is False
        step.consume([brace])
        ids, messages = step.broken()
        assert ids == ["r"] and "max is 2000" in messages[0]
        assert step.broken() == ([], [])
        g.reset([])
    so.close()


def test_grammar_kind_names_the_constraint():
    assert grammar_kind(build_grammar("json", "{}")) == "json_schema"
    assert grammar_kind(build_grammar("regex", "a+")) == "regex"
    assert grammar_kind(build_grammar("grammar", 'start: "a"')) == "grammar"
    assert grammar_kind("not json") == "grammar"


def test_check_sampling_refuses_what_is_not_grammar_json():
    for bad in ("not json", '["a list"]', '{"no": "grammars"}'):
        with pytest.raises(ValueError, match="structured_output is not llguidance grammar JSON"):
            check_sampling(EngineSamplingParams(structured_output=bad), 100)
    check_sampling(EngineSamplingParams(
        structured_output=llguidance.grammar_from("regex", "a+")), 100)


def test_masks_of_a_vocabulary_larger_than_the_tokenizer_and_without_a_tokenizer(tok, caplog):
    """Model rows past the tokenizer's vocabulary are never allowed; on a worker without a
    tokenizer a constrained request's row is EOS-only and reported broken, with a warning."""
    vocab = len(tok) + 40
    so = StructuredOutputs(lambda: tok, vocab, (EOS,))
    grammar = llguidance.grammar_from("regex", "[a-z ]+")
    step = so.start(np.array([0, 1]), [RequestGrammar("a", grammar),
                                       RequestGrammar("b", grammar)])
    mask = step.mask(torch.device("cpu"))
    disallowed = mask.disallowed.numpy()
    assert disallowed.shape == (2, vocab) and disallowed[:, len(tok):].all()
    assert not disallowed[:, tok.encode("hello")[0]].any() and disallowed[:, EOS].all()
    assert mask.eos_rows.numel() == 0
    so.close()

    def no_tokenizer():
        raise FileNotFoundError("no tokenizer here")

    so = StructuredOutputs(no_tokenizer, vocab, (EOS,))
    with caplog.at_level(logging.WARNING, "services.worker.sample.structured_output_masks"):
        step = so.start(np.array([3]), [RequestGrammar("c", grammar)])
        mask = step.mask(torch.device("cpu"))
    assert mask.rows.tolist() == [3] and mask.disallowed.numpy().sum() == vocab - 1
    assert (mask.eos_rows.tolist(), mask.eos_ids.tolist()) == ([0], [EOS])
    (ids, (message,)) = step.broken()
    assert ids == ["c"] and "no tokenizer here" in message
    assert any("no tokenizer here" in r.getMessage() for r in caplog.records)
    so.close()


@pytest.mark.slow  # two rank processes (spawned: torch imported twice), ~15 s
def test_tp2_only_the_driver_holds_matchers_and_both_ranks_agree(model, tok, tmp_path):
    """Two gloo ranks: rank 0 (the driver) builds matchers and samples; rank 1 ignores the
    grammar and keeps the broadcast tokens, which are the same and match the grammar."""
    import multiprocessing as mp

    from services.common.ports import free_port_range
    from tests.worker.grammar_driver import tp_rank

    grammars = [llguidance.grammar_from("json", json.dumps(SCHEMA)),
                llguidance.grammar_from("regex", REGEX)]
    prompts = [tok.encode("Answer:")] * 2
    ctx = mp.get_context("spawn")
    port = free_port_range(1)
    paths = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=tp_rank, args=(r, port, model, prompts, grammars, str(paths[r])))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:  # no rank outlives the test, even a hung one
            if p.is_alive():
                p.kill()
            p.join(10)
    (driver, out0), (peer, out1) = (json.loads(p.read_text()) for p in paths)
    assert (driver, peer) == (True, False) and out0 == out1
    jsonschema.validate(json.loads(text(tok, out0[0])), SCHEMA)
    assert re.fullmatch(REGEX, text(tok, out0[1]))


# ---- the grammar after the reasoning (reasoning_end_token_id) -------------------------------

DIGITS = r"[0-9]{6}"


def after_reasoning(tok, seed: int, **kw) -> EngineSamplingParams:
    """Six digits after the reasoning, whose end E is the token of "Hello"."""
    end = tok.encode("Hello")[0]
    return sampled(llguidance.grammar_from("regex", DIGITS), seed, reasoning_end_token_id=end,
                   **kw)


def test_reasoning_rows_get_no_mask_until_e_then_the_matcher_starts_after_it(tok):
    """Rows in reasoning are left out of the mask and their matcher consumes nothing; E itself
    is free; the token after E is the grammar's first (digits only), next to a row constrained
    from the start."""
    so = StructuredOutputs(lambda: tok, len(tok), (EOS,))
    end, word, digit = tok.encode("Hello")[0], tok.encode("abc")[0], tok.encode("7")[0]
    grammar = llguidance.grammar_from("regex", DIGITS)
    gated, plain = RequestGrammar("g", grammar, reasoning_end=end), RequestGrammar("p", grammar)
    assert gated.reasoning and not plain.reasoning
    step = so.start(np.array([0, 2]), [gated, plain])
    mask = step.mask(torch.device("cpu"))
    assert mask is not None and mask.rows.tolist() == [2]  # only the plain row is masked
    step.consume([word, digit])  # not a digit: the reasoning row takes it, untouched
    assert gated.reasoning and not gated.failed and not plain.failed
    step = so.start(np.array([0]), [gated])
    assert step.mask(torch.device("cpu")) is None  # nothing to mask at all
    step.consume([end])  # E: the reasoning ends, the matcher has still consumed nothing
    assert not gated.reasoning and not gated.failed
    step = so.start(np.array([0]), [gated])
    mask = step.mask(torch.device("cpu"))
    assert mask is not None and mask.rows.tolist() == [0]
    allowed = np.flatnonzero(~mask.disallowed.numpy()[0])
    assert digit in allowed and word not in allowed and end not in allowed
    assert all(tok.decode([t]).isdigit() for t in allowed)
    so.close()


def test_reset_replays_only_the_outputs_after_the_first_e():
    end = 9
    g = RequestGrammar("g", "{}", reasoning_end=end)
    g.reset([1, 2, 3])
    assert g.reasoning and g.replay == []
    g.reset([1, end, 4, end, 5])
    assert not g.reasoning and g.replay == [4, end, 5]
    g.reset([])
    assert g.reasoning and g.replay == []
    plain = RequestGrammar("p", "{}")
    plain.reset([1, end, 4])
    assert not plain.reasoning and plain.replay == [1, end, 4]


def test_e_first_then_the_grammar_through_the_runner(runner, tok):
    """A large bias on E makes it the first token (free); from the next token on the grammar
    masks E (whatever its bias): six digits, then EOS. Without reasoning_end_token_id the same
    request never samples E (the grammar applies from the start)."""
    end = tok.encode("Hello")[0]
    bias = ((end, 100.0),)
    gated, plain = generate(runner, [tok.encode("Think:")] * 2, [
        after_reasoning(tok, 5, logit_bias=bias),
        sampled(llguidance.grammar_from("regex", DIGITS), 5, logit_bias=bias)])
    assert gated[0] == end and re.fullmatch(DIGITS, text(tok, gated[1:])), gated
    assert end not in plain and re.fullmatch(DIGITS, text(tok, plain)), plain


def test_before_e_the_output_is_the_unconstrained_one(runner, tok):
    """While E is not sampled the request samples exactly what it would without a grammar (same
    seed): tokens the grammar would refuse come out."""
    prompt = tok.encode("Think:")
    gated, free = generate(runner, [prompt, prompt], [
        after_reasoning(tok, 11, max_tokens=8),
        EngineSamplingParams(temperature=1.0, seed=11, max_tokens=8)])
    assert tok.encode("Hello")[0] not in free  # (the case under test: E never came)
    assert gated == free and not re.fullmatch(r"[0-9]*", tok.decode(free)), free


def test_preempted_after_e_replays_only_the_tokens_after_it(runner, tok):
    """E first, preempted after 3 outputs and resumed with 2 (E and one digit): the matcher
    replays the digit alone, so exactly six digits follow E."""
    end = tok.encode("Hello")[0]
    outputs = generate(runner, [tok.encode("Think:")], [
        after_reasoning(tok, 3, logit_bias=((end, 100.0),))], preempt=(3, 0))
    out = outputs[0]
    assert out[0] == end and re.fullmatch(DIGITS, text(tok, out[1:])), out


def test_check_sampling_refuses_a_reasoning_end_outside_the_vocabulary():
    grammar = llguidance.grammar_from("regex", "a+")
    check_sampling(EngineSamplingParams(structured_output=grammar, reasoning_end_token_id=99), 100)
    for bad in (100, -1):
        with pytest.raises(ValueError, match="sampling parameters the sampler cannot use"):
            check_sampling(EngineSamplingParams(structured_output=grammar,
                                                reasoning_end_token_id=bad), 100)
