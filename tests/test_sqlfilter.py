"""SQL92 property filters (broker/messaging/sqlfilter.py): RocketMQ's grammar and three-valued semantics over a
message's properties, refusals of malformed expressions, and the bounds on length and nesting."""

from __future__ import annotations

import pytest

from txmq.broker.messaging import sqlfilter
from txmq.broker.messaging.sqlfilter import MAX_DEPTH, MAX_EXPRESSION, SqlFilterError, check_sql, compile_sql

# a=1..10, region eu for odd a, us for even; one message without either
MESSAGES = [{"TAGS": "t", "a": str(i), "region": "eu" if i % 2 else "us"} for i in range(1, 11)] + [{"TAGS": "other"}]


def matching(expr: str) -> list[int]:
    f = compile_sql(expr)
    return [i for i, props in enumerate(MESSAGES, 1) if f(props)]


@pytest.mark.parametrize("expr, expected", [
    ("a = 3", [3]),
    ("a <> 3", [1, 2, 4, 5, 6, 7, 8, 9, 10]),  # unknown for the message without a: not matched
    ("a > 8", [9, 10]),
    ("a >= 8", [8, 9, 10]),
    ("a < 3", [1, 2]),
    ("a <= 3", [1, 2, 3]),
    ("a BETWEEN 3 AND 5", [3, 4, 5]),
    ("a NOT BETWEEN 3 AND 9", [1, 2, 10]),
    ("region IN ('eu')", [1, 3, 5, 7, 9]),
    ("region NOT IN ('eu', 'x')", [2, 4, 6, 8, 10]),
    ("a IS NULL", [11]),
    ("a IS NOT NULL", list(range(1, 11))),
    ("region = 'eu' AND a > 5", [7, 9]),
    ("region = 'eu' AND a > 5 OR a = 2", [2, 7, 9]),  # AND before OR
    ("region = 'eu' AND (a > 5 OR a = 2)", [7, 9]),
    ("NOT (a > 5)", [1, 2, 3, 4, 5]),  # NOT of unknown is unknown
    ("a > 5 OR a IS NULL", [6, 7, 8, 9, 10, 11]),
    ("TAGS = 'other'", [11]),
    ("a > 2.5 AND a < 4.5", [3, 4]),  # a property against a decimal: read as a double
    ("a >= -1 AND a < +2", [1]),
    ("a = 3.0", [3]),
    ("a = '3'", [3]),
    ("TRUE", list(range(1, 12))),
    ("FALSE OR NULL", []),
    ("a", []),  # a property as a condition: never a boolean
    ("missing = other", list(range(1, 12))),  # two missing properties are equal, as in RocketMQ
    ("a = 1 or A = 2", [1]),  # keywords in any case; property names keep theirs
    ("a = 1 /* one */ OR -- or two\n a = 2", [1, 2]),
    ("region = 'e''u'", []),
    ("a = 5L", [5]),
])
def test_expressions_match_as_rocketmq_evaluates_them(expr, expected):
    assert matching(expr) == expected


@pytest.mark.parametrize("expr, props, expected", [
    ("a > 5", {"a": "x"}, False),  # not a number: the expression fails for the message
    ("a > 5 OR b = 'y'", {"a": "x", "b": "y"}, False),  # ... whatever the rest says
    ("b = 'y' OR a > 5", {"a": "x", "b": "y"}, True),  # unless OR decided before it
    ("a > 5", {"a": "6.5"}, False),  # against an integer: read as a long
    ("a > 5.0", {"a": "6.5"}, True),
    ("a > b", {"a": "10", "b": "9"}, True),  # two strings: compared as doubles
    ("a > b", {"a": "10", "b": "x"}, False),
    ("a = 5", {"a": "x"}, False),
    ("a = 'x'", {"a": "x"}, True),
    ("a = TRUE", {"a": "True"}, True),
    ("a = 9223372036854775807", {"a": "9223372036854775807"}, True),
    ("a > 1", {"a": "99999999999999999999"}, False),  # past a long
    ("a = '\u00e9t\u00e9'", {"a": "\u00e9t\u00e9"}, True),
])
def test_property_values_are_converted_as_rocketmq_does(expr, props, expected):
    assert compile_sql(expr)(props) is expected


@pytest.mark.parametrize("expr", [
    "", "   ", "a >", "a = ", "(a = 1", "a = 1)", "a == 1", "a != 1", "a = NULL", "NULL = a", "a > 'x'", "a > TRUE",
    "a BETWEEN 5 AND 1", "a BETWEEN NULL AND 1", "a BETWEEN 1", "a IN ()", "a IN (1, 2)", "'a' IN ('a')", "a NOT",
    "5", "'text'", "a + 1 > 2", "a LIKE 'x%'", "a = 1 AND", "TRUE = 1", "a = 99999999999999999999", "a = 01",
    "a @ 1", "a = 'unterminated", "(a = 1) > 2",
])
def test_malformed_expressions_are_refused_with_a_reason(expr):
    with pytest.raises(SqlFilterError) as e:
        compile_sql(expr)
    assert str(e.value)
    assert check_sql(expr) == str(e.value)


def test_an_expression_past_the_length_limit_is_refused():
    expr = "a = '" + "x" * MAX_EXPRESSION + "'"
    assert "at most" in check_sql(expr)
    assert check_sql("a = '" + "x" * (MAX_EXPRESSION - 10) + "'") is None


@pytest.mark.parametrize("expr", [
    "(" * 100_000 + "a = 1" + ")" * 100_000,
    "NOT " * 100_000 + "a",
    "a = " + "-" * 100_000 + "1",
])
def test_deep_nesting_is_refused_without_exhausting_the_stack(expr):
    assert "deep" in check_sql(expr[:MAX_EXPRESSION]) or "at most" in check_sql(expr)
    assert check_sql("(" * (MAX_DEPTH - 1) + "a = 1" + ")" * (MAX_DEPTH - 1)) is None


def test_a_chain_of_conditions_as_long_as_the_limit_compiles_and_evaluates():
    expr = " OR ".join(f"a={i}" for i in range(600))[:MAX_EXPRESSION].rsplit(" OR ", 1)[0]
    assert len(expr) > MAX_EXPRESSION - 12
    last = int(expr.rsplit("=", 1)[1])
    f = compile_sql(expr)
    assert f({"a": str(last)}) is True and f({"a": "-1"}) is False and f({}) is False
    g = compile_sql(" AND ".join(["a > 0"] * 400))
    assert g({"a": "1"}) is True and g({"a": "0"}) is False


def test_comparisons_chained_past_the_depth_limit_are_refused():
    assert check_sql("a" + " = a" * 30) is None  # (a = a) = a ...: a condition compared, as RocketMQ parses it
    assert "deep" in check_sql("a" + " = a" * 200)
    assert "deep" in check_sql("a" + " IS NULL" * 200)


def test_compiled_expressions_are_cached_by_text_and_bounded(monkeypatch):
    monkeypatch.setattr(sqlfilter, "CACHE_SIZE", 3)
    sqlfilter._cache.clear()
    f = compile_sql("a = 1")
    assert compile_sql("a = 1") is f
    for i in range(5):
        compile_sql(f"a = {i + 2}")
    assert len(sqlfilter._cache) == 3 and "a = 1" not in sqlfilter._cache
    with pytest.raises(SqlFilterError):
        compile_sql("a >")
    with pytest.raises(SqlFilterError):  # a refusal is cached too, and raised again
        compile_sql("a >")
