"""A picture of the transactions: `txmq spark-export --report FILE.html`.

The figures are computed by Spark (small aggregates; nothing per
transaction reaches the driver) and written as one self-contained HTML
file: inline SVG charts drawn with matplotlib (no JavaScript, no network,
opens anywhere, mails as one file) and every figure again as a text table.
matplotlib is the optional ``report`` extra: without it the report has the
tables only, and says so.
"""

from __future__ import annotations

import html
import io
import json
import zlib
from datetime import datetime, timedelta, timezone
from typing import Any

from .schema import COMMITTED, DISCARD, DISCARDED, PENDING, REPLAYED, ROLLED_BACK

PERCENTILES = (0.5, 0.9, 0.99, 1.0)
WHO = ("producer", "check", "operator", "recovery", "max-checks", "retention")
OUTCOME_ORDER = (COMMITTED, ROLLED_BACK, DISCARDED, REPLAYED, PENDING)
REPLAYED_SINCE = "replayed since"  # a discard whose transaction was put back on the half queue afterwards

# One colour per category, the same in every report whichever categories it has: a name
# means one thing (and one colour) in every chart, whether it is who decided or why the
# broker discarded. Colour-blind safe (Okabe-Ito, then Paul Tol's muted scheme).
COLOURS = {
    # who decided (and, for a discard, why)
    "producer": "#0072b2",
    "check": "#56b4e9",
    "operator": "#e69f00",
    "recovery": "#cc79a7",
    "max-checks": "#d55e00",
    "retention": "#882255",
    "-": "#bbbbbb",  # not decided (pending, replayed)
    "all": "#000000",
    # outcomes
    COMMITTED: "#009e73",
    ROLLED_BACK: "#332288",
    DISCARDED: "#aa4499",
    REPLAYED: "#44aa99",
    PENDING: "#999933",
    REPLAYED_SINCE: "#44aa99",
    "transactions": "#4c72b0",
}
_SPARE = ("#117733", "#ddcc77", "#88ccee", "#661100", "#6699cc", "#aa4466", "#999999", "#8c564b")


def colour(category: str) -> str:
    """The colour of category in every chart (a name not in COLOURS gets one from its name, so it too stays)."""
    return COLOURS.get(category) or _SPARE[zlib.crc32(category.encode()) % len(_SPARE)]


def _order(whos) -> list[str]:
    return sorted(whos, key=lambda w: (WHO.index(w) if w in WHO else len(WHO) + (w == "-"), w))


def figures(messages, transactions) -> dict[str, Any]:
    """The report's numbers from the `messages` (transaction records are enough) and `transactions` DataFrames.

    Every figure counts transactions, each once: outcome_by_who by its outcome
    now, discards_per_hour (hour, reason, outcome now, transactions) by the hour
    of its last discard. So the discards whose outcome is still `discarded` add
    up, reason by reason, to the discarded outcomes; a transaction replayed
    since its discard is there with its outcome now (replayed, or decided again).
    """
    from pyspark.sql import functions as F

    col = F.col
    by_who = [(r["outcome"], r["decided_by"] or "-", r["count"])
              for r in transactions.groupBy("outcome", "decided_by").count().orderBy("outcome", "decided_by").collect()]
    checks = [(r["checks"], r["count"]) for r in transactions.groupBy("checks").count().orderBy("checks").collect()]
    decided = transactions.where(col("time_to_decision_ms").isNotNull())
    pct = F.percentile_approx("time_to_decision_ms", list(PERCENTILES), 10_000)
    overall = decided.agg(pct.alias("p"), F.count(F.lit(1)).alias("n")).collect()[0]
    per_who = decided.groupBy("decided_by").agg(pct.alias("p"), F.count(F.lit(1)).alias("n")).orderBy("decided_by").collect()
    ttd = [("all", overall["n"], list(overall["p"] or []))] + [(r["decided_by"], r["n"], list(r["p"])) for r in per_who]
    last = F.struct(col("stored_at").alias("at"),
                    F.coalesce(col("properties")["TXMQ_DISCARD_REASON"], F.lit("max-checks")).alias("reason"))
    last_discard = (messages.where((col("kind") == DISCARD) & col("tx_id").isNotNull())
                    .groupBy("tx_id").agg(F.max_by(last, col("commit_log_offset")).alias("d")))
    discards = (last_discard.join(transactions.select("tx_id", "outcome"), "tx_id")  # the transactions reported on only
                .groupBy(F.floor(F.unix_seconds(col("d.at")) / 3600).alias("hour"),  # UTC whatever the time zones
                         col("d.reason").alias("reason"), "outcome")
                .count().orderBy("hour", "reason", "outcome").collect())
    over_time = [(datetime.fromtimestamp(r["hour"] * 3600, timezone.utc).isoformat(), r["reason"], r["outcome"], r["count"])
                 for r in discards]
    total = sum(n for _, _, n in by_who)
    return {"transactions": total, "outcome_by_who": by_who, "check_histogram": checks,
            "time_to_decision_ms": ttd, "discards_per_hour": over_time}


