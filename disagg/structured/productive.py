"""Does a Lark grammar's ``start`` derive any finite string? (torch-free)

llguidance compiles a grammar whose language is empty and, when its start branches
(``start: ("a" | "b") start``), never fails: every mask allows a token, no state accepts, and
the answer runs to ``max_tokens``. The classic fixpoint finds it before compiling: a symbol is
*productive* when one of its alternatives is a sequence of productive items (a string or regex
is; an item under ``*``, ``?``, ``[...]`` or ``~ 0..n`` may be absent, so it is; a name is when
its rules are), and a grammar whose ``start`` is not productive accepts no string.

Only a certain answer refuses: ``start_unproductive`` returns False for anything it does not
fully read (llguidance's own extensions: ``%json``, ``%llguidance``, ``@sub``, ``<token>``,
templates ``name{...}``), and treats names it cannot see (imported, declared, undefined) as
productive. GBNF reaches it converted to Lark (``llguidance.gbnf_to_lark.any_to_lark``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RULE_START = re.compile(r"^[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:(?![:=])")
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<alias>->\s*[A-Za-z_][A-Za-z_0-9]*)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<range>\.\.)
  | (?P<number>\d+)
  | (?P<op>[()\[\]|*+?~])
""", re.VERBOSE)


class _Unknown(Exception):
    """A construct this reader does not know: no answer."""


@dataclass(frozen=True)
class _Item:
    """One item of a sequence: a terminal, a name, or a group of alternatives; ``optional``:
    it may derive nothing (``*``, ``?``, ``[...]``, ``~ 0``)."""

    kind: str  # "terminal", "name", "group"
    name: str = ""
    group: tuple[tuple[_Item, ...], ...] = ()
    optional: bool = False


def _strip_comment(line: str) -> str:
    """``line`` without a ``//`` comment (outside strings and regexes)."""
    out, i, quote = [], 0, ""
    while i < len(line):
        c = line[i]
        if quote:
            out.append(c)
            if c == "\\" and i + 1 < len(line):
                out.append(line[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"/" and not (c == "/" and line.startswith("//", i)):
            quote = c
            out.append(c)
        elif line.startswith("//", i):
            break
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _tokens(body: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(body):
        m = _TOKEN.match(body, at)
        if m is None:
            raise _Unknown(body[at:at + 20])
        at = m.end()
        kind = m.lastgroup or ""
        if kind not in ("ws", "alias"):
            out.append((kind, m.group()))
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.t = tokens
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.t[self.i] if self.i < len(self.t) else ("end", "")

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        self.i += 1
        return tok

    def expansions(self, closer: str = "") -> tuple[tuple[_Item, ...], ...]:
        alts = [self.sequence(closer)]
        while self.peek() == ("op", "|"):
            self.take()
            alts.append(self.sequence(closer))
        return tuple(alts)

    def sequence(self, closer: str) -> tuple[_Item, ...]:
        items = []
        while self.peek()[0] != "end" and self.peek() not in (("op", "|"), ("op", closer)):
            items.append(self.item())
        return tuple(items)

    def item(self) -> _Item:
        kind, text = self.take()
        if kind == "string":
            atom = _Item("terminal")
            if self.peek()[0] == "range":  # "a".."z"
                self.take()
                if self.take()[0] != "string":
                    raise _Unknown("range")
        elif kind == "regex":
            atom = _Item("terminal")
        elif kind == "name":
            atom = _Item("name", name=text)
        elif (kind, text) == ("op", "("):
            atom = _Item("group", group=self.expansions(")"))
            if self.take() != ("op", ")"):
                raise _Unknown("(")
        elif (kind, text) == ("op", "["):
            atom = _Item("group", group=self.expansions("]"), optional=True)
            if self.take() != ("op", "]"):
                raise _Unknown("[")
        else:
            raise _Unknown(text)
        kind, text = self.peek()
        if kind == "op" and text in "*?":
            self.take()
            return _Item(atom.kind, atom.name, atom.group, optional=True)
        if kind == "op" and text == "+":
            self.take()
        elif kind == "op" and text == "~":  # item ~ n, item ~ n..m
            self.take()
            k, n = self.take()
            if k != "number":
                raise _Unknown("~")
            if self.peek()[0] == "range":
                self.take()
                if self.take()[0] != "number":
                    raise _Unknown("~")
            if int(n) == 0:
                return _Item(atom.kind, atom.name, atom.group, optional=True)
        return atom


def _rules(text: str) -> tuple[dict[str, list[tuple[tuple[_Item, ...], ...]]], set[str]]:
    """Each defined name's expansions (a name may be defined more than once: all count), and
    the names imported or declared (taken as productive)."""
    bodies: dict[str, list[str]] = {}
    outside: set[str] = set()
    current: str | None = None
    for raw in text.splitlines():
        line = _strip_comment(raw)
        if not line.strip():
            continue
        stripped = line.strip()
        if stripped.startswith("%"):
            words = stripped.split()
            if words[0] == "%ignore" or re.fullmatch(r"%llguidance\s*\{\s*\}", stripped):
                # (an empty options block: what GBNF's conversion writes first)
                current = None
                continue
            if words[0] in ("%import", "%declare"):
                for w in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", stripped[len(words[0]):]):
                    outside.add(w)
                current = None
                continue
            raise _Unknown(words[0])
        m = _RULE_START.match(stripped) if line[:1] not in " \t|" else None
        if m is not None:
            current = m.group(1)
            bodies.setdefault(current, []).append(stripped[m.end():])
        elif current is not None:
            bodies[current][-1] += " " + stripped
        else:
            raise _Unknown(stripped[:20])
    rules = {}
    for name, texts in bodies.items():
        rules[name] = []
        for body in texts:
            p = _Parser(_tokens(body))
            rules[name].append(p.expansions())
            if p.peek()[0] != "end":
                raise _Unknown(p.peek()[1])
    return rules, outside


def start_unproductive(lark: str) -> bool:
    """True when the grammar certainly derives no finite string from ``start``; False when it
    does, or when the grammar uses something this reader does not know (module doc)."""
    try:
        rules, outside = _rules(lark)
    except (_Unknown, IndexError):
        return False
    if "start" not in rules:
        return False
    productive = set(outside)

    def derives(item: _Item) -> bool:
        if item.optional or item.kind == "terminal":
            return True
        if item.kind == "name":
            return item.name in productive or item.name not in rules
        return any(all(derives(i) for i in alt) for alt in item.group)

    changed = True
    while changed:
        changed = False
        for name, definitions in rules.items():
            if name not in productive and any(all(derives(i) for i in alt)
                                              for exps in definitions for alt in exps):
                productive.add(name)
                changed = True
    return "start" not in productive
