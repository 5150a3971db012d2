// DSec dashboard (docs/DASHBOARD.md): plain JavaScript, no build step, no libraries.
//
// The page holds no data of its own: every two seconds it asks this control plane's
// read-only admin API (GET /v1/admin/overview, GET /v1/admin/sandboxes/{id}) with the
// token the operator typed once, kept in this tab's sessionStorage. Every value is
// written with textContent (never as markup): labels, messages and names come from users.
"use strict";

(() => {
  const KEY = "dsec.dashboard.token";
  const POLL_MS = 2000;
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  let timer = null;
  let paused = false;
  let busy = false;
  let selected = null;      // the sandbox id whose detail is open
  let lastStats = null;     // {id, cpu_s, now}: two reads give a cpu rate
  let last = null;          // the last overview

  // ------------------------------------------------------------ helpers --

  function el(tag, opts, ...kids) {
    const n = document.createElement(tag);
    if (opts) {
      if (opts.cls) n.className = opts.cls;
      if (opts.title) n.title = opts.title;
      if (opts.data) for (const [k, v] of Object.entries(opts.data)) n.dataset[k] = v;
    }
    for (const k of kids) {
      if (k === null || k === undefined) continue;
      n.append(k instanceof Node ? k : document.createTextNode(String(k)));
    }
    return n;
  }

  function td(content, cls) {
    return el("td", cls ? { cls } : null, content);
  }

  function fill(tbody, rows) {
    tbody.replaceChildren(...rows);
  }

  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    let i = 0;
    let v = Number(n);
    while (Math.abs(v) >= 1024 && i < UNITS.length - 1) { v /= 1024; i += 1; }
    return (i === 0 || v >= 100 ? v.toFixed(0) : v.toFixed(1).replace(/\.0$/, "")) + " " + UNITS[i];
  }

  function cores(n) {
    if (n === null || n === undefined) return "–";
    return Number(n).toLocaleString("en-US", { maximumFractionDigits: 3 });
  }

  function count(n) {
    return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
  }

  function rate(n) {
    if (n === null || n === undefined) return "–";
    return n >= 100 ? n.toFixed(0) : n >= 10 ? n.toFixed(1) : n.toFixed(2);
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    const s = Math.max(0, Math.floor(seconds));
    if (s < 60) return s + "s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + "m " + String(s % 60).padStart(2, "0") + "s";
    const h = Math.floor(m / 60);
    if (h < 48) return h + "h " + String(m % 60).padStart(2, "0") + "m";
    return Math.floor(h / 24) + "d " + (h % 24) + "h";
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return d.toLocaleTimeString("en-GB", { hour12: false });
  }

  function seconds(x) {
    if (x === null || x === undefined) return "–";
    return x < 1 ? (x * 1000).toFixed(x < 0.01 ? 2 : 1) + " ms" : x.toFixed(2) + " s";
  }

  // used / limit with a small meter; limit null or 0: no meter
  function usage(used, limit, fmt) {
    const cell = el("td", null, fmt(used) + " / " + (limit === null || limit === undefined ? "–" : fmt(limit)));
    if (limit) {
      const frac = Math.max(0, Math.min(1, Number(used) / Number(limit)));
      const bar = el("span");
      bar.style.width = (frac * 100).toFixed(1) + "%";
      const meter = el("span", { cls: "meter" + (frac >= 0.999 ? " full" : frac >= 0.8 ? " high" : ""),
                                  title: (frac * 100).toFixed(0) + "%" }, bar);
      cell.append(meter);
    }
    return cell;
  }

  function badge(state, extra) {
    return el("span", { cls: "state " + state + (extra ? " " + extra : "") }, state);
  }

  function status(msg, isError) {
    const s = $("status");
    s.textContent = msg;
    s.className = isError ? "error" : "";
  }

  // --------------------------------------------------------------- auth --

  function token() {
    return sessionStorage.getItem(KEY);
  }

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function api(path) {
    const r = await fetch(path, { headers: { authorization: "Bearer " + token() }, cache: "no-store" });
    let body = null;
    try { body = await r.json(); } catch (e) { body = null; }
    if (!r.ok) {
      const err = (body && body.error) || {};
      throw new ApiError(r.status, err.code || "http_" + r.status, err.message || r.statusText || "request failed");
    }
    return body;
  }

  function showLogin(message) {
    if (timer) { clearTimeout(timer); timer = null; }
    $("main").hidden = true;
    $("pause").hidden = true;
    $("signout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("token").focus();
  }

  function showMain() {
    $("login").hidden = true;
    $("main").hidden = false;
    $("pause").hidden = false;
    $("signout").hidden = false;
  }

  // ---------------------------------------------------------- rendering --

  function renderLive(ov) {
    const c = ov.creates;
    $("rate-ok").textContent = rate(c.per_s_10s);
    $("rate-ok-60").textContent = rate(c.per_s_60s) + "/s over 60 s";
    $("rate-failed").textContent = rate(c.failed_per_s_10s);
    $("rate-failed-60").textContent = rate(c.failed_per_s_60s) + "/s over 60 s";
    $("creates-total").textContent = count(c.ok_total);
    $("creates-since").textContent = "since " + clock(c.since);
    $("failed-total").textContent = count(c.failed_total);
    $("failed-codes").textContent = Object.entries(c.failed_by_code).map(([k, v]) => k + " " + v).join(", ");
    $("latency").textContent = seconds(c.latency_p50_s);
    $("latency-foot").textContent = c.latency_p99_s === null ? "p50 of the last 1,000" : "p50 · p99 " + seconds(c.latency_p99_s) + " (last 1,000)";
    const counts = ov.sandbox_counts;
    const live = ["creating", "running", "paused", "stopping", "failed"].reduce((a, k) => a + (counts[k] || 0), 0);
    $("live-sandboxes").textContent = count(live);
    $("state-counts").textContent = Object.entries(counts).filter(([, v]) => v > 0).map(([k, v]) => k + " " + v).join(", ");
    const alive = ov.edges.filter((e) => e.status === "alive").length;
    $("edges-alive").textContent = alive + " / " + ov.edges.length;
    const draining = ov.edges.filter((e) => e.draining).length;
    $("edges-foot").textContent = draining ? draining + " draining" : "";
    renderSpark(c.series_ok, c.series_failed);
  }

  function renderSpark(ok, failed) {
    const svg = $("spark");
    const n = Math.max(ok.length, 2);
    const peak = Math.max(1, ...ok, ...failed);
    $("spark-max").textContent = String(peak);
    const line = (values, cls) => {
      const p = document.createElementNS(SVG, "polyline");
      p.setAttribute("class", cls);
      p.setAttribute("points", values.map((v, i) => (i * 600 / (n - 1)).toFixed(1) + "," + (88 - v / peak * 84).toFixed(1)).join(" "));
      return p;
    };
    svg.replaceChildren(line(ok, "ok"), line(failed, "failed"));
  }

  function renderErrors(ov) {
    const rows = ov.creates.recent_errors.map((e) => el("tr", null,
      td(clock(e.at)), td(e.project), td(e.code, "mono"), td(String(e.status)), td(e.message, "msg")));
    fill($("errors-table").tBodies[0], rows);
    $("errors-empty").hidden = rows.length > 0;
    $("errors-table").hidden = rows.length === 0;
  }

  function renderProjects(ov) {
    fill($("projects-table").tBodies[0], ov.projects.map((p) => {
      const name = el("td", null, el("span", { cls: "indent" }, "\u00a0\u00a0".repeat(p.depth) + (p.depth ? "└ " : "")), p.name);
      const r = p.reserved;
      const carved = r.sandboxes || r.cpu || r.memory
        ? r.sandboxes + " sandboxes, " + cores(r.cpu) + " cores, " + bytes(r.memory) : "–";
      return el("tr", { data: { project: p.name } }, name,
        usage(p.used.sandboxes, p.quota.sandboxes, count),
        usage(p.used.cpu, p.quota.cpu, cores),
        usage(p.used.memory, p.quota.memory, bytes),
        td(carved),
        usage(p.storage_used, p.storage_quota, bytes));
    }));
  }

  function renderEdges(ov) {
    const now = ov.now;
    fill($("edges-table").tBodies[0], ov.edges.map((e) => {
      const h = e.health || {};
      const host = h.host || {};
      const st = el("td", null, badge(e.status));
      if (e.draining) st.append(" ", badge("draining"));
      if (e.health && h.healthy === false) st.append(" ", el("span", { cls: "state unhealthy", title: (h.problems || []).join("\n") }, "unhealthy"));
      return el("tr", { data: { edge: e.id } },
        td(e.id, "id"), st,
        usage(h.sandboxes ?? e.committed.sandboxes, h.capacity_sandboxes, count),
        usage(h.cpu_committed ?? e.committed.cpu, h.cpu_capacity, cores),
        usage(h.memory_committed ?? e.committed.memory, h.memory_capacity, bytes),
        usage(h.disk_committed, h.disk_capacity, bytes),
        td(host.cpu_util === undefined ? "–" : (host.cpu_util * 100).toFixed(0) + "% of " + (host.cpu_cores ?? "?")),
        td(host.load1 === undefined ? "–" : host.load1.toFixed(2)),
        td(host.memory_available === undefined ? "–" : bytes(host.memory_available) + " of " + bytes(host.memory_total)),
        td(e.last_seen ? age(now - e.last_seen) + " ago" : "never"),
        td(e.url, "mono"));
    }));
    $("edges-empty").hidden = ov.edges.length > 0;
  }

  function renderTasks(ov) {
    fill($("tasks-table").tBodies[0], ov.tasks.map((t) => el("tr", { data: { task: t.project + "/" + t.name } },
      td(t.project), td(t.name),
      usage(t.used.sandboxes, t.quota.sandboxes, count),
      usage(t.used.cpu, t.quota.cpu, cores),
      usage(t.used.memory, t.quota.memory, bytes),
      td(t.stage || "–"), td(age(ov.now - t.created_at)))));
    $("tasks-empty").hidden = ov.tasks.length > 0;
  }

  function labelsText(labels) {
    return Object.entries(labels || {}).map(([k, v]) => k + "=" + v).join(" ");
  }

  function imageText(img) {
    if (!img) return "–";
    return [img.base, img.workspace, ...(img.toolkits || [])].filter(Boolean).join(" + ");
  }

  function renderSandboxes(ov) {
    const find = $("filter-text").value.trim().toLowerCase();
    const shown = ov.sandboxes.filter((s) => !find || [s.id, s.project, s.task, s.state, labelsText(s.labels), imageText(s.image)]
      .join(" ").toLowerCase().includes(find));
    fill($("sandboxes-table").tBodies[0], shown.map((s) => {
      const r = s.resources || {};
      const tr = el("tr", { data: { id: s.id } },
        td(s.id, "id"), el("td", null, badge(s.state)), td(s.project || "–"), td(s.task || "–"), td(s.edge_id, "id"),
        td(age(ov.now - s.created_at)), td(s.expires_at ? age(s.expires_at - ov.now) : "–"),
        td(cores(r.cpu)), td(bytes(r.memory)), td(bytes(r.disk)), td(imageText(s.image)), td(labelsText(s.labels), "labels"));
      if (s.id === selected) tr.classList.add("selected");
      tr.addEventListener("click", () => openDetail(s.id));
      return tr;
    }));
    const total = ov.sandboxes_matching;
    $("sandboxes-count").textContent = "(" + (shown.length < ov.sandboxes.length
      ? shown.length + " found in the newest " + ov.sandboxes.length + " of " + count(total)
      : ov.sandboxes.length < total ? "newest " + ov.sandboxes.length + " of " + count(total) : count(total)) + ")";
    $("sandboxes-empty").hidden = shown.length > 0;
  }

  function render(ov) {
    renderLive(ov);
    renderErrors(ov);
    renderProjects(ov);
    renderEdges(ov);
    renderTasks(ov);
    renderSandboxes(ov);
  }

  // ------------------------------------------------------------- detail --

  function openDetail(id) {
    selected = id;
    lastStats = null;
    $("detail").hidden = false;
    $("detail-id").textContent = id;
    for (const tr of $("sandboxes-table").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.id === id);
    loadDetail().then(() => $("detail").scrollIntoView({ block: "nearest" }));
  }

  function closeDetail() {
    selected = null;
    $("detail").hidden = true;
    for (const tr of $("sandboxes-table").tBodies[0].rows) tr.classList.remove("selected");
  }

  function kv(pairs) {
    const out = [];
    for (const [k, v] of pairs) out.push(el("div", { cls: "k" }, k), el("div", null, v));
    return out;
  }

  function eventDetails(e) {
    const rest = {};
    for (const [k, v] of Object.entries(e)) if (!["t", "event", "origin"].includes(k)) rest[k] = v;
    const s = JSON.stringify(rest);
    return s === "{}" ? "" : s.length > 400 ? s.slice(0, 400) + "…" : s;
  }

  async function loadDetail() {
    const id = selected;
    if (!id) return;
    let d;
    try {
      d = await api("../v1/admin/sandboxes/" + encodeURIComponent(id));
    } catch (e) {
      if (id !== selected) return;
      $("detail-summary").replaceChildren(el("div", { cls: "k" }, "error"), el("div", { cls: "error" }, e.code + ": " + e.message));
      return;
    }
    if (id !== selected) return;
    const s = d.sandbox;
    const lc = d.lifecycle || {};
    $("detail-summary").replaceChildren(...kv([
      ["state", badge(s.state)], ["project", s.project || "–"], ["task", s.task || "–"],
      ["edge", s.edge_id + " (" + s.edge_url + ")"], ["image", imageText(s.image)],
      ["created", clock(s.created_at) + " (" + age(d.now - s.created_at) + " ago)"],
      ["expires", s.expires_at ? clock(s.expires_at) + " (in " + age(s.expires_at - d.now) + ")" : "never"],
      ["idle timeout", lc.idle_timeout_s ? age(lc.idle_timeout_s) : "–"],
      ["stage", s.stage || "–"], ["labels", labelsText(s.labels) || "–"], ["backend", s.backend],
      ["reason", s.reason || "–"],
    ]));
    const r = s.resources || {};
    const st = d.stats;
    let cpuUse = "–";
    if (st) {
      if (lastStats && lastStats.id === id && d.now > lastStats.now) {
        cpuUse = cores(Math.max(0, (st.cpu_s - lastStats.cpu_s) / (d.now - lastStats.now)));
      }
      lastStats = { id, cpu_s: st.cpu_s, now: d.now };
    }
    const rows = [
      el("tr", { data: { resource: "cpu" } }, td("cpu (cores)"), td(cpuUse), td(cores(st ? st.cpu_limit : r.cpu)), td(st ? st.cpu_s.toFixed(2) + " s used in all" : "")),
      el("tr", { data: { resource: "memory" } }, td("memory"), usage(st ? st.memory_bytes : null, st ? st.memory_limit : r.memory, bytes), td(bytes(st ? st.memory_limit : r.memory)), td("")),
      el("tr", { data: { resource: "disk" } }, td("disk"), usage(st ? st.disk_bytes : null, st ? st.disk_limit : r.disk, bytes), td(bytes(st ? st.disk_limit : r.disk)), td("")),
      el("tr", { data: { resource: "pids" } }, td("processes"), usage(st ? st.pids : null, st ? st.pids_limit : r.pids, count), td(count(st ? st.pids_limit : r.pids)), td("")),
    ];
    fill($("limits-table").tBodies[0], rows);
    $("stats-error").hidden = !d.stats_error;
    $("stats-error").textContent = d.stats_error ? "use now: " + d.stats_error.code + ": " + d.stats_error.message : "";
    const events = d.events.slice().reverse();
    fill($("events-table").tBodies[0], events.map((e) => el("tr", { data: { event: e.event } },
      td(e.t ? clock(e.t) : "–"), td(String(e.event), "mono"), td(eventDetails(e), "msg"))));
    $("events-count").textContent = "(" + d.events_total + (d.events_total > d.events.length ? ", newest " + d.events.length : "") + ", newest first)";
    $("events-error").hidden = !d.events_error;
    $("events-error").textContent = d.events_error ? "events: " + d.events_error.code + ": " + d.events_error.message : "";
  }

  // ------------------------------------------------------------ polling --

  function query() {
    const q = new URLSearchParams();
    const st = $("filter-state").value;
    if (st) q.append("state", st);
    const p = $("filter-project").value.trim();
    if (p) q.set("project", p);
    const t = $("filter-task").value.trim();
    if (t) q.set("task", t);
    const s = q.toString();
    return s ? "?" + s : "";
  }

  async function refresh() {
    if (busy || !token()) return;
    busy = true;
    try {
      const ov = await api("../v1/admin/overview" + query());
      last = ov;
      showMain();
      render(ov);
      if (selected) await loadDetail();
      $("updated").textContent = "updated " + clock(ov.now);
      status("store: " + ov.store + " · watcher rounds: " + ov.watcher_rounds + " · figures of this replica, every " + POLL_MS / 1000 + " s");
    } catch (e) {
      if (e instanceof ApiError && (e.status === 401 || e.status === 403)) {
        sessionStorage.removeItem(KEY);
        showLogin(e.code + ": " + e.message);
        return;
      }
      status("could not refresh: " + (e.code ? e.code + ": " : "") + e.message + " (retrying)", true);
    } finally {
      busy = false;
      schedule();
    }
  }

  function schedule() {
    if (timer) clearTimeout(timer);
    timer = null;
    if (!paused && token()) timer = setTimeout(refresh, POLL_MS);
  }

  // -------------------------------------------------------------- start --

  function init() {
    $("where").textContent = location.host;
    if (location.hash.startsWith("#token=")) {  // a link with the token: taken, then wiped from the address
      sessionStorage.setItem(KEY, decodeURIComponent(location.hash.slice(7)));
      history.replaceState(null, "", location.pathname + location.search);
    }
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const t = $("token").value.trim();
      if (!t) return;
      sessionStorage.setItem(KEY, t);
      $("token").value = "";
      $("login-error").textContent = "";
      refresh();
    });
    $("signout").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      closeDetail();
      showLogin("");
    });
    $("pause").addEventListener("click", () => {
      paused = !paused;
      $("pause").textContent = paused ? "Resume" : "Pause";
      if (paused) status("paused"); else refresh();
      schedule();
    });
    $("detail-close").addEventListener("click", closeDetail);
    for (const id of ["filter-state", "filter-project", "filter-task"]) $(id).addEventListener("change", refresh);
    $("filter-text").addEventListener("input", () => { if (last) renderSandboxes(last); });
    if (token()) refresh(); else showLogin("");
  }

  init();
})();
