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
from datetime import datetime, timezone
from typing import Any

from .schema import DISCARD, TX_KINDS

PERCENTILES = (0.5, 0.9, 0.99, 1.0)
WHO = ("producer", "check", "operator", "recovery", "max-checks", "retention")


def figures(messages, transactions) -> dict[str, Any]:
    """The report's numbers from the `messages` (transaction records are enough) and `transactions` DataFrames."""
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
    discards = (messages.where(col("kind") == DISCARD)
                .groupBy(F.date_trunc("hour", col("stored_at")).alias("hour"),
                         F.coalesce(col("properties")["TXMQ_DISCARD_REASON"], F.lit("max-checks")).alias("reason"))
                .count().orderBy("hour", "reason").collect())
    over_time = [(r["hour"].replace(tzinfo=timezone.utc).isoformat() if r["hour"].tzinfo is None else r["hour"].isoformat(),
                  r["reason"], r["count"]) for r in discards]
    total = sum(n for _, _, n in by_who)
    return {"transactions": total, "outcome_by_who": by_who, "check_histogram": checks,
            "time_to_decision_ms": ttd, "discards_per_hour": over_time}


def tx_records(df):
    """The records the report needs from a `messages` DataFrame."""
    from pyspark.sql import functions as F

    return df.where(F.col("kind").isin(*TX_KINDS))


# ---- HTML -----------------------------------------------------------------------------
def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _charts(f: dict[str, Any]) -> dict[str, str] | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    charts = {}
    plt.rcParams.update({"figure.figsize": (6.4, 3.2), "font.size": 9, "svg.fonttype": "none"})

    fig, ax = plt.subplots()
    outcomes = sorted({o for o, _, _ in f["outcome_by_who"]})
    whos = sorted({w for _, w, _ in f["outcome_by_who"]}, key=lambda w: (WHO.index(w) if w in WHO else 99, w))
    bottom = [0] * len(outcomes)
    for w in whos:
        vals = [sum(n for o2, w2, n in f["outcome_by_who"] if o2 == o and w2 == w) for o in outcomes]
        ax.bar(outcomes, vals, bottom=bottom, label=w)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("transactions")
    ax.set_title("Outcome by who decided")
    if whos:
        ax.legend(fontsize=8)
    charts["outcome_by_who"] = _svg(fig)
    plt.close(fig)

    fig, ax = plt.subplots()
    ax.bar([str(c) for c, _ in f["check_histogram"]], [n for _, n in f["check_histogram"]], color="#4c72b0")
    ax.set_xlabel("check-backs spent")
    ax.set_ylabel("transactions")
    ax.set_title("Check-count histogram")
    charts["check_histogram"] = _svg(fig)
    plt.close(fig)

    fig, ax = plt.subplots()
    labels = [f"p{int(p * 100)}" if p < 1 else "max" for p in PERCENTILES]
    for who, n, ps in f["time_to_decision_ms"]:
        if ps:
            ax.plot(labels, ps, marker="o", label=f"{who} ({n})")
    ax.set_ylabel("ms")
    ax.set_yscale("symlog")
    ax.set_title("Time to decision")
    if f["time_to_decision_ms"] and f["time_to_decision_ms"][0][2]:
        ax.legend(fontsize=8)
    charts["time_to_decision_ms"] = _svg(fig)
    plt.close(fig)

    fig, ax = plt.subplots()
    reasons = sorted({r for _, r, _ in f["discards_per_hour"]})
    hours = sorted({h for h, _, _ in f["discards_per_hour"]})
    xs = [datetime.fromisoformat(h) for h in hours]
    for reason in reasons:
        ax.plot(xs, [sum(n for h2, r2, n in f["discards_per_hour"] if h2 == h and r2 == reason) for h in hours],
                marker="o", label=reason)
    ax.set_ylabel("discards per hour")
    ax.set_title("Discards over time (UTC)")
    if reasons:
        ax.legend(fontsize=8)
    fig.autofmt_xdate()
    charts["discards_per_hour"] = _svg(fig)
    plt.close(fig)
    return charts


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def _fmt(v: Any) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}"
    return "-" if v is None else str(v)


def render(f: dict[str, Any], title: str, meta: dict[str, Any]) -> str:
    """The report as one HTML document (charts inline when matplotlib is there)."""
    charts = _charts(f)
    labels = [f"p{int(p * 100)}" if p < 1 else "max" for p in PERCENTILES]
    sections = [
        ("Outcome by who decided", "outcome_by_who", _table(["outcome", "decided by", "transactions"],
                                                            [list(x) for x in f["outcome_by_who"]])),
        ("Check-count histogram", "check_histogram", _table(["check-backs", "transactions"],
                                                            [list(x) for x in f["check_histogram"]])),
        ("Time to decision (ms, first half stored to deciding record stored)", "time_to_decision_ms",
         _table(["decided by", "transactions", *labels], [[w, n, *(ps or [None] * len(labels))] for w, n, ps in f["time_to_decision_ms"]])),
        ("Discards per hour", "discards_per_hour", _table(["hour (UTC)", "reason", "discards"],
                                                         [list(x) for x in f["discards_per_hour"]])),
    ]
    body = []
    for head, key, table in sections:
        chart = charts.get(key, "") if charts else ""
        body.append(f"<section><h2>{html.escape(head)}</h2><div class=chart>{chart}</div>{table}</section>")
    note = "" if charts is not None else (
        "<p class=note>Charts need matplotlib (pip install 'txmq[report]'); the figures are in the tables.</p>")
    meta_rows = _table(["", ""], [[k, json.dumps(v) if isinstance(v, (list, dict)) else v] for k, v in meta.items()])
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: .2em .6em; text-align: right; }}
th {{ background: #f3f3f3; }}
.chart svg {{ max-width: 100%; height: auto; }}
.note {{ color: #a50; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{f["transactions"]:,} transactions.</p>
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
    lines += [f"  {w:<11} n={n:<8,} " + " ".join(_fmt(x) for x in ps) for w, n, ps in f["time_to_decision_ms"]]
    lines.append("discards per hour:")
    lines += [f"  {h} {r:<11} {n:>8,}" for h, r, n in f["discards_per_hour"]] or ["  none"]
    return "\n".join(lines)
