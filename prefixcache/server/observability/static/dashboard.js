// prefixcache dashboard: polls GET /v1/cache/dashboard with the tab's API key and draws it.
// No framework, no build step, nothing loaded from elsewhere. Every value from the server is
// put in the page as text (textContent, SVG attributes), never parsed as HTML: prefix excerpts
// are prompt text.
"use strict";

const KEY_ITEM = "prefixcache.dashboard.key"; // sessionStorage: this tab only
const HISTORY = 300; // polls kept for the charts
const COLORS = ["#3a7dc9", "#e07b39", "#4caf7a", "#8e6cc7"];
const params = new URLSearchParams(location.search);
const INTERVAL_MS = Math.min(60000, Math.max(250, Number(params.get("interval")) || 1000));
const WINDOW_S = Math.max(10, (5 * INTERVAL_MS) / 1000); // rates and per-window hit rates

const $ = (id) => document.getElementById(id);
let history = [];
let timer = null;

// ---- formatting --------------------------------------------------------------------------
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
const int = (x) => (x === null || x === undefined ? "–" : String(Math.round(x)));
const rate = (x) => (x === null || x === undefined ? "–" : x < 10 ? x.toFixed(1) : String(Math.round(x)));
const secs = (x) => (x === null || x === undefined ? "–" : x < 1 ? (1000 * x).toFixed(0) + " ms" : x.toFixed(2) + " s");

function setMetric(name, text) {
  for (const el of document.querySelectorAll(`[data-metric="${name}"]`)) el.textContent = text;
}

// ---- auth ----------------------------------------------------------------------------------
function storedKey() {
  return sessionStorage.getItem(KEY_ITEM); // null: never entered; "": an open server
}

function showLogin(message) {
  stop();
  $("board").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("scope").textContent = "not connected";
  $("key").focus();
}

// A tab without a key asks the server whether it needs one (GET /dashboard/auth, no auth): an
// open server (no keys) is connected to at once, without the login form.
async function start() {
  try {
    const r = await fetch("/dashboard/auth", { cache: "no-store" });
    if (r.ok && (await r.json()).auth_required === false) return connect("");
  } catch (e) {
    // a network error: the form is shown (an empty key connects to an open server too)
  }
  showLogin();
}

function stop() {
  if (timer !== null) clearTimeout(timer);
  timer = null;
}

function connect(key) {
  sessionStorage.setItem(KEY_ITEM, key);
  history = [];
  $("login").hidden = true;
  $("forget").hidden = key === "";
  poll();
}

