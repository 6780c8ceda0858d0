"""SQL92 property filters, as RocketMQ's broker evaluates them (``enablePropertyFilter=true``).

A consumer subscribes with an expression over a message's properties (its user properties and system ones such as
``TAGS``): ``region = 'eu' AND a BETWEEN 1 AND 5``. :func:`compile_sql` parses it once (compiled expressions are
cached by text, boundedly) into a predicate over a properties dict; a malformed expression raises
:class:`SqlFilterError` with what is wrong, never anything else.

The grammar and semantics are those of RocketMQ's filter module (its JavaCC ``SelectorParser``, taken from
ActiveMQ's JMS selectors):

* literals: ``'text'`` (``''`` is a quote), integers (a Java long, an ``L`` suffix allowed), decimals (a double:
  ``1.5``, ``.5``, ``5.``, ``1E3``), ``TRUE``, ``FALSE``, ``NULL``; identifiers ``[a-z_$][a-z0-9_$]*``; keywords
  and identifiers' letters in any case (property names keep theirs); ``--`` and ``/* */`` comments;
* ``OR`` < ``AND`` < ``=``, ``<>``, ``IS [NOT] NULL`` < ``>``, ``>=``, ``<``, ``<=``, ``[NOT] BETWEEN``,
  ``[NOT] IN ('a', ...)`` < unary ``+``, ``-``, ``NOT`` (so ``NOT a = 1`` is ``(NOT a) = 1``) < parentheses;
* three-valued logic: a comparison with a missing property is unknown, ``NOT`` of unknown is unknown, and a message
  matches only when the whole expression is TRUE; ``IS NULL`` is true of a missing property;
* a property's value is a string; compared with a number it is read as one (``Long.valueOf`` against an integer,
  ``Double.valueOf`` against a decimal), two strings compare by ``>``, ``<``... as doubles, and a value that does not
  read as a number makes the whole expression fail for that message (RocketMQ logs the error; the message does
  not match);
* refused when compiled: ``>``, ``<``... or ``BETWEEN`` with a string, boolean or NULL literal, ``=`` with NULL, a
  ``BETWEEN`` of literals whose low end is above its high end, ``IN`` after anything but a property or with
  anything but string literals, an expression that is not a condition (``'a'``, ``5``).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

MAX_EXPRESSION = 4096  # characters of an expression
MAX_DEPTH = 64  # nesting of parentheses and unary operators, and comparisons chained (a = b = c)
CACHE_SIZE = 1024  # compiled expressions kept by text

LONG_MIN, LONG_MAX = -(1 << 63), (1 << 63) - 1


class SqlFilterError(ValueError):
    """A malformed or refused SQL92 expression."""


class _EvalError(Exception):
    """A value that RocketMQ fails to convert while evaluating: the message does not match."""


Predicate = Callable[[Mapping[str, str]], bool]

# ---- tokens -----------------------------------------------------------------------------------------------------

_KEYWORDS = frozenset({"NOT", "AND", "OR", "BETWEEN", "IN", "TRUE", "FALSE", "NULL", "IS"})
_TOKEN = re.compile(r"""
    (?P<ws>[ \t\n\r\f]+|--[^\n\r]*(?:\r\n|\n|\r)|/\*[^*]*\*+(?:[^*/][^*]*\*+)*/)
  | (?P<float>[0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)
  | (?P<int>(?:0|[1-9][0-9]*)[lL]?)
  | (?P<str>'(?:''|[^'])*')
  | (?P<id>[a-zA-Z_$][a-zA-Z0-9_$]*)
  | (?P<op><>|>=|<=|[=<>(),+-])
