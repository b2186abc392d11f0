"""Structured outputs on the sampling rank: one llguidance matcher per constrained request, and
each step's allowed-token masks.

The rule (issue 19): the router turns every request form into one llguidance grammar (the
TopLevelGrammar JSON that ``llguidance.grammar_from`` returns) and validates it; the scheduler
forwards the string (``EngineSamplingParams.structured_output``); only the rank that samples
(the driver: tp rank 0 of the last pipeline stage) holds matchers. The other ranks ignore the
grammar: they get the driver's tokens by broadcast.

One worker thread (``grammar``) does all llguidance work, in order: first it builds the
``LLTokenizer`` from the model's HF tokenizer (at worker start: ~1.2 s for SmolLM2, so the
first structured request may wait for it), then each step's mask job::

    prepare ─▶ start(rows, grammars) -> GrammarStep
                                 thread: build missing matchers (LRU grammar -> template
                                 LLMatcher, deep_copy, replay a resumed request's outputs),
                                 fill bitmask [C, ceil(V/32)] int32, unpack -> disallowed
                                 [C, V] bool; the EOS-only rows
    forward                      (overlaps the job: a mask depends only on known tokens)
    step.mask() ─▶ GrammarMask ─▶ Sampler: after penalties, logit_bias and min_tokens, before
                                 greedy / temperature / top-k / top-p / min-p
    step.consume(tokens)         each matcher advances by its sampled token

After the reasoning (``EngineSamplingParams.reasoning_end_token_id`` = E, set by the router's
``--reasoning-parser`` when the output begins inside the ``<think>`` span; vLLM's
``reasoning_ended``): until the request samples E its row gets no mask and its matcher consumes
nothing; E itself is unconstrained and not consumed; from the next token on the row is
constrained as if the output began there. A resumed request replays only its outputs after
the first E (none while E is not among them: it is still reasoning)::

    outputs   r r r E j j j EOS        r: reasoning, free   E: </think>, free
    matcher         ^ starts here      j: constrained by the grammar

A row is EOS-only when its matcher is stopped (the grammar is complete), broken (below), or
its mask allows nothing but EOS ids. Its EOS logits are set to 0 after everything else, so
min_tokens (which masks EOS) cannot leave a row of -inf: the grammar wins, and a complete
grammar ends the request "stop" through the ordinary EOS path (with ignore_eos it keeps
sampling EOS until max_tokens).

A broken grammar is never a normal stop (issue 56): a matcher that could not be built (no
tokenizer, a grammar llguidance refuses), went into error computing its mask, or refused the
token sampled for its row (llguidance fails *after* accepting a lexeme when the next parser
row is over ``max_items_in_row``, e.g. the ``{`` of a schema with a thousand optional
properties) marks its request broken, once (``RequestGrammar.error``, a warning naming the
request). ``GrammarStep.broken`` hands the step's new ones to the runner, which reports them
in ``StepOutput.broken_request_ids`` / ``broken_messages``; the scheduler ends each with
INTERNAL and does not output the step's token for it. Until the scheduler's finish arrives the
row stays EOS-only.

Bit ``j % 32`` of word ``j // 32`` of a bitmask row allows token ``j`` (llguidance's layout);
the tokenizer is built for the model's vocabulary ``V`` (``n_vocab``), so tokens the tokenizer
lacks (a padded embedding) are never allowed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask_par
from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

TEMPLATE_CACHE_SIZE = 64  # grammars whose compiled template matcher a worker keeps


@dataclass(slots=True)
class RequestGrammar:
    """One constrained request's matcher state (driver rank only).

    Attributes:
        request_id: for warnings.
        grammar: the llguidance grammar (TopLevelGrammar JSON text).
        matcher: built by the mask job the first time the request samples; None before, and
            when it cannot be built (no tokenizer).
        replay: output tokens the matcher consumes when it is built (a resumed request's).
        built: the mask job tried to build the matcher (since the request came or resumed).
        failed: the grammar broke: its matcher could not be built or entered an error state
            (warned once).
        error: why it broke (``fail``), "" while it has not.
        reported: the break was handed to the runner (``GrammarStep.broken``).
        reasoning_end: the token id E after which the grammar applies (the reasoning's end),
            or None: it applies from the first output token.
        reasoning: E has not been sampled yet: the row is unconstrained and its matcher
            consumes nothing.
    """

    request_id: str
    grammar: str
    matcher: llguidance.LLMatcher | None = None
    replay: list[int] = field(default_factory=list)
    built: bool = False
    failed: bool = False
    reasoning_end: int | None = None
    error: str = ""
    reported: bool = False
    reasoning: bool = False

    def __post_init__(self) -> None:
        self.reasoning = self.reasoning_end is not None

    def reset(self, output_token_ids: Sequence[int]) -> None:
        """Start again from the grammar's start, then ``output_token_ids`` (a resume from
        preemption: the outputs may differ from what this worker's matcher consumed); with
        ``reasoning_end``, only the outputs after its first occurrence (none, and still
        reasoning, without one)."""
        self.matcher, self.built, self.failed = None, False, False
        self.error, self.reported = "", False
        outputs = list(output_token_ids)
        if self.reasoning_end is not None:
            self.reasoning = self.reasoning_end not in outputs
            outputs = [] if self.reasoning else outputs[outputs.index(self.reasoning_end) + 1:]
        self.replay = outputs

    def advance(self, token: int) -> None:
        """Consume the row's sampled ``token``: a reasoning row only watches for E; a
        constrained one advances its matcher (a refused token: the grammar broke, ``fail``)."""
        if self.reasoning:
            self.reasoning = token != self.reasoning_end
            return
        m = self.matcher
        if m is not None and not m.consume_token(token) and not self.failed:
            self.fail(f"the matcher refused token {token}: {m.get_error()}")

    def fail(self, reason: str) -> None:
        """Mark the grammar broken for ``reason`` (its first line, at most ``MAX_REASON``
        characters, is kept in ``error``) and warn, naming the request; a second call does
        nothing (the first reason stands)."""
        if self.failed:
            return
        self.failed = True
        self.error = _first_line(reason)
        log.warning("structured output broke: %s; the request ends with an error",
                    self.error, extra={"request_id": self.request_id})

    def message(self) -> str:
        """The error the request ends with: the constraint kind and ``error``."""
        return f"structured output ({grammar_kind(self.grammar)}) cannot be honoured: {self.error}"


MAX_REASON = 300  # characters of llguidance's error kept in a broken request's message


def _first_line(text: str) -> str:
    """``text``'s first non-empty line, cut to ``MAX_REASON`` characters (llguidance appends
    its parser state, many lines, to an error)."""
    line = next((x.strip() for x in text.splitlines() if x.strip()), "unknown error")
    return line if len(line) <= MAX_REASON else line[:MAX_REASON - 3] + "..."


def grammar_kind(grammar: str) -> str:
    """The constraint kind of an llguidance grammar (TopLevelGrammar JSON): its first
    grammar's ``name`` (``json_schema``, ``regex``: a regex or a choice, as the router builds
    them), else ``json_schema`` or ``grammar`` (Lark) by which field it sets; ``grammar`` for
    text that is not that JSON."""
    try:
        first = json.loads(grammar)["grammars"][0]
    except (ValueError, TypeError, KeyError, IndexError):
        return "grammar"
    if not isinstance(first, dict):
        return "grammar"
    name = first.get("name")
    if isinstance(name, str) and name:
        return name
    return "json_schema" if first.get("json_schema") is not None else "grammar"


@dataclass(slots=True)
class GrammarMask:
    """What the grammar allows on the constrained rows of one step, on the logits' device.

    Attributes:
        rows: ``[C]`` int64, the constrained rows of the step's ``[S, V]`` logits, ascending
            (rows still in their reasoning left out).
        disallowed: ``[C, V]`` bool, True = the token gets -inf.
        eos_rows / eos_ids: ``[E]`` int64 pairs (index into ``rows``, EOS id) set to 0 after
            the mask: the EOS-only rows.
    """

    rows: torch.Tensor
    disallowed: torch.Tensor
    eos_rows: torch.Tensor
    eos_ids: torch.Tensor


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Mask ``logits [S, V]`` float32 in place: disallowed tokens -inf, the EOS-only rows'
    EOS ids 0 (whatever penalties, bias or min_tokens did to them)."""
    every_row = mask.rows.shape[0] == logits.shape[0]  # (rows ascending: then all, in order)
    sub = logits if every_row else logits[mask.rows]  # [C, V]
    sub.masked_fill_(mask.disallowed, float("-inf"))
    if mask.eos_rows.numel():
        sub.index_put_((mask.eos_rows, mask.eos_ids), torch.tensor(0.0, device=sub.device))
    if not every_row:
        logits[mask.rows] = sub