// ---- polling -------------------------------------------------------------------------------
async function poll() {
  stop();
  const key = storedKey();
  if (key === null) return showLogin();
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let data;
  try {
    const r = await fetch("/v1/cache/dashboard", { headers, cache: "no-store" });
    if (r.status === 401) {
      sessionStorage.removeItem(KEY_ITEM);
      return showLogin("the server did not accept this key");
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    data = await r.json();
  } catch (e) {
    $("status").textContent = "no data: " + e.message + " (retrying)";
    timer = setTimeout(poll, Math.max(INTERVAL_MS, 2000));
    return;
  }
  render(data);
  // A hidden tab polls rarely; it catches up when shown again (visibilitychange below).
  timer = setTimeout(poll, document.hidden ? Math.max(INTERVAL_MS, 10000) : INTERVAL_MS);
}

// One point per poll, with rates over the last WINDOW_S seconds.
function sample(d) {
  const s = d.summary, a = d.activity;
  const p = {
    t: d.time, hit_rate: s.hit_rate, query: s.query_tokens, saved: s.tokens_saved,
    gen: s.generation_tokens, evicted: s.evicted_blocks, requests: a.requests.requests,
    hit_requests: a.requests.hit_requests, cached: s.cached_blocks, pinned: s.pinned_blocks,
    in_use: s.in_use_blocks, free: s.free_blocks,
    ttft_hit: a.ttft.hit.p50, ttft_miss: a.ttft.miss.p50,
  };
  // Rates over the window: from the oldest poll inside it (the previous one at least).
  let base = history.find((h) => h.t >= p.t - WINDOW_S && h.t < p.t);
  if (!base && history.length && history[history.length - 1].t < p.t) base = history[history.length - 1];
  if (base) {
    const dt = p.t - base.t;
    const dq = p.query - base.query, dr = p.requests - base.requests;
    p.hit_interval = dq > 0 ? (p.saved - base.saved) / dq : null;
    p.req_interval = dr > 0 ? (p.hit_requests - base.hit_requests) / dr : null;
    p.gen_tps = (p.gen - base.gen) / dt;
    p.prompt_tps = dq / dt;
    p.evict_ps = p.evicted === null ? null : (p.evicted - base.evicted) / dt;
  }
  history.push(p);
  if (history.length > HISTORY) history.shift();
  return p;
}

// ---- rendering -----------------------------------------------------------------------------
function render(d) {
  const s = d.summary, a = d.activity;
  const p = sample(d);
  $("board").hidden = false;
  $("scope").textContent = d.admin
    ? `tenant ${d.tenant} (admin): the whole server`
    : `tenant ${d.tenant}: your namespaces only`;
  $("status").textContent = "updated " + new Date(d.time * 1000).toLocaleTimeString();

  setMetric("hit_rate", pct(s.hit_rate));
  setMetric("request_hit_rate", pct(a.requests.request_hit_rate));
  setMetric("tokens_saved", int(s.tokens_saved));
  setMetric("query_tokens", int(s.query_tokens));
  setMetric("kv_usage", pct(s.kv_usage));
  setMetric("cached_blocks", int(s.cached_blocks));
  setMetric("pinned_blocks", int(s.pinned_blocks));
  setMetric("free_blocks", int(s.free_blocks));
  setMetric("in_use_blocks", int(s.in_use_blocks));
  setMetric("requests_running", int(s.requests_running));
  setMetric("requests_waiting", int(s.requests_waiting));
  setMetric("ttft_hit_p50", secs(a.ttft.hit.p50));
  setMetric("ttft_miss_p50", secs(a.ttft.miss.p50));
  setMetric("ttft_count", int(a.ttft.hit.count + a.ttft.miss.count));
  setMetric("generation_tps", rate(p.gen_tps));
  setMetric("prompt_tps", rate(p.prompt_tps));
  setMetric("evictions_per_s", rate(p.evict_ps));
  $("kv-title").textContent = s.scope === "server" ? "KV in use" : "KV held by your namespaces";
  $("kv-detail").textContent = `${int(s.total_blocks)} blocks in the pool`;

  chart("chart-hit", "legend-hit", [
    { name: "tokens", values: history.map((h) => h.hit_interval), max: 1 },
    { name: "requests", values: history.map((h) => h.req_interval), max: 1 },
    { name: "tokens since start", values: history.map((h) => h.hit_rate), max: 1, dashed: true },
  ], pct);
  const kv = [
    { name: "cached", values: history.map((h) => h.cached) },
    { name: "pinned", values: history.map((h) => h.pinned) },
  ];
  if (s.scope === "server") {
    kv.unshift({ name: "in use", values: history.map((h) => h.in_use) });
    kv.push({ name: "free", values: history.map((h) => h.free) });
  }
  chart("chart-kv", "legend-kv", kv, int);
  const tput = [
    { name: "generated tok/s", values: history.map((h) => h.gen_tps) },
    { name: "prompt tok/s", values: history.map((h) => h.prompt_tps) },
  ];
  if (s.scope === "server") tput.push({ name: "evictions/s", values: history.map((h) => h.evict_ps) });
  chart("chart-tput", "legend-tput", tput, rate);
  chart("chart-ttft", "legend-ttft", [
    { name: "with a hit", values: history.map((h) => h.ttft_hit) },
    { name: "without", values: history.map((h) => h.ttft_miss) },
  ], secs);

  renderTiers(d.stats);
  table("namespaces", ["namespace", "blocks now", "requests", "prompt tokens", "hit tokens", "hit rate"],
    d.namespaces.map((n) => [n.namespace, int(n.blocks), int(n.requests), int(n.prompt_tokens),
      int(n.cached_tokens), pct(n.hit_rate)]));
  $("tenants-section").hidden = !d.admin;
  if (d.admin) {
    table("tenants", ["tenant", "requests", "with a hit", "prompt tokens", "hit tokens", "hit rate"],
      Object.entries(a.tenants).map(([t, u]) => [t, int(u.requests), int(u.hit_requests),
        int(u.prompt_tokens), int(u.cached_tokens), pct(u.hit_rate)]));
  }
  table("prefixes", ["prefix", "namespace", "tokens", "hits", "tokens saved", "text"],
    a.top_prefixes.map((x) => [x.id, x.namespace, int(x.tokens), int(x.hits), int(x.saved_tokens),
      x.excerpt === null ? "(another tenant's: not shown)" : x.excerpt]));
  const reasons = Object.entries(a.miss_reasons).map(([r, n]) => `${r} ×${n}`).join(", ");
  $("miss-reasons").textContent = reasons
    ? "reasons among the last requests: " + reasons
    : "no miss among the last requests";
  table("misses", ["time", "namespace", "prompt tokens", "cached", "reason"],
    a.recent_misses.map((m) => [new Date(m.time * 1000).toLocaleTimeString(), m.namespace,
      int(m.prompt_tokens), int(m.cached_tokens), m.reason ?? "not explained"]));
}

// Tiers appear in the stats once the engine has them: a list of objects or an object of
// objects, shown as they come (one row per tier, one column per field).
function renderTiers(stats) {
  const raw = stats.tiers ?? (stats.engine && stats.engine.tiers);
  const rows = Array.isArray(raw) ? raw
    : raw && typeof raw === "object" ? Object.entries(raw).map(([name, v]) =>
      (v && typeof v === "object" ? { name, ...v } : { name, value: v })) : [];
  $("tiers-section").hidden = rows.length === 0;
  if (!rows.length) return;
  const cols = [...new Set(rows.flatMap((r) => Object.keys(r)))];
  table("tiers", cols, rows.map((r) => cols.map((c) => {
    const v = r[c];
    return v === null || v === undefined ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v);
  })));
}