""", re.VERBOSE)


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos, n = 0, len(text)
    while pos < n:
        m = _TOKEN.match(text, pos)
        if m is None:
            raise SqlFilterError(f"unexpected character {text[pos]!r} at {pos}")
        kind, tok = m.lastgroup, m.group()
        pos = m.end()
        if kind == "ws":
            continue
        if kind == "int":
            v = int(tok.rstrip("lL"))
            if v > LONG_MAX:
                raise SqlFilterError(f"integer {tok} is out of the range of a long")
            out.append(("lit", v))
        elif kind == "float":
            out.append(("lit", float(tok)))
        elif kind == "str":
            out.append(("lit", tok[1:-1].replace("''", "'")))
        elif kind == "id":
            up = tok.upper()
            if up in _KEYWORDS:
                out.append(("kw", up))
            else:
                out.append(("id", tok))
        else:
            out.append(("op", tok))
    out.append(("end", None))
    return out


# ---- values -----------------------------------------------------------------------------------------------------
# Values are None (NULL, unknown), bool, int (a Java long), float (a double) and str, as in RocketMQ.

_JAVA_LONG = re.compile(r"[+-]?\d+")
_JAVA_DOUBLE = re.compile(r"[+-]?(?:NaN|Infinity|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[fFdD]?)", re.ASCII)
_JAVA_SPACE = "".join(map(chr, range(33)))  # what String.trim strips


def _to_long(s: str) -> int:
    if _JAVA_LONG.fullmatch(s) is None:
        raise _EvalError(f"{s[:40]!r} is not a long")
    v = int(s)
    if not LONG_MIN <= v <= LONG_MAX:
        raise _EvalError(f"{s[:40]!r} is out of the range of a long")
    return v


def _to_double(s: str) -> float:
    t = s.strip(_JAVA_SPACE)  # as Double.valueOf does
    if _JAVA_DOUBLE.fullmatch(t) is None:
        raise _EvalError(f"{s[:40]!r} is not a double")
    return float(t.rstrip("fFdD").replace("Infinity", "inf"))


def _cmp(a: Any, b: Any) -> int:
    if a < b:
        return -1
    if a > b:
        return 1
    if a == b:
        return 0
    # NaN: Double.compareTo puts it above everything and equal to itself
    return (a != a) - (b != b)


def _kind(v: Any) -> type:
    return bool if isinstance(v, bool) else type(v)


def _compare(lv: Any, rv: Any) -> int:
    """ComparisonExpression.__compare with string conversion on: values of two types are converted to one, or -1."""
    lc, rc = _kind(lv), _kind(rv)
    if lc is not rc:
        if lc is bool:
            if rc is str:
                raise _EvalError("a boolean is not compared with a string")  # a ClassCastException in RocketMQ
            return -1
        if lc is int:
            if rc is float:
                lv = float(lv)
            elif rc is str:
                rv = _to_long(rv)
            else:
                return -1
        elif lc is float:
            if rc is int:
                rv = float(rv)
            elif rc is str:
                rv = _to_double(rv)
            else:
                return -1
        elif lc is str:
            if rc is bool:
                lv = lv.lower() == "true"
            elif rc is int:
                lv = _to_long(lv)
            elif rc is float:
                lv = _to_double(lv)
            else:
                return -1
        else:
            return -1
    return _cmp(lv, rv)


# ---- expressions ------------------------------------------------------------------------------------------------
# An expression is a function of the properties to a value; "boolean" ones (conditions) are marked.

Expr = Callable[[Mapping[str, str]], Any]


class _Node:
    __slots__ = ("fn", "boolean", "const", "prop")

    def __init__(self, fn: Expr, boolean: bool = False, const: bool = False, prop: bool = False) -> None:
        self.fn, self.boolean, self.const, self.prop = fn, boolean, const, prop


def _constant(v: Any) -> _Node:
    return _Node(lambda _p: v, boolean=v is None or isinstance(v, bool), const=True)  # NULL is a boolean constant


def _constant_value(n: _Node) -> Any:
    return n.fn({})


def _as_condition(n: _Node) -> Expr:
    if n.boolean:
        return n.fn
    if n.prop:  # a property as a condition: never a boolean in RocketMQ (its values are strings), so FALSE or unknown
        f = n.fn

        def cast(p: Mapping[str, str]) -> Any:
            v = f(p)
            return None if v is None else v if isinstance(v, bool) else False

        return cast
    raise SqlFilterError("the expression is not a condition")


def _equal(left: _Node, right: _Node) -> _Node:
    lf, rf = left.fn, right.fn

    def eq(p: Mapping[str, str]) -> Any:
        lv, rv = lf(p), rf(p)
        if (lv is None) != (rv is None):
            return None if lv is None else False
        if lv is None or (_kind(lv) is _kind(rv) and lv == rv):
            return True
        return _compare(lv, rv) == 0

    return _Node(eq, boolean=True)


def _not(f: Expr) -> Expr:
    def neg(p: Mapping[str, str]) -> Any:
        v = f(p)
        return None if v is None else not v

    return neg


def _junction(fs: tuple[Expr, ...], decisive: bool) -> Expr:
    """AND (decisive False) or OR (decisive True): the decisive value at the first operand that has it (the rest not
    evaluated), else unknown if one is, else the other value."""
    def junction(p: Mapping[str, str]) -> Any:
        unknown = False
        for f in fs:
            v = f(p)
            if v is decisive:
                return decisive
            unknown = unknown or v is None
        return None if unknown else not decisive

    return junction


def _and(*fs: Expr) -> Expr:
    return _junction(fs, False)


def _or(*fs: Expr) -> Expr:
    return _junction(fs, True)


def _check_ordered(n: _Node, op: str) -> None:
    """Only numbers (or expressions that are not conditions) are compared by >, >=, <, <=."""
    if n.const:
        v = _constant_value(n)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SqlFilterError(f"{_show(n)} cannot be compared by {op}")
    if n.boolean:
        raise SqlFilterError(f"a condition cannot be compared by {op}")


def _show(n: _Node) -> str:
    v = _constant_value(n)
    return "NULL" if v is None else str(v).upper() if isinstance(v, bool) else repr(v)


_ORDER = {">": lambda c: c > 0, ">=": lambda c: c >= 0, "<": lambda c: c < 0, "<=": lambda c: c <= 0}


def _ordered(left: _Node, op: str, right: _Node) -> _Node:
    _check_ordered(left, op)
    _check_ordered(right, op)
    lf, rf, test = left.fn, right.fn, _ORDER[op]

    def order(p: Mapping[str, str]) -> Any:
        lv = lf(p)
        if lv is None:
            return None
        rv = rf(p)
        if rv is None:
            return None
        if type(lv) is str and type(rv) is str:  # two strings: as doubles, else an error
            return test(_cmp(_to_double(lv), _to_double(rv)))
        return test(_compare(lv, rv))

    return _Node(order, boolean=True)


def _negate(n: _Node) -> _Node:
    f = n.fn

    def neg(p: Mapping[str, str]) -> Any:
        v = f(p)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        if isinstance(v, int):
            v = -v
            return v if v <= LONG_MAX else LONG_MIN  # a long's negation wraps
        return -v

    return _Node(neg)


def _in(left: _Node, values: list[str], negated: bool) -> _Node:
    if not left.prop:
        raise SqlFilterError("IN follows a property name")
    f, members = left.fn, frozenset(values)

    def member(p: Mapping[str, str]) -> Any:
        v = f(p)
        if type(v) is not str:
            return None
        return (v in members) != negated

    return _Node(member, boolean=True)


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def peek(self, k: int = 0) -> tuple[str, Any]:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def is_(self, kind: str, value: Any = None, k: int = 0) -> bool:
        t = self.peek(k)
        return t[0] == kind and (value is None or t[1] == value)

    def take(self, kind: str, value: Any = None) -> Any:
        t = self.peek()
        if t[0] != kind or (value is not None and t[1] != value):
            raise SqlFilterError(f"expected {value or kind} at token {self.i + 1}, found {_describe(t)}")
        self.i += 1
        return t[1]

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise SqlFilterError(f"an expression nests at most {MAX_DEPTH} deep")

    def parse(self) -> Expr:
        n = self.or_()
        if not self.is_("end"):
            raise SqlFilterError(f"unexpected {_describe(self.peek())} at token {self.i + 1}")
        return _as_condition(n)

    # a OR b OR c is evaluated as ((a OR b) OR c) is, in one loop (a long chain does not nest calls)
    def or_(self) -> _Node:
        first = self.and_()
        terms = []
        while self.is_("kw", "OR"):
            self.i += 1
            terms.append(_as_condition(self.and_()))
        return _Node(_or(_as_condition(first), *terms), boolean=True) if terms else first

    def and_(self) -> _Node:
        first = self.equality()
        terms = []
        while self.is_("kw", "AND"):
            self.i += 1
            terms.append(_as_condition(self.equality()))
        return _Node(_and(_as_condition(first), *terms), boolean=True) if terms else first

    def chained(self, links: int) -> None:
        if links > MAX_DEPTH:
            raise SqlFilterError(f"an expression nests at most {MAX_DEPTH} deep (comparisons chained)")

    def equality(self) -> _Node:
        left = self.comparison()
        links = 0
        while True:
            links += 1
            self.chained(links)
            if self.is_("op", "=") or self.is_("op", "<>"):
                op = self.take("op")
                right = self.comparison()
                for n in (left, right):
                    if n.const and _constant_value(n) is None:
                        raise SqlFilterError(f"NULL cannot be compared by {op}: use IS NULL")
                if left.const and right.const and left.boolean and not right.boolean:
                    raise SqlFilterError(f"{_show(left)} cannot be compared with {_show(right)}")
                left = _equal(left, right)
                if op == "<>":
                    left = _Node(_not(left.fn), boolean=True)
            elif self.is_("kw", "IS"):
                self.i += 1
                negated = self.is_("kw", "NOT")
                if negated:
                    self.i += 1
                self.take("kw", "NULL")
                left = _equal(left, _constant(None))
                if negated:
                    left = _Node(_not(left.fn), boolean=True)
            else:
                return left

    def comparison(self) -> _Node:
        left = self.unary()
        links = 0
        while True:
            links += 1
            self.chained(links)
            t = self.peek()
            if t[0] == "op" and t[1] in _ORDER:
                self.i += 1
                left = _ordered(left, t[1], self.unary())
            elif self.is_("kw", "BETWEEN") or self.is_("kw", "NOT") and self.is_("kw", "BETWEEN", 1):
                negated = self.is_("kw", "NOT")
                self.i += 2 if negated else 1
                low = self.unary()
                self.take("kw", "AND")
                high = self.unary()
                if negated:
                    left = _Node(_or(_ordered(left, "<", low).fn, _ordered(left, ">", high).fn), boolean=True)
                else:
                    if low.const and high.const:
                        lo, hi = _constant_value(low), _constant_value(high)
                        if lo is None or hi is None:
                            raise SqlFilterError("the ends of BETWEEN cannot be NULL")
                        try:
                            if _compare(hi, lo) < 0:
                                raise SqlFilterError(f"BETWEEN {_show(low)} AND {_show(high)}: the low end is above the high end")
                        except _EvalError as e:
                            raise SqlFilterError(f"the ends of BETWEEN do not compare: {e}") from None
                    left = _Node(_and(_ordered(left, ">=", low).fn, _ordered(left, "<=", high).fn), boolean=True)
            elif self.is_("kw", "IN") or self.is_("kw", "NOT") and self.is_("kw", "IN", 1):
                negated = self.is_("kw", "NOT")
                self.i += 2 if negated else 1
                self.take("op", "(")
                values = [self.string()]
                while self.is_("op", ","):
                    self.i += 1
                    values.append(self.string())
                self.take("op", ")")
                left = _in(left, values, negated)
            else:
                return left

    def string(self) -> str:
        t = self.peek()
        if t[0] != "lit" or type(t[1]) is not str:
            raise SqlFilterError(f"IN lists string literals, found {_describe(t)}")
        self.i += 1
        return t[1]

    def unary(self) -> _Node:
        self.enter()
        try:
            if self.is_("op", "+"):
                self.i += 1
                return self.unary()
            if self.is_("op", "-"):
                self.i += 1
                return _negate(self.unary())
            if self.is_("kw", "NOT"):
                self.i += 1
                return _Node(_not(_as_condition(self.unary())), boolean=True)
            return self.primary()
        finally:
            self.depth -= 1

    def primary(self) -> _Node:
        kind, v = self.peek()
        if kind == "lit":
            self.i += 1
            return _constant(v)
        if kind == "kw" and v in ("TRUE", "FALSE", "NULL"):
            self.i += 1
            return _constant({"TRUE": True, "FALSE": False, "NULL": None}[v])
        if kind == "id":
            self.i += 1
            return _Node(lambda p, name=v: p.get(name), prop=True)
        if kind == "op" and v == "(":
            self.i += 1
            n = self.or_()
            self.take("op", ")")
            return n
        raise SqlFilterError(f"unexpected {_describe((kind, v))} at token {self.i + 1}")


def _describe(t: tuple[str, Any]) -> str:
    kind, v = t
    if kind == "end":
        return "the end of the expression"
    if kind == "lit":
        return "NULL" if v is None else repr(v)
    return str(v)


# ---- compiling --------------------------------------------------------------------------------------------------

_cache: OrderedDict[str, Predicate | SqlFilterError] = OrderedDict()
_cache_lock = threading.Lock()  # front ends on other threads share it


def compile_sql(text: str) -> Predicate:
    """The predicate of a SQL92 expression over a message's properties; SqlFilterError if it is malformed."""
    if not isinstance(text, str):
        raise SqlFilterError("an expression is a string")
    with _cache_lock:
        hit = _cache.get(text)
        if hit is not None:
            _cache.move_to_end(text)
    if hit is None:
        hit = _compile(text)
        with _cache_lock:
            _cache[text] = hit
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
    if isinstance(hit, SqlFilterError):
        raise SqlFilterError(*hit.args)
    return hit


def _compile(text: str) -> Predicate | SqlFilterError:
    if len(text) > MAX_EXPRESSION:
        return SqlFilterError(f"an expression has at most {MAX_EXPRESSION} characters")
    if not text.strip():
        return SqlFilterError("the expression is empty")
    try:
        fn = _Parser(text).parse()
    except SqlFilterError as e:
        return e
    except RecursionError:
        return SqlFilterError(f"an expression nests at most {MAX_DEPTH} deep")

    def matches(props: Mapping[str, str]) -> bool:
        try:
            return fn(props) is True
        except (_EvalError, RecursionError):
            return False

    return matches


def check_sql(text: str) -> str | None:
    """Why an expression does not compile, or None."""
    try:
        compile_sql(text)
    except SqlFilterError as e:
        return str(e)
    return None
