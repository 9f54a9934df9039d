"""``structured.productive.start_unproductive``: a grammar whose start derives no finite string
is found (only where certain); everything it cannot read fully is left to llguidance."""

from __future__ import annotations

import pytest

from disagg.structured.productive import start_unproductive

llguidance = pytest.importorskip("llguidance")


@pytest.mark.parametrize(("lark", "empty"), [
    ('start: ("a" | "b") start', True),
    ('start: "a" start | "b"', False),
    ('start: "a" start', True),
    ("start: start", True),
    ('start: item+\nitem: "a" | "(" start ")"', False),
    ('start: a\na: b\nb: a | "c"', False),
    ("start: a\na: b\nb: a", True),
    ("start: x*\nx: x", False),  # x may be absent
    ('start: [x] "y"\nx: x', False),
    ('start: ("a" start) ~ 0..2', False),
    ('start: "a" ~ 3 start', True),
    ('start: "a".."z" start', True),
    ('?start: expr\nexpr: expr "+" term | term\nterm: /[0-9]+/', False),
    ('?start: expr\nexpr: expr "+" term\nterm: /[0-9]+/', True),
    ('start: x\n    | "b"\nx: "c" x', False),  # a continuation line's alternative
    ('start: "a"+ // start: start', False),  # a comment
    ('start: "//" start', True),  # not a comment: a string
    ("start: x\nx: y\nx: \"z\"", False),  # a name defined twice: both count
    # names it cannot see are taken as productive; constructs it does not know: no answer
    ("start: WORD start | WORD\n%import common.WORD", False),
    ("start: UNDEFINED", False),
    ('start: %json {"type": "object"}', False),
    ("start: foo{x}", False),
    ('%llguidance {"no_forcing": true}\nstart: start', False),
    ("rule: start", False),  # no start rule
])
def test_start_unproductive(lark: str, empty: bool) -> None:
    assert start_unproductive(lark) is empty


@pytest.mark.parametrize(("gbnf", "empty"), [
    ('root ::= ("a" | "b") root', True),
    ('root ::= "a" | "b" root', False),
    ('root ::= [a-z]+ ws\nws ::= [ \\t]*', False),
    ('root ::= "{" root "}"', True),
])
def test_gbnf_through_its_lark_conversion(gbnf: str, empty: bool) -> None:
    from llguidance.gbnf_to_lark import any_to_lark

    assert start_unproductive(any_to_lark(gbnf)) is empty
