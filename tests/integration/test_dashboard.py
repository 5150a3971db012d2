"""The operators' view (docs/DASHBOARD.md): the web dashboard in headless Chromium against a
real control plane and a real edge, its admin API, and the Grafana dashboard's PromQL
against the metric names the two services really export.

The browser test does what a person does: opens ``/dashboard/``, is asked for a token,
types a wrong one, then a project's (not an operator's), then the admin token, and reads
what the page shows — sandbox ids and states, quota figures, the edge's row, the create
and error counts — while sandboxes are made and refused; then opens one sandbox's
detail (limits, use, events). ``DSEC_SCREENSHOTS=docs/img`` writes the screenshots the
docs show (``dashboard.png``, ``dashboard-sandbox.png``); otherwise they go to the
test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_control_support as support
from chromium import Page, chromium_page
from prometheus_client.parser import text_string_to_metric_families

from conftest import edge_config

pytestmark = [pytest.mark.root, pytest.mark.anyio]

anyio_backend = support.anyio_backend
REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "docs" / "grafana" / "dsec.json"
MiB = 1 << 20
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"},
                        "resources": {"cpu": 0.25, "memory": 64 * MiB, "disk": 16 * MiB}}
XSS = '<img src=x onerror="window.__xss=1">'


@dataclass
class Stack:
    url: str
    admin: httpx.AsyncClient
    edge: Any
    edge_id: str
    key: bytes


@asynccontextmanager
async def stack(dsec_base: Path, tmp_path: Path, suffix: str, edge_id: str) -> AsyncIterator[Stack]:
    """A real control plane and one real edge that has registered with it."""
    from dsec.control import ControlConfig, serve_control
    from dsec.edge.testing import EdgeThread, leftovers

    key = secrets.token_bytes(32)
    ctl = await serve_control(ControlConfig(data_dir=tmp_path / "control", cluster_key=key, port=0,
                                            watcher=False, auth_cache_s=0.0))
    cfg = edge_config(dsec_base, suffix, edge_id, key, max_sandboxes=8, control_plane_url=ctl.url,
                      heartbeat_interval_s=0.2, watchdog_interval_s=0.5)
    edge = None
    try:
        edge = await asyncio.to_thread(lambda: EdgeThread(cfg).start())
        async with httpx.AsyncClient(base_url=ctl.url, timeout=60,
                                     headers={"authorization": f"Bearer {ctl.admin_token}"}) as admin:
            for _ in range(200):  # the edge registers itself with its first heartbeat
                edges = (await admin.get("/v1/edges")).json()
                if edges and edges[0]["health"]:
                    break
                await asyncio.sleep(0.05)
            assert edges and edges[0]["id"] == edge_id, edges
            try:
                yield Stack(ctl.url, admin, edge, edge_id, key)
            finally:
                await admin.delete("/v1/sandboxes", params={"all": "true"})
    finally:
        if edge is not None:
            await asyncio.to_thread(edge.stop)
        await ctl.stop()
    assert not leftovers(cfg), leftovers(cfg)


def shots_dir(tmp_path: Path) -> Path:
    where = os.environ.get("DSEC_SCREENSHOTS")
    return (REPO / where) if where else tmp_path


async def create(c: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await c.post("/v1/sandboxes", json={"spec": SPEC, **body})


async def row_text(page: Page, table: str, attr: str, value: str) -> str:
    return await page.text(f'#{table} tr[data-{attr}="{value}"]')


async def test_dashboard_in_a_browser(dsec_base: Path, tmp_path: Path) -> None:
    async with stack(dsec_base, tmp_path, "dash", "dash") as st:
        a = st.admin
        # a project with a quota, its own token, a task with a ceiling
        r = await a.post("/v1/projects", json={"name": "team-a", "quota": {"sandboxes": 3, "cpu": 2, "memory": 1 << 30}})
        assert r.status_code == 201, r.text
        team_token = (await a.post("/v1/tokens", json={"project": "team-a", "name": "ci"})).json()["token"]
        async with httpx.AsyncClient(base_url=st.url, timeout=60, headers={"authorization": f"Bearer {team_token}"}) as team:
            r = await team.post("/v1/tasks", json={"name": "rollouts", "quota": {"sandboxes": 3}})
            assert r.status_code == 201, r.text
            made = []
            for i in range(3):
                r = await create(team, task="rollouts", labels={"job": "rl-7", "note": XSS if i == 0 else f"n{i}"},
                                 lifecycle={"ttl_s": 3600})
                assert r.status_code == 201, r.text
                made.append(r.json())
            refused = await create(team, task="rollouts")  # the 4th: over the project's quota
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "quota_exceeded", refused.text
        r = await create(a, labels={"job": "eval"})
        assert r.status_code == 201, r.text
        made.append(r.json())
        # something to see in the event log
        first = made[0]
        async with httpx.AsyncClient(base_url=first["edge_url"], timeout=60,
                                     headers={"authorization": f"Bearer {first['token']}"}) as data:
            r = await data.post(f"/v1/sandboxes/{first['id']}/exec", json={"cmd": ["sh", "-c", "echo hello"]})
            assert r.status_code == 200, r.text

        async with chromium_page() as page:
            await page.goto(st.url + "/dashboard")  # redirected to /dashboard/
            assert await page.eval("location.pathname") == "/dashboard/"
            assert await page.visible("#login") and not await page.visible("#main")
            assert "Admin token" in await page.text("#login")

            # a wrong token, then a project's own token: refused, with the reason shown
            await page.type("#token", "dsk_not-a-token")
            await page.press_enter()
            await page.wait_text("#login-error", "auth_error")
            await page.type("#token", team_token)
            await page.click("#open")
            await page.wait_text("#login-error", "forbidden")
            assert not await page.visible("#main")
            assert await page.eval("sessionStorage.length") == 0
            assert all("401" in line or "403" in line for line in page.console), page.console  # those two answers
            page.console.clear()

            # the admin token: the dashboard
            admin_token = a.headers["authorization"].split()[1]
            await page.type("#token", admin_token)
            await page.click("#open")
            await page.wait_for("document.querySelectorAll('#sandboxes-table tbody tr').length === 4",
                                what="4 sandbox rows")
            assert not await page.visible("#login")
            assert await page.eval("document.getElementById('token').value") == ""
            assert await page.eval(f"sessionStorage.getItem('dsec.dashboard.token') === {json.dumps(admin_token)}")

            for sb in made:  # every sandbox, running, with its project, task and edge
                row = await row_text(page, "sandboxes-table", "id", sb["id"])
                assert "running" in row and st.edge_id in row, row
                assert ("team-a" in row and "rollouts" in row) if sb["project"] == "team-a" else "root" in row, row
                assert "64 MiB" in row and "16 MiB" in row, row
            xss_row = await row_text(page, "sandboxes-table", "id", made[0]["id"])
            assert XSS in xss_row, xss_row  # shown as text, never run as markup
            assert await page.eval("window.__xss === undefined")

            # quotas: team-a is full (3 of 3 sandboxes), root has carved it out
            team_row = await row_text(page, "projects-table", "project", "team-a")
            assert "3 / 3" in team_row and "0.75 / 2" in team_row and "192 MiB / 1 GiB" in team_row, team_row
            root_row = await row_text(page, "projects-table", "project", "root")
            assert "3 sandboxes, 2 cores, 1 GiB" in root_row, root_row
            task_row = await row_text(page, "tasks-table", "task", "team-a/rollouts")
            assert "rollouts" in task_row and "3 / 3" in task_row, task_row

            # the edge and its load: 4 of 8 sandboxes, alive
            edge_row = await row_text(page, "edges-table", "edge", st.edge_id)
            assert "alive" in edge_row and "4 / 8" in edge_row and st.edge.url in edge_row, edge_row
            assert (await page.text("#edges-alive")).strip() == "1 / 1"

            # this replica's creates: 4 made, 1 refused (quota_exceeded, by team-a)
            await page.wait_text("#creates-total", "4")
            assert (await page.text("#failed-total")).strip() == "1"
            errors = await page.text("#errors-table")
            assert "quota_exceeded" in errors and "team-a" in errors and "403" in errors, errors
            assert "running 4" in await page.text("#state-counts")

            shots = shots_dir(tmp_path)
            await page.eval("window.scrollTo(0, 0)")
            await page.screenshot(shots / "dashboard.png")

            # the create count moves while the page is open (no reload): two more, in one batch
            r = await a.post("/v1/sandboxes/batch", json={"spec": SPEC, "count": 2, "labels": {"job": "batch"}})
            assert r.status_code == 200 and all(i["sandbox"] for i in r.json()["items"]), r.text
            await page.wait_for("document.getElementById('creates-total').innerText.trim() === '6'",
                                what="the create count to reach 6")
            await page.wait_for("parseFloat(document.getElementById('rate-ok').innerText) > 0", what="creates/s > 0")
            await page.wait_for("document.querySelectorAll('#sandboxes-table tbody tr').length === 6",
                                what="6 sandbox rows")

            # one sandbox's detail: limits beside use, and its event log from the edge
            await page.click(f'#sandboxes-table tr[data-id="{first["id"]}"]')
            await page.wait_text("#detail-id", first["id"])
            await page.wait_for("document.querySelector('#events-table tr[data-event=\"exec_started\"]') !== null",
                                what="the exec in the event log")
            events = await page.text("#events-table")
            assert "created" in events and "echo hello" in events, events
            memory = await row_text(page, "limits-table", "resource", "memory")
            assert "64 MiB" in memory, memory
            summary = await page.text("#detail-summary")
            assert "team-a" in summary and "rollouts" in summary and XSS in summary, summary
            await page.wait_for("/[0-9]/.test(document.querySelector('#limits-table tr[data-resource=\"cpu\"] "
                                "td:nth-child(2)').innerText)", what="a cpu rate from two reads")
            await page.screenshot(shots / "dashboard-sandbox.png")

            # filters: state=stopped after a delete, by the select a person uses
            assert (await a.delete(f"/v1/sandboxes/{made[3]['id']}")).status_code == 204
            await page.eval("(() => { const s = document.getElementById('filter-state'); s.value = 'stopped'; "
                            "s.dispatchEvent(new Event('change')); })()")
            await page.wait_for("document.querySelectorAll('#sandboxes-table tbody tr').length === 1",
                                what="one stopped sandbox")
            assert made[3]["id"] in await page.text("#sandboxes-table")

            # sign out: the token leaves the tab
            await page.click("#signout")
            assert await page.visible("#login")
            assert await page.eval("sessionStorage.length") == 0
            assert page.console == [], page.console  # no script errors, no CSP refusals


async def test_admin_api_and_metrics(dsec_base: Path, tmp_path: Path) -> None:
    """Who may read the admin API, what a detail holds, and the Grafana dashboard's PromQL
    against the names the control plane and the edge export (scraped from both)."""
    async with stack(dsec_base, tmp_path, "dashm", "dashm") as st:
        a = st.admin
        anon = httpx.AsyncClient(base_url=st.url, timeout=30)
        async with anon:
            assert (await anon.get("/v1/admin/overview")).status_code == 401
            r = await anon.get("/dashboard/")  # the page itself holds no data: open
            assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
            assert (await anon.get("/dashboard/dashboard.js")).headers["content-type"].startswith("text/javascript")
            assert (await anon.get("/dashboard/..%2Fdashboard.py")).status_code == 404
            assert (await anon.get("/dashboard/app.py")).status_code == 404
        await a.post("/v1/projects", json={"name": "p1", "quota": {"sandboxes": 1, "cpu": 1, "memory": 1 << 30}})
        tok = (await a.post("/v1/tokens", json={"project": "p1"})).json()["token"]
        r = await a.get("/v1/admin/overview", headers={"authorization": f"Bearer {tok}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
        from dsec.http import auth

        # an edge-admin token is an operator too (as for GET /v1/edges)
        ea, _ = auth.mint(st.key, sandbox_id="*", project="*", ttl_s=60, scope="edge-admin")
        assert (await a.get("/v1/admin/overview", headers={"authorization": f"Bearer {ea}"})).status_code == 200

        sb = (await create(a, task="t1")).json()
        assert (await create(a, spec={**SPEC, "image": {"base": "nope:latest"}})).status_code == 404
        ov = (await a.get("/v1/admin/overview")).json()
        assert [s["id"] for s in ov["sandboxes"]] == [sb["id"]] and ov["sandboxes"][0]["token"] is None
        assert ov["creates"]["ok_total"] == 1 and ov["creates"]["failed_by_code"] == {"layer_not_found": 1}
        assert ov["sandbox_counts"]["running"] == 1 and ov["edges"][0]["layers"] >= 1
        assert ov["edges"][0]["health"]["layers"] == []  # counted, not listed
        assert [t["name"] for t in ov["tasks"]] == ["t1"]
        assert (await a.get("/v1/admin/overview", params={"task": "other"})).json()["sandboxes"] == []
        assert (await a.get("/v1/admin/overview", params={"state": "stopped"})).json()["sandboxes_matching"] == 0
        assert (await a.get("/v1/admin/overview", params={"project": "Bad Name"})).status_code == 422

        d = (await a.get(f"/v1/admin/sandboxes/{sb['id']}")).json()
        assert d["sandbox"]["id"] == sb["id"] and d["stats"]["memory_limit"] == 64 * MiB
        assert "created" in [e["event"] for e in d["events"]] and d["stats_error"] is None
        assert (await a.get(f"/v1/admin/sandboxes/{st.edge_id}-000000000000")).status_code == 404
        await a.delete(f"/v1/sandboxes/{sb['id']}")

        # Grafana: every metric a PromQL expression names is exported by one of the two
        exported = await exported_metrics(st.url, st.edge.url)
        assert exported["dsec_control_creates_total"] == {"result", "code"}
        assert exported["dsec_edge_creates_total"] == {"result", "source", "reason"}
        # the parser finds what a check must see: a wrong name, a label matcher, a grouping
        assert metrics_in('sum by (pool) (rate(dsec_edge_nope_total{kind="x"}[5m])) / on() dsec_a') == (
            [("dsec_edge_nope_total", {"kind"}), ("dsec_a", set())], {"pool"})
        board = json.loads(GRAFANA.read_text())
        exprs = list(promql_of(board))
        assert len(exprs) >= 10, exprs
        used: set[str] = set()
        target = {"instance", "job"}  # added by Prometheus when it scrapes
        for expr in exprs:
            selectors, grouped = metrics_in(expr)
            assert selectors, expr
            for name, labels in selectors:
                assert name in exported, f"{name!r} in {expr!r} is exported by neither the control plane nor the edge"
                known = exported[name]
                if known is not None:
                    assert labels <= known | target, f"{expr!r}: {name} has no label {sorted(labels - known)}"
                used.add(name)
            label_sets = [exported[n] for n, _ in selectors]
            if all(x is not None for x in label_sets):
                have = set().union(*(x for x in label_sets if x is not None)) | target
                assert grouped <= have, f"{expr!r} groups by {sorted(grouped - have)}, a label none of its metrics has"
        assert {"dsec_control_creates_total", "dsec_edge_sandboxes", "dsec_edge_committed",
                "dsec_edge_capacity"} <= used


# ------------------------------------------------------------- PromQL ----

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("_count", "_sum", "_created"), "gauge": (), "untyped": (), "info": ("_info",)}


async def exported_metrics(*urls: str) -> dict[str, set[str] | None]:
    """Every series name the services at ``urls`` export on ``/metrics`` (with the names a
    family's type implies: ``_total``, ``_bucket``...), each with the label names its samples
    carry; None for a family with no sample yet (its labels are unknown, not absent)."""
    out: dict[str, set[str] | None] = {}
    async with httpx.AsyncClient(timeout=30) as h:
        for url in urls:
            r = await h.get(url + "/metrics")
            assert r.status_code == 200, r.text
            for fam in text_string_to_metric_families(r.text):
                labels: set[str] | None = set().union(*(x.labels for x in fam.samples)) if fam.samples else None
                for name in (fam.name, *(fam.name + sfx for sfx in SUFFIXES.get(fam.type, ()))):
                    out[name] = labels
    return out


FUNCTIONS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "delta", "histogram_quantile", "by",
    "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "clamp_min", "clamp_max", "topk", "bottomk", "label_values", "abs", "time", "vector", "scalar",
    "sort", "sort_desc", "absent", "changes", "resets", "deriv", "max_over_time", "min_over_time",
    "avg_over_time", "label_replace", "round", "ceil", "floor", "le",
}


def promql_of(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: panel targets and query variables."""
    out: list[str] = []

    def panels(items: list[dict[str, Any]]) -> None:
        for p in items:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            panels(p.get("panels", []))

    panels(board.get("panels", []))
    for v in board.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def metrics_in(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """(metric name, label names it is matched on) for each selector of ``expr``, and the
    labels it groups by (``by (...)``, ``without (...)``)."""
    lv = re.fullmatch(r"\s*label_values\(\s*(\w+)\s*(\{[^}]*\})?\s*,\s*(\w+)\s*\)\s*", expr)
    if lv:  # a Grafana variable's query: label_values(metric{...}, label)
        return [(lv.group(1), set(re.findall(r"(\w+)\s*[=!]~?", lv.group(2) or "")))], {lv.group(3)}
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)        # strings
    expr = re.sub(r"\[[^\]]*\]", "", expr)                   # range selectors
    expr = re.sub(r"\$\{?\w+\}?", "x", expr)                 # Grafana variables ($__rate_interval, $edge)
    found: list[tuple[str, set[str]]] = []
    grouped = {m for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for m in re.findall(r"\w+", g)}
    for m in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, matchers = m.group(1), m.group(2) or ""
        rest = expr[m.end():].lstrip()
        if name in FUNCTIONS or name in grouped or rest.startswith("(") or re.fullmatch(r"\d.*", name):
            continue
        if name == "x":  # a Grafana variable
            continue
        labels = set(re.findall(r"(\w+)\s*[=!]~?", matchers))
        found.append((name, labels))
    return found, grouped
