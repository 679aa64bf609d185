"""Regexes whose token masks cannot be bounded, refused before any compile: a repeat of a repeat that can split
one text in more than one way (`([a-z ]*[a-z ]*)*x`, `([a-y ]+)*`, `(a{2,3})+`). xgrammar's matcher keeps every
split alive, so a row's mask cost grows with each generated token (issue 63; at the tiny model's 512 ids, one
row: `([a-y ]+)*x` 0.4 ms at token 50 and 5.7 ms at 200, `([a-y]+[a-y]+)*x` 17 ms at 50 and 217 ms at 100,
`([a-z ]*[a-z ]*)*x` 77 ms at 100 and 337 ms at 223), while an unambiguous nesting stays flat
(`([a-z]+\\.)+[a-z]+x`, `(([a-y]+ )*\\.)*x`: 0.07 ms at 200) and so does a flat ambiguity (`[a-z ]*[a-z ]*x`,
`(a|ab|b)*x`). The runtime mask budget (grammar.Guides) ends whatever this test lets through.

The test, on Python's own parse of the pattern (a pattern it cannot parse is left to xgrammar): a repeat of at
most more than one iteration is ambiguous when its body can match the empty string while holding a repeat, or
when a variable-length repeat that can end the body can also match a character that starts it (the boundary
between two iterations can move). Character classes are approximated (\\w, negations and `.` as any character),
which can only refuse more."""

from __future__ import annotations

import re
import re._constants as C
import re._parser as P
from dataclasses import dataclass
from typing import Any

ANY = ((0, 0x10FFFF),)
_ECMA_CLASS = re.compile(r"\\[pP]\{[^}]*\}")
_CATEGORIES = {
    C.CATEGORY_DIGIT: ((48, 57),),
    C.CATEGORY_SPACE: ((9, 13), (32, 32)),
}
_REPEATS = (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT)
Chars = tuple[tuple[int, int], ...]


class Ambiguous(Exception):
    """The pattern has an ambiguous repeat; str(e): the repeat's text, roughly."""


@dataclass(frozen=True)
class _Info:
    nullable: bool
    first: Chars  # characters a match can start with
    last: Chars  # characters a match can end with
    tail: Chars  # characters of a variable-length repeat that can end a match
    repeats: bool  # holds a repeat of more than one iteration


def _union(*sets: Chars) -> Chars:
    return tuple(sorted({iv for s in sets for iv in s}))


def _overlap(a: Chars, b: Chars) -> bool:
    return any(lo <= hi2 and lo2 <= hi for lo, hi in a for lo2, hi2 in b)


def _class(items: Any) -> Chars:
    out: list[tuple[int, int]] = []
    for op, av in items:
        if op is C.LITERAL:
            out.append((av, av))
        elif op is C.RANGE:
            out.append(av)
        elif op is C.CATEGORY and av in _CATEGORIES:
            out += _CATEGORIES[av]
        else:  # a negation, \w, \S ...: any character (refuses more, never less)
            return ANY
    return tuple(out)


def _item(op: Any, av: Any) -> _Info:
    if op is C.LITERAL:
        return _Info(False, ((av, av),), ((av, av),), (), False)
    if op is C.IN:
        cs = _class(av)
        return _Info(False, cs, cs, (), False)
    if op in (C.AT, C.ASSERT, C.ASSERT_NOT):
        return _Info(True, (), (), (), False)
    if op is C.SUBPATTERN:
        return _seq(av[-1])
    if op is C.ATOMIC_GROUP:
        return _seq(av)
    if op is C.BRANCH:
        parts = [_seq(s) for s in av[1]]
        return _Info(any(p.nullable for p in parts), _union(*(p.first for p in parts)),
                     _union(*(p.last for p in parts)), _union(*(p.tail for p in parts)),
                     any(p.repeats for p in parts))  # fmt: skip
    if op in _REPEATS:
        lo, hi, body = av
        b = _seq(body)
        if hi > 1 and ((b.nullable and b.repeats) or _overlap(b.tail, b.first)):
            raise Ambiguous()
        tail = _union(b.tail, b.last) if lo < hi and hi > 1 else b.tail
        return _Info(lo == 0 or b.nullable, b.first, b.last, tail, b.repeats or hi > 1)
    return _Info(False, ANY, ANY, (), False)  # any character (., a backreference, ...)


def _seq(items: Any) -> _Info:
    infos = [_item(op, av) for op, av in items]
    first: Chars = ()
    for i in infos:
        first = _union(first, i.first)
        if not i.nullable:
            break
    last: Chars = ()
    tail: Chars = ()
    for i in reversed(infos):
        last, tail = _union(last, i.last), _union(tail, i.tail)
        if not i.nullable:
            break
    return _Info(all(i.nullable for i in infos), first, last, tail, any(i.repeats for i in infos))


def ambiguous(pattern: str) -> bool:
    """Does `pattern` hold a repeat whose iterations can split one text in more than one way? False for a
    pattern Python's parser does not read (xgrammar's own syntax: it decides)."""
    try:
        tree = P.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        try:  # ECMAScript syntax Python lacks (JSON schema patterns): \p{..} classes as any character, (?<name>
            tree = P.parse(_ECMA_CLASS.sub(".", pattern).replace("(?<", "(?P<"))
        except (re.error, RecursionError, OverflowError, ValueError):
            return False
    try:
        _seq(tree)
    except Ambiguous:
        return True
    except RecursionError:
        return False
    return False


def schema_patterns(schema: Any) -> list[str]:
    """Every regex of a JSON schema: `pattern` values and `patternProperties` keys, at any depth."""
    out: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                out.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                out += [k for k in node["patternProperties"] if isinstance(k, str)]
            stack += [v for k, v in node.items() if k != "pattern"]
    return out