def iso_ms(ms: int | None) -> str:
    """ms since the epoch as the CLI shows a time: ISO 8601 in UTC to the millisecond (2026-01-31T12:00:00.250Z)."""
    if ms is None:
        return "-"
    try:
        t = datetime.fromtimestamp(ms / 1000, timezone.utc)
    except (OverflowError, OSError, ValueError):  # beyond what datetime holds: the number itself
        return str(ms)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


# ---- charts -----------------------------------------------------------------------------
def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _count_axis(ax, axis: str = "y") -> None:
    """A count axis: from 0, whole numbers only, thousands separated, room above the highest bar."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    a = ax.yaxis if axis == "y" else ax.xaxis
    a.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    (ax.set_ylim if axis == "y" else ax.set_xlim)(0, max(hi, 1) * 1.12)


def _legend(ax) -> None:
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, frameon=False)


def draw(f: dict[str, Any]) -> dict[str, Any] | None:
    """The charts as matplotlib Figures by section (None for a section with no data); None without matplotlib."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        return None
    with matplotlib.rc_context({"font.size": 9, "svg.fonttype": "none", "svg.hashsalt": "txmq"}):
        return {"outcome_by_who": _outcomes(Figure, f["outcome_by_who"]),
                "check_histogram": _checks(Figure, f["check_histogram"]),
                "time_to_decision_ms": _decision_times(Figure, f["time_to_decision_ms"]),
                "discards_per_hour": _discards(Figure, f["discards_per_hour"])}


def _new(Figure, title: str):
    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.subplots()
    ax.set_title(title)
    return fig, ax


def _outcomes(Figure, rows):
    if not rows:
        return None
    fig, ax = _new(Figure, "Outcome by who decided")
    present = {o for o, _, _ in rows}
    outcomes = [o for o in OUTCOME_ORDER if o in present] + sorted(present - set(OUTCOME_ORDER))
    bottom = [0] * len(outcomes)
    xs = range(len(outcomes))
    for w in _order({w for _, w, _ in rows}):
        vals = [sum(n for o2, w2, n in rows if o2 == o and w2 == w) for o in outcomes]
        ax.bar(xs, vals, bottom=bottom, width=0.6, label="not decided" if w == "-" else w, color=colour(w))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar_label(ax.containers[-1], labels=[f"{b:,}" for b in bottom], fontsize=8, padding=2)  # a small bar is seen
    ax.set_xticks(list(xs), outcomes)
    ax.set_xlim(-0.7, len(outcomes) - 0.3)
    ax.set_ylabel("transactions")
    _count_axis(ax)
    _legend(ax)
    return fig


def _checks(Figure, rows):
    if not rows:
        return None
    fig, ax = _new(Figure, "Check-count histogram")
    xs = range(len(rows))
    bars = ax.bar(xs, [n for _, n in rows], width=0.6, color=colour("transactions"))
    ax.bar_label(bars, labels=[f"{n:,}" for _, n in rows], fontsize=8, padding=2)
    ax.set_xticks(list(xs), [str(c) for c, _ in rows])
    ax.set_xlim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("check-backs spent")
    ax.set_ylabel("transactions")
    _count_axis(ax)
    return fig


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_STYLES = ("-", "--", "-.", ":")