@dataclass(slots=True)
class _Masks:
    """A mask job's numpy result over its masked rows (``M``, those not in reasoning):
    ``disallowed [M, V]`` bool, the EOS-only indices ``[E']``."""

    disallowed: np.ndarray
    eos_only: np.ndarray


class GrammarStep:
    """One step's mask job (``StructuredOutputs.start``): collect the mask, then consume.

    Args:
        rows: ``[C]`` int64, the rows of ``grammars`` (all of them consume).
        masked: ``[M]`` int64, the rows the job masks (those not in reasoning), ascending.
    """

    def __init__(self, rows: np.ndarray, grammars: list[RequestGrammar], masked: np.ndarray,
                 job: Future[_Masks], eos_token_ids: tuple[int, ...]) -> None:
        self.rows, self.grammars, self._masked, self._job = rows, grammars, masked, job
        self._eos_token_ids = eos_token_ids

    def mask(self, device: torch.device) -> GrammarMask | None:
        """Wait for the job and move its mask to ``device``; None when every row is still in
        its reasoning (nothing to mask)."""
        done = self._job.result()
        if not len(self._masked):
            return None
        eos_rows = np.repeat(done.eos_only, len(self._eos_token_ids))  # [E]
        eos_ids = np.tile(np.asarray(self._eos_token_ids, dtype=np.int64), len(done.eos_only))

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        return GrammarMask(tensor(self._masked), tensor(done.disallowed), tensor(eos_rows),
                           tensor(eos_ids))

    def consume(self, token_ids: list[int]) -> None:
        """Advance each grammar by its row's sampled token (``RequestGrammar.advance``; after
        ``mask``: the job built the matchers)."""
        for g, token in zip(self.grammars, token_ids, strict=True):
            g.advance(token)

    def broken(self) -> tuple[list[str], list[str]]:
        """The request ids whose grammar broke and is not yet reported, and their messages
        (``RequestGrammar.message``), aligned; each is reported once. After ``consume`` (or
        ``mask``, when the step keeps no token)."""
        ids, messages = [], []
        for g in self.grammars:
            if g.failed and not g.reported:
                g.reported = True
                ids.append(g.request_id)
                messages.append(g.message())
        return ids, messages


