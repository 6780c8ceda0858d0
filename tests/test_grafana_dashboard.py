"""The Grafana dashboard (docs/grafana/txmq-dashboard.json) and README's "Metrics" name only series a broker exports.

A broker is started as `txmq broker start --metrics-port` and scraped; the
series it exports are the sample names of the scrape, and for each family
declared by a `# TYPE` line the names its samples take (a counter's
`_total`, a histogram's `_bucket`, `_sum`, `_count`), so a family with no
sample yet (no pending transaction, no producer online) still counts. Every
metric name in the dashboard's PromQL (panel targets and template queries)
must be one of them, and every family the broker exports is on the
dashboard.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from brokerproc import BrokerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "txmq-dashboard.json"
METRIC = re.compile(r"\btxmq_[A-Za-z0-9_]*[A-Za-z0-9]")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[set[str], set[str]]:
    """(series names a running broker's /metrics exports, its metric family names)."""
    port = free_port()
    # with a front-end worker, whose series exist only then
    with BrokerProcess(tmp_path_factory.mktemp("dash") / "data", "--metrics-port", str(port), "--rocketmq-port", str(free_port()),
                       "--frontend-processes", "1") as b:
        deadline = time.monotonic() + 20
        while "event=listening" not in b.log.read_text():
            assert time.monotonic() < deadline, b.log.read_text()
            time.sleep(0.05)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    series, families = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind == "counter":  # prometheus_client writes a counter's TYPE with or without _total, by version
                name = name.removesuffix("_total")
            families.add(name)
            series.update(name + s for s in SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            series.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    assert "txmq_pending_transactions" in series and "txmq_committed_total" in series, text[:2000]
    return series, families


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows' nested panels too) and template variable queries."""
    out = []

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels") or [])

    for p in panels(dashboard["panels"]):
        out += [t["expr"] for t in p.get("targets") or [] if "expr" in t]
    for v in dashboard.get("templating", {}).get("list", []):
        q = v.get("query")
        if v.get("type") == "query":
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def test_the_dashboard_is_a_grafana_dashboard_with_a_query_in_every_panel():
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] and d["uid"] and d["schemaVersion"] >= 30
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "instance"} <= names
    for p in d["panels"]:
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys(), p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert METRIC.search(expr), (p["title"], expr)
            assert '{instance=~"$instance"' in expr, (p["title"], expr)
            for a, b in ("()", "{}", "[]"):
                assert expr.count(a) == expr.count(b), (p["title"], expr)
            assert t["datasource"]["uid"] == "${datasource}"


def test_the_dashboard_queries_only_series_the_broker_exports(exported):
    series, _ = exported
    named = {m for q in queries(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(q)}
    assert named, "the dashboard names no txmq series"
    assert named <= series, f"not exported by the broker: {sorted(named - series)}"


def test_every_family_the_broker_exports_is_on_the_dashboard(exported):
    series, families = exported
    named = {m for q in queries(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(q)}
    shown = {f for f in families if any(m == f or m.startswith(f + "_") and m[len(f):] in ("_total", "_bucket", "_sum", "_count")
                                        for m in named)}
    assert families - shown == set(), f"exported but on no panel: {sorted(families - shown)}"


def test_the_series_readme_names_are_exported(exported):
    series, families = exported
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    named = set(METRIC.findall(section))
    assert "txmq_oldest_pending_age_seconds" in named
    assert named <= series | families, f"README names series the broker does not export: {sorted(named - series - families)}"