function table(id, head, rows) {
  const t = $(id);
  const body = [];
  const tr = document.createElement("tr");
  for (const h of head) {
    const th = document.createElement("th");
    th.textContent = h;
    tr.appendChild(th);
  }
  body.push(tr);
  if (!rows.length) {
    const r = document.createElement("tr"), td = document.createElement("td");
    td.colSpan = head.length;
    td.className = "muted";
    td.textContent = "none yet";
    r.appendChild(td);
    body.push(r);
  }
  for (const row of rows) {
    const r = document.createElement("tr");
    row.forEach((v, i) => {
      const td = document.createElement("td");
      td.textContent = v;
      td.className = i === head.length - 1 && id === "prefixes" ? "text"
        : /^[\d.,–%]+( ms| s)?$/.test(v) && i > 0 ? "num" : "";
      r.appendChild(td);
    });
    body.push(r);
  }
  t.replaceChildren(...body);
}

// A line chart in an SVG of viewBox 400x160: series share one y axis from 0.
const NS = "http://www.w3.org/2000/svg";
function svgEl(name, attrs) {
  const el = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function chart(svgId, legendId, series, fmt) {
  const svg = $(svgId), W = 400, H = 160, L = 4, T = 12, B = 4;
  const finite = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined && isFinite(v)));
  let top = Math.max(...series.map((s) => s.max || 0), ...finite, 0);
  if (top <= 0) top = 1;
  const n = Math.max(2, history.length);
  const x = (i) => L + ((W - 2 * L) * i) / (n - 1);
  const y = (v) => H - B - ((H - T - B) * v) / top;
  const nodes = [svgEl("line", { x1: L, x2: W - L, y1: y(0), y2: y(0), stroke: "#ccc" }),
    svgEl("line", { x1: L, x2: W - L, y1: y(top), y2: y(top), stroke: "#eee" })];
  const label = svgEl("text", { x: L + 2, y: T - 2 });
  label.textContent = fmt(top);
  const span = history.length > 1 ? history[history.length - 1].t - history[0].t : 0;
  const when = svgEl("text", { x: W - L - 2, y: T - 2, "text-anchor": "end" });
  when.textContent = `last ${Math.round(span)} s`;
  nodes.push(label, when);
  series.forEach((s, k) => {
    let d = "", pen = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined || !isFinite(v)) { pen = false; return; }
      d += (pen ? "L" : "M") + x(i).toFixed(1) + " " + y(v).toFixed(1) + " ";
      pen = true;
    });
    if (d) {
      const attrs = { d, fill: "none", stroke: COLORS[k % COLORS.length], "stroke-width": 1.5 };
      if (s.dashed) attrs["stroke-dasharray"] = "4 3";
      nodes.push(svgEl("path", attrs));
    }
  });
  svg.replaceChildren(...nodes);
  const legend = $(legendId);
  legend.replaceChildren(...series.map((s, k) => {
    const span = document.createElement("span"), i = document.createElement("i");
    i.className = "c" + (k % COLORS.length);
    span.append(i, s.name);
    const last = s.values[s.values.length - 1];
    if (last !== null && last !== undefined) span.append(": " + fmt(last));
    return span;
  }));
}

// ---- start ---------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  for (const el of document.querySelectorAll(".window")) el.textContent = `${Math.round(WINDOW_S)} s`;
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    connect($("key").value.trim());
    $("key").value = "";
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    showLogin();
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && timer !== null) poll();
  });
  if (storedKey() === null) start();
  else connect(storedKey());
});