def _decision_times(Figure, rows):
    rows = [(w, n, ps) for w, n, ps in rows if ps and n]
    if not rows:
        return None
    fig, ax = _new(Figure, "Time to decision")
    labels = [f"p{int(p * 100)}" if p < 1 else "max" for p in PERCENTILES]
    m = len(rows)
    step = min(0.08, 0.6 / m)  # series side by side, so equal ones do not hide each other
    for k, (who, n, ps) in enumerate(rows):
        dx = (k - (m - 1) / 2) * step
        ax.plot([i + dx for i in range(len(ps))], ps, color=colour(who), marker=_MARKERS[k % len(_MARKERS)],
                linestyle=_STYLES[k % len(_STYLES)], linewidth=2.2 if who == "all" else 1.4,
                markerfacecolor="none" if k % 2 else colour(who), label=f"{who} ({n:,})")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylabel("ms (log scale)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(0, max(max(ps) for _, _, ps in rows) * 3 + 10)
    _legend(ax)
    return fig


def _discard_category(reason: str, outcome: str) -> str:
    return reason if outcome == DISCARDED else REPLAYED_SINCE


def _discards(Figure, rows):
    if not rows:
        return None
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter, date2num

    hours = {datetime.fromisoformat(h) for h, _, _, _ in rows}
    first, last = min(hours), max(hours)
    daily = last - first > timedelta(days=14)  # beyond two weeks hourly bars are too thin to see: per day
    width = timedelta(days=1) if daily else timedelta(hours=1)
    bins: dict[datetime, dict[str, int]] = {}
    for h, reason, outcome, n in rows:
        t = datetime.fromisoformat(h)
        b = t.replace(hour=0) if daily else t
        c = bins.setdefault(b, {})
        cat = _discard_category(reason, outcome)
        c[cat] = c.get(cat, 0) + n
    fig, ax = _new(Figure, f"Discards per {'day' if daily else 'hour'} (UTC)")
    xs = sorted(bins)
    cats = _order({c for b in bins.values() for c in b} - {REPLAYED_SINCE})
    cats += [REPLAYED_SINCE] if any(REPLAYED_SINCE in b for b in bins.values()) else []
    bottom = [0] * len(xs)
    w = width / timedelta(days=1)
    for cat in cats:
        vals = [bins[x].get(cat, 0) for x in xs]
        ax.bar(date2num(xs), vals, bottom=bottom, width=w, align="edge", color=colour(cat), label=cat,
               linewidth=0, hatch="//" if cat == REPLAYED_SINCE else None)
        bottom = [b + v for b, v in zip(bottom, vals)]
    pad = max(width, (xs[-1] - xs[0]) * 0.03)
    ax.set_xlim(date2num(xs[0] - pad), date2num(xs[-1] + width + pad))
    loc = AutoDateLocator(tz=timezone.utc, minticks=2, maxticks=8)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(loc, tz=timezone.utc))
    ax.set_ylabel(f"transactions discarded per {'day' if daily else 'hour'}")
    _count_axis(ax)
    _legend(ax)
    return fig


def _charts(f: dict[str, Any]) -> dict[str, str | None] | None:
    figs = draw(f)
    if figs is None:
        return None
    import matplotlib

    with matplotlib.rc_context({"font.size": 9, "svg.fonttype": "none", "svg.hashsalt": "txmq"}):
        return {k: (None if fig is None else _svg(fig)) for k, fig in figs.items()}


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r) + "</tr>" for r in rows)
    if not rows:
        trs = f"<tr><td colspan={len(head)}>none</td></tr>"
    return f"<table><tr>{th}</tr>{trs}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}"
    return "-" if v is None else str(v)


_COUNTS = {
    "outcome_by_who": "Each transaction once, by its outcome now and who decided it (- for one not decided: pending or "
                      "replayed).",
    "check_histogram": "Each transaction once, by the check-backs the broker spent on it.",
    "time_to_decision_ms": "Decided transactions (committed, rolled back, discarded), from the first half stored to the "
                           "deciding record stored; all of them, then by who decided.",
}