class StructuredOutputs:
    """The sampling rank's llguidance state: tokenizer, template cache, per-step masks.

    Args:
        load_tokenizer: returns the model's HF fast tokenizer (called once, on the grammar
            thread, at construction).
        vocab_size: the model's ``V`` (logits width); may exceed the tokenizer's.
        eos_token_ids: the model's EOS ids (the grammar's end; allowed on EOS-only rows).
        cache_size: template matchers kept, least recently used dropped first.
    """

    def __init__(self, load_tokenizer: Callable[[], PreTrainedTokenizerFast], vocab_size: int,
                 eos_token_ids: Sequence[int], cache_size: int = TEMPLATE_CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._cache_size = cache_size
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._unavailable = ""  # why there is no tokenizer (set by _build_tokenizer)
        self._executor = llguidance.LLExecutor()
        words = -(-vocab_size // 32)
        self._eos_bits = np.zeros(words, dtype=np.uint32)  # [W] the EOS ids' bits
        for t in self.eos_token_ids:
            self._eos_bits[t // 32] |= np.uint32(1 << (t % 32))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._ready = self._thread.submit(self._build_tokenizer, load_tokenizer)

    def _build_tokenizer(self, load_tokenizer: Callable[[], PreTrainedTokenizerFast]) -> None:
        t0 = time.perf_counter()
        try:
            tokenizer = load_tokenizer()
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids) or None)
        # (load_tokenizer's errors, and llguidance's ValueError: a vocabulary larger than V)
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            # a model without a (fast) tokenizer still serves everything else
            self._unavailable = f"{type(e).__name__}: {e}"
            log.info("structured outputs unavailable on this worker (%s)", self._unavailable)
            return
        log.info("structured outputs: llguidance tokenizer built in %.2f s",
                 time.perf_counter() - t0)

    def close(self) -> None:
        """Stop the grammar thread (after the queued jobs)."""
        self._thread.shutdown(wait=True)

    # ---- per step ----------------------------------------------------------------------

    def start(self, rows: np.ndarray, grammars: list[RequestGrammar]) -> GrammarStep:
        """Start the mask job of the constrained rows ``rows [C]`` int64 (indices into the
        step's sampled rows) with their ``grammars`` (nothing may consume meanwhile); the rows
        still in their reasoning get no mask."""
        active = [i for i, g in enumerate(grammars) if not g.reasoning]
        job = self._thread.submit(self._fill, grammars, [grammars[i] for i in active])
        return GrammarStep(rows, grammars, rows[active], job, self.eos_token_ids)

    # ---- the grammar thread --------------------------------------------------------------

    def _fill(self, grammars: list[RequestGrammar], masked: list[RequestGrammar]) -> _Masks:
        """The mask job (grammar thread): matchers built (also those still in reasoning: the
        grammar compiles while the model thinks), the bitmasks of ``masked`` filled and
        unpacked."""
        for g in grammars:
            if not g.built:
                self._build_matcher(g)
        words = self._eos_bits.shape[0]
        bitmask = np.zeros((len(masked), words), dtype=np.int32)  # [M, W]
        live = [(g.matcher, i) for i, g in enumerate(masked)
                if g.matcher is not None and not g.matcher.is_stopped()]
        if live:
            fill_next_token_bitmask_par(self._executor, live, bitmask)
            for m, i in live:
                if m.is_error():  # e.g. a parser limit computing the mask
                    masked[i].fail(f"computing the mask failed: {m.get_error()}")
        bits = bitmask.view(np.uint32)
        # EOS-only: stopped, errored or missing matchers (rows left 0) and masks of EOS alone
        eos_only = np.flatnonzero(~np.any(bits & ~self._eos_bits, axis=1))  # [E']
        bits[eos_only] = self._eos_bits
        disallowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size,
                                   bitorder="little") == 0  # [M, V]
        return _Masks(disallowed, eos_only)

    def _build_matcher(self, g: RequestGrammar) -> None:
        """``g``'s matcher: a copy of the grammar's template, advanced by ``g.replay``."""
        g.built = True
        self._ready.result()
        if self._tokenizer is None:
            g.fail(f"this worker has no tokenizer for grammars ({self._unavailable})")
            return
        template = self._templates.get(g.grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer, g.grammar, log_level=0)
            self._templates[g.grammar] = template
            if len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(g.grammar)
        m = g.matcher = template.deep_copy()
        if g.replay:
            m.consume_tokens(g.replay)
            g.replay = []
        if m.is_error():
            g.fail(f"the grammar failed: {m.get_error()}")
