"""Grammars compiled for one tokenizer, cached, and the per-request matcher over them.

``GrammarCache`` turns a ``GrammarSpec`` into an llguidance matcher in its start state,
compiled once per (spec, tokenizer) and kept in an LRU; a request gets a ``deep_copy`` of it
(a copy is microseconds, a compile up to milliseconds for a large schema). A bad schema, regex
or grammar raises ``StructuredSpecError`` naming the request field: the server's 400.

A JSON schema is compiled compact (no whitespace between tokens, as OpenAI's strict mode
writes it) and with default bounds where it gives none (``bounds.py``); a schema whose
bounded form llguidance refuses (an intersection it does not implement) is compiled as given.

``Matcher`` follows one request's output: its tokens are consumed one by one; it says whether
the grammar is complete (``done``: nothing but EOS may follow, so the request ends with
"stop") and why it failed (``error``: a token the grammar refused; that request fails alone).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from disagg.structured.bounds import bound_schema
from disagg.structured.spec import GrammarSpec, StructuredSpecError

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept per tokenizer (each a few KB to a few MB)
# llguidance's JSON options under a schema's own "x-guidance" (which wins): compact JSON, no
# whitespace between tokens (llguidance's default allows any run of blanks there, on which a
# weak model loops until max_tokens).
JSON_DEFAULTS = {"whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise StructuredSpecError(
            "structured_outputs: this server has no grammar engine (pip install "
            "'disagg[serve]' installs llguidance)") from None
    return llguidance


def grammar_text(spec: GrammarSpec, bounded: bool = True) -> str:
    """The llguidance grammar (its JSON form) of ``spec``; ``bounded``: a JSON schema with
    its default bounds (``bounds.bound_schema``), else as given."""
    llg = _llguidance()
    M = llg.LLMatcher
    if spec.kind == "json":
        schema = json.loads(spec.text)
        if bounded:
            schema = bound_schema(schema, spec.string_bound)
        # Defaults, so a schema's own "x-guidance" settings still win (llguidance's rule).
        return M.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return M.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        alts = " | ".join(json.dumps(c) for c in json.loads(spec.text))
        return M.grammar_from_lark(f"start: {alts}")
    from llguidance.gbnf_to_lark import any_to_lark  # GBNF (``::=``) or Lark
    try:
        return M.grammar_from_lark(any_to_lark(spec.text))
    except Exception as e:  # the GBNF converter raises its own errors
        raise StructuredSpecError(f"{spec.field}: invalid grammar: {e}") from None


class GrammarCache:
    """Compiled grammars of one tokenizer (thread-safe: the server validates a request's
    grammar on its thread, the engine builds the matcher on its own)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 capacity: int = CACHE_SIZE) -> None:
        # ``tokenizer``: a ``tokenizers.Tokenizer`` (or its JSON text). ``vocab_size``: the
        # model's logits width (may exceed the tokenizer's vocabulary; ids past it are never
        # allowed).
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._capacity = capacity
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lltok: Any = None
        self.hits = 0
        self.misses = 0

    def lltokenizer(self) -> Any:
        """The llguidance tokenizer, built on first use (~0.3 s for a 49k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                text = (self._tokenizer if isinstance(self._tokenizer, str)
                        else self._tokenizer.to_str())
                self._lltok = llg.LLTokenizer(text, n_vocab=self.vocab_size,
                                              eos_token=self._eos or None)
            return self._lltok

    def compile(self, spec: GrammarSpec) -> Any:
        """The start-state matcher of ``spec`` (shared: copy it before use)."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                self.hits += 1
                return hit
        tok = self.lltokenizer()
        matcher = self._build(tok, spec, bounded=spec.kind == "json")
        if matcher is None or (matcher.is_error() and spec.kind == "json"):
            # the schema as given: its own error, or a grammar without the default bounds
            bounded_error = ("the rewrite failed" if matcher is None
                             else _first_line(matcher.get_error()))
            matcher = self._build(tok, spec, bounded=False)
            assert matcher is not None
            if not matcher.is_error():
                log.warning("%s: schema compiled without default bounds (%s)", spec.field,
                            bounded_error)
        if matcher.is_error():
            raise StructuredSpecError(f"{spec.field}: invalid {spec.kind}: "
                                      f"{_first_line(matcher.get_error())}")
        _refuse_empty(matcher, spec)
        with self._lock:
            self.misses += 1
            self._compiled[spec] = matcher
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return matcher

    @staticmethod
    def _build(tok: Any, spec: GrammarSpec, bounded: bool) -> Any:
        """The matcher of ``spec`` (maybe in its error state); ``bounded``: None when the
        bounded form could not be written (the schema as given then says what is wrong)."""
        try:
            text = grammar_text(spec, bounded)
        except (ValueError, TypeError, RecursionError) as e:  # a malformed schema
            if bounded:
                return None
            raise StructuredSpecError(f"{spec.field}: {e}") from None
        return _llguidance().LLMatcher(tok, text, log_level=0)

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for one request."""
        return Matcher(self.compile(spec).deep_copy())


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
          "grammar": "grammar"}


def _refuse_empty(matcher: Any, spec: GrammarSpec) -> None:
    """Raise when no answer can be written under ``spec``, found on a copy of its start state
    (once per compiled spec; a few ms at most, most of it for a long forced prefix):

    - its first mask allows no token, not even EOS: the language is empty (``start: start``,
      ``root ::= root``, the regex ``[^\\s\\S]``). llguidance compiles such a grammar and
      fails only at that mask;
    - the bytes every answer must start with (llguidance's forced prefix) cannot be consumed:
      a prefix that never ends (``start: "a" start``: empty too) or too long for llguidance
      (its "Too many items" limit), which fails at the first sampled token.

    - a grammar whose ``start`` derives no finite string though every mask allows a token
      (``start: ("a" | "b") start``: its answer would run to ``max_tokens``), found on the
      grammar's rules (``productive.start_unproductive``; only where it is certain).

    Either of the first two was the request's 500 after its first step; now each is its 400
    before it is queued."""
    if spec.kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        from disagg.structured.productive import start_unproductive

        if start_unproductive(any_to_lark(spec.text)):
            raise StructuredSpecError(
                f"{spec.field}: the grammar accepts no string (its start symbol derives no "
                f"finite string: every way through it recurses)")
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise StructuredSpecError(
            f"{spec.field}: the {_NAMES[spec.kind]} accepts no string (no token can start an "
            f"answer: {_first_line(probe.get_error())})")
    forced = probe.compute_ff_tokens()
    if forced and (not probe.consume_token(forced[0]) or probe.is_error()):
        raise StructuredSpecError(
            f"{spec.field}: the {_NAMES[spec.kind]} accepts no string the grammar engine can "
            f"follow (the prefix every answer must start with never ends, or is too long: "
            f"{_first_line(probe.get_error())})")


def _first_line(error: str) -> str:
    """The gist of an llguidance error: its first lines, without the state dump after them."""
    lines = []
    for line in error.strip().splitlines():
        if line.startswith("<") or len(lines) == 4:
            break
        lines.append(line.strip())
    return " ".join(x for x in lines if x) or "error"


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, ll: Any) -> None:
        self.ll = ll
        self.error: str | None = None

    @property
    def done(self) -> bool:
        """The grammar is complete: no token but EOS may follow."""
        return self.error is None and bool(self.ll.is_stopped())

    def consume(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and ``error`` set) when the grammar refuses
        it."""
        if self.error is not None:
            return False
        if not self.ll.consume_token(token_id) or self.ll.is_error():
            self.error = (f"structured output: token {token_id} does not match the grammar: "
                          f"{_first_line(self.ll.get_error())}")
            return False
        return True

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` the grammar would accept in a row from here (nothing is
        consumed): speculative drafts are cut there."""
        if self.error is not None or not token_ids:
            return 0
        return int(self.ll.validate_tokens(list(token_ids)))

    def replay(self, token_ids: Sequence[int]) -> bool:
        """Consume tokens another worker already sampled under this grammar (a generation
        worker continuing a context worker's first token)."""
        return all(self.consume(t) for t in token_ids)
