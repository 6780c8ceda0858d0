"""The transactions report of `spark-export --report` (spark/report.py), read as an analyst reads it.

The charts are checked on matplotlib's own objects (axis limits, tick
positions, colours, markers) and the page on its HTML, for one event, for a
million and for none. Only the last test starts Spark: the others draw from
the figures dict the report is rendered from.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest

from txmq.spark import report

ONE = {
    "transactions": 1,
    "outcome_by_who": [("discarded", "max-checks", 1)],
    "check_histogram": [(1, 1)],
    "time_to_decision_ms": [("all", 1, [1500.0] * 4), ("max-checks", 1, [1500.0] * 4)],
    "discards_per_hour": [("2027-03-04T05:00:00+00:00", "max-checks", "discarded", 1)],
}
MANY = {
    "transactions": 1_000_000,
    "outcome_by_who": [("committed", "producer", 700_000), ("committed", "check", 150_000),
                       ("rolled_back", "operator", 120_000), ("discarded", "max-checks", 29_000), ("replayed", "-", 1_000)],
    "check_histogram": [(0, 820_000), (1, 150_000), (2, 10_000), (15, 20_000)],
    "time_to_decision_ms": [("all", 999_000, [12.0, 90.0, 3000.0, 60000.0]), ("check", 150_000, [6e3, 9e3, 3e4, 6e4]),
                            ("operator", 120_000, [12.0, 90.0, 3000.0, 60000.0]), ("producer", 700_000, [10.0, 50.0, 200.0, 900.0])],
    "discards_per_hour": [(f"2027-03-04T{h:02d}:00:00+00:00", r, o, 1_000 + h)
                          for h in range(24) for r, o in (("max-checks", "discarded"), ("max-checks", "replayed"))],
}
NONE = {"transactions": 0, "outcome_by_who": [], "check_histogram": [], "time_to_decision_ms": [("all", 0, [])],
        "discards_per_hour": []}
COUNT_CHARTS = ("outcome_by_who", "check_histogram", "discards_per_hour")


@pytest.fixture
def mpl():
    return pytest.importorskip("matplotlib")


def _ax(figs, key):
    (ax,) = figs[key].axes
    return ax


def test_one_discard_is_drawn_within_hours_of_it_from_zero_to_just_above_one(mpl):
    from matplotlib.dates import num2date

    ax = _ax(report.draw(ONE), "discards_per_hour")
    lo, hi = (num2date(x) for x in ax.get_xlim())
    at = datetime(2027, 3, 4, 5, tzinfo=timezone.utc)
    assert at - timedelta(hours=2) <= lo < at and at + timedelta(hours=1) < hi <= at + timedelta(hours=3)
    y0, y1 = ax.get_ylim()
    assert y0 == 0 and 1 < y1 < 1.5
    (bar,) = ax.patches
    assert (bar.get_height(), num2date(bar.get_x())) == (1, at)


@pytest.mark.parametrize("f", [ONE, MANY], ids=["one", "a-million"])
def test_count_axes_have_whole_number_ticks_from_zero(mpl, f):
    figs = report.draw(f)
    for key in COUNT_CHARTS:
        ax = _ax(figs, key)
        y0, y1 = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if y0 <= t <= y1]
        assert y0 == 0 and len(ticks) >= 2, key
        assert all(t == int(t) for t in ticks), (key, ticks)
        figs[key].canvas.draw()
        assert ax.yaxis.get_offset_text().get_text() == "", key  # no "1e6" multiplier in a corner


def test_a_million_is_labelled_with_thousands_separators(mpl):
    figs = report.draw(MANY)
    ax = _ax(figs, "outcome_by_who")
    figs["outcome_by_who"].canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert any(re.fullmatch(r"\d{1,3}(,\d{3})+", s) for s in labels), labels
    assert [t.get_text() for t in ax.texts] == ["850,000", "120,000", "29,000", "1,000"]  # each bar's total


@pytest.mark.parametrize("f", [ONE, MANY], ids=["one", "a-million"])
def test_bars_keep_clear_of_the_frame(mpl, f):
    figs = report.draw(f)
    for key in COUNT_CHARTS:
        ax = _ax(figs, key)
        (x0, x1), (_, y1) = ax.get_xlim(), ax.get_ylim()
        for p in ax.patches:
            assert x0 < p.get_x() and p.get_x() + p.get_width() < x1, key
            assert p.get_y() + p.get_height() < y1 * 0.95, key


def _colours(ax) -> dict[str, str]:
    from matplotlib.colors import to_hex

    return {c.get_label(): to_hex(c.patches[0].get_facecolor()) for c in ax.containers}


def test_each_category_has_the_same_colour_in_reports_with_different_categories(mpl):
    a = {**ONE, "outcome_by_who": [("committed", "producer", 5), ("rolled_back", "operator", 2)]}
    b = {**ONE, "outcome_by_who": [("committed", "check", 5), ("discarded", "max-checks", 1), ("rolled_back", "operator", 3),
                                   ("committed", "a-new-kind", 1)]}
    ca, cb = (_colours(_ax(report.draw(f), "outcome_by_who")) for f in (a, b))
    assert ca["operator"] == cb["operator"] == report.COLOURS["operator"]
    assert cb["max-checks"] == report.COLOURS["max-checks"] != ca["producer"]
    assert cb["a-new-kind"] == report.colour("a-new-kind")
    assert len(set(cb.values())) == len(cb)
    # a discard reason has the colour of the same name as who decided
    assert _colours(_ax(report.draw(b), "discards_per_hour"))["max-checks"] == cb["max-checks"]
    named = {k: v for k, v in report.COLOURS.items() if k != "replayed since"}
    assert len(set(named.values())) == len(named)  # no two categories share a colour
    page = report.render(b, "t", {})
    assert report.COLOURS["operator"].lower() in page.lower()  # the SVG is filled with it


def test_series_with_equal_values_stay_distinguishable(mpl):
    ax = _ax(report.draw(MANY), "time_to_decision_ms")
    lines = {ln.get_label().split(" ")[0]: ln for ln in ax.get_lines()}
    everyone, operator = lines["all"], lines["operator"]
    assert list(everyone.get_ydata()) == list(operator.get_ydata())
    assert all(a != b for a, b in zip(everyone.get_xdata(), operator.get_xdata()))  # side by side, not on top
    styles = [(ln.get_marker(), ln.get_linestyle()) for ln in lines.values()]
    assert len({m for m, _ in styles}) == len(styles)
    assert all(abs(x - round(x)) < 0.3 for ln in lines.values() for x in ln.get_xdata())  # still at their percentile


def test_a_span_of_months_is_drawn_per_day(mpl):
    start = datetime(2027, 1, 1, tzinfo=timezone.utc)
    f = {**ONE, "discards_per_hour": [((start + timedelta(hours=h)).isoformat(), "retention", "discarded", 1)
                                      for h in range(0, 24 * 90, 5)]}
    ax = _ax(report.draw(f), "discards_per_hour")
    assert ax.get_title() == "Discards per day (UTC)"
    assert len(ax.patches) == 90 and sum(p.get_height() for p in ax.patches) == len(f["discards_per_hour"])


def test_a_day_without_transactions_draws_no_chart_and_says_so(mpl):
    figs = report.draw(NONE)
    assert figs == dict.fromkeys(figs) and len(figs) == 4
    page = report.render(NONE, "t", {})
    assert "<svg" not in page and page.count("No data: nothing to chart.") == 4
    assert "<td colspan=3>none</td>" in page


def test_without_matplotlib_the_report_has_its_tables_and_says_so(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = report.render(ONE, "t", {})
    assert "<svg" not in page and "pip install 'txmq[report]'" in page and "No data" not in page
    assert "<td>max-checks</td>" in page


def test_the_source_table_shows_times_in_iso_8601_utc():
    page = report.render(NONE, "t", {"source": "/data", "since_ms": 1_700_000_000_250, "until_ms": None})
    source = page.split("<h2>Source</h2>")[1]
    assert "<td>since (UTC)</td><td>2023-11-14T22:13:20.250Z</td>" in source
    assert "<td>until (UTC)</td><td>-</td>" in source
    assert "_ms" not in source and "1,700,000,000,250" not in source


def test_the_discard_section_says_what_it_counts_and_adds_up_with_the_outcomes():
    f = {**ONE, "outcome_by_who": [("discarded", "max-checks", 1), ("replayed", "-", 1)],
         "discards_per_hour": [("2027-03-04T05:00:00+00:00", "max-checks", "discarded", 1),
                               ("2027-03-04T05:00:00+00:00", "max-checks", "replayed", 1)]}
    page = report.render(f, "t", {})
    assert "Still discarded: 1 (the discarded outcome above: 1). Replayed since" in page
    assert "<td>2027-03-04T05:00:00Z</td><td>max-checks</td><td>1</td><td>replayed</td>" in page
    assert "replayed" in report.text(f).splitlines()[-1]


# ---- the figures, from a small log -----------------------------------------------------
def _records(spark, rows):
    from txmq.spark.schema import MESSAGE_COLUMNS

    names = [n for n, _, _ in MESSAGE_COLUMNS]
    t0 = datetime(2027, 3, 4, 5, 10, tzinfo=timezone.utc)
    full = []
    for off, (tx, kind, minutes, props) in enumerate(rows):
        at = t0 + timedelta(minutes=minutes)
        topic = {"half": "RMQ_SYS_TRANS_HALF_TOPIC", "discard": "TRANS_CHECK_MAX_TIME_TOPIC"}.get(kind, "RMQ_SYS_TRANS_OP_HALF_TOPIC")
        full.append((off, 100, topic, 0, off, kind, "shop", tx, "orders", 0, None, None, props, b"", at, at, 1, None))
    schema = ", ".join(f"{n} {t}" for n, t, _ in MESSAGE_COLUMNS)
    return spark.createDataFrame([dict(zip(names, r)) for r in full], schema)


@pytest.mark.spark
def test_a_transaction_discarded_then_replayed_is_counted_alike_in_outcomes_and_discards(spark):
    from txmq.spark.transactions import transactions

    messages = _records(spark, [
        ("kept", "half", 0, {}), ("kept", "discard", 60, {}),  # discarded, stays so
        ("back", "half", 1, {}), ("back", "discard", 61, {"TXMQ_DISCARD_REASON": "retention"}),
        ("back", "half", 90, {"TXMQ_REPLAYED": "3"}),  # replayed: pending again
        ("again", "half", 2, {}), ("again", "discard", 62, {}), ("again", "half", 91, {"TXMQ_REPLAYED": "6"}),
        ("again", "op", 120, {"TXMQ_DECIDED_BY": "operator"}),  # replayed, then committed
        ("plain", "half", 3, {}), ("plain", "op", 4, {}),
    ])
    f = report.figures(messages, transactions(messages))
    assert sorted(f["outcome_by_who"]) == [("committed", "operator", 1), ("committed", "producer", 1),
                                           ("discarded", "max-checks", 1), ("replayed", "-", 1)]
    assert f["discards_per_hour"] == [("2027-03-04T06:00:00+00:00", "max-checks", "committed", 1),
                                      ("2027-03-04T06:00:00+00:00", "max-checks", "discarded", 1),
                                      ("2027-03-04T06:00:00+00:00", "retention", "replayed", 1)]
    still = {(r, n) for _, r, o, n in f["discards_per_hour"] if o == "discarded"}
    assert still == {(w, n) for o, w, n in f["outcome_by_who"] if o == "discarded"}
    # a transaction left out of the report (here: by topic) is left out of both
    f2 = report.figures(messages, transactions(messages).where("tx_id != 'back'"))
    assert [r[1:3] for r in f2["discards_per_hour"]] == [("max-checks", "committed"), ("max-checks", "discarded")]