def _discards_note(f: dict[str, Any]) -> str:
    rows = f["discards_per_hour"]
    still = sum(n for _, _, o, n in rows if o == DISCARDED)
    since = sum(n for _, _, o, n in rows if o != DISCARDED)
    decided = sum(n for o, _, n in f["outcome_by_who"] if o == DISCARDED)
    return (f"Each transaction the broker discarded, once, in the hour (UTC) of its last discard, by reason. "
            f"Still discarded: {still:,} (the discarded outcome above: {decided:,}). Replayed since (put back on the "
            f"half queue after the discard): {since:,}, counted above under their outcome now, the last column here.")


def _source_rows(meta: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for k, v in meta.items():
        if k.endswith("_ms") and (v is None or isinstance(v, int)):  # a time: as the CLI shows one
            k, v = f"{k[:-3]} (UTC)", iso_ms(v)
        rows.append([k, json.dumps(v) if isinstance(v, (list, dict)) else v])
    return rows


def _hour(iso: str) -> str:
    """An hour of the figures (2027-03-04T05:00:00+00:00) as the CLI writes a UTC time: 2027-03-04T05:00:00Z."""
    return iso[:-6] + "Z" if iso.endswith("+00:00") else iso


def render(f: dict[str, Any], title: str, meta: dict[str, Any]) -> str:
    """The report as one HTML document (charts inline when matplotlib is there)."""
    charts = _charts(f)
    labels = [f"p{int(p * 100)}" if p < 1 else "max" for p in PERCENTILES]
    sections = [
        ("Outcome by who decided", "outcome_by_who", _COUNTS["outcome_by_who"],
         _table(["outcome", "decided by", "transactions"], [list(x) for x in f["outcome_by_who"]])),
        ("Check-count histogram", "check_histogram", _COUNTS["check_histogram"],
         _table(["check-backs", "transactions"], [list(x) for x in f["check_histogram"]])),
        ("Time to decision (ms)", "time_to_decision_ms", _COUNTS["time_to_decision_ms"],
         _table(["decided by", "transactions", *labels],
                [[w, n, *(ps or [None] * len(labels))] for w, n, ps in f["time_to_decision_ms"] if n])),
        ("Discards per hour", "discards_per_hour", _discards_note(f),
         _table(["hour (UTC)", "reason", "transactions", "outcome now"],
                [[_hour(h), r, n, o] for h, r, o, n in f["discards_per_hour"]])),
    ]
    body = []
    for head, key, counts, table in sections:
        chart = ""
        if charts is not None:
            svg = charts.get(key)
            chart = f"<div class=chart>{svg}</div>" if svg else "<p class=nodata>No data: nothing to chart.</p>"
        body.append(f"<section id={key}><h2>{html.escape(head)}</h2><p class=counts>{html.escape(counts)}</p>"
                    f"{chart}{table}</section>")
    note = "" if charts is not None else (
        "<p class=note>Charts need matplotlib (pip install 'txmq[report]'); the figures are in the tables.</p>")
    meta_rows = _table(["", ""], _source_rows(meta))
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: .2em .6em; text-align: right; }}
th {{ background: #f3f3f3; }}
.chart svg {{ max-width: 100%; height: auto; }}
.note {{ color: #a50; }}
.counts, .nodata {{ color: #555; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{f["transactions"]:,} transaction{"" if f["transactions"] == 1 else "s"}.</p>
{note}
{"".join(body)}
<h2>Source</h2>{meta_rows}
</body></html>
"""


def text(f: dict[str, Any]) -> str:
    """The same figures as plain text (the CLI prints it with the summary)."""
    lines = [f"{f['transactions']:,} transactions", "outcome by who decided:"]
    lines += [f"  {o:<12} {w:<11} {n:>10,}" for o, w, n in f["outcome_by_who"]]
    lines.append("check-count histogram:")
    lines += [f"  {c:>3} checks {n:>10,}" for c, n in f["check_histogram"]]
    lines.append("time to decision (ms): " + ", ".join(f"p{int(p * 100)}" if p < 1 else "max" for p in PERCENTILES))
    lines += [f"  {w:<11} n={n:<8,} " + " ".join(_fmt(x) for x in ps) for w, n, ps in f["time_to_decision_ms"] if n]
    lines.append("transactions discarded, by hour of their last discard (outcome now):")
    lines += [f"  {h} {r:<11} {n:>8,}  {o}" for h, r, o, n in f["discards_per_hour"]] or ["  none"]
    return "\n".join(lines)
