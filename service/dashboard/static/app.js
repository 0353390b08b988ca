// The trainjobs dashboard: plain JS over the /v1 API, no build step and no dependency.
// Charts are drawn by hand as SVG (one <path> per series): a few small line charts do not need a library.
// Everything that comes from the API reaches the DOM as text (textContent / text nodes), never as HTML.
"use strict";

const TOKEN_KEY = "trainjobs.token";
const PAGE_SIZE = 25, MAX_POINTS = 500, LOG_KEEP = 100_000, MAX_NODE_LINES = 4, MAX_RANK_LINES = 8;
const MIN_COMPARE = 2, MAX_COMPARE = 10; // as many jobs as the compare view has colours for
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const SVGNS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

// ---- DOM helpers: strings become text nodes, so user data is never parsed as markup.
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k === "cls" ? "class" : k, v);
  for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}
function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function duration(s) {
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}
const ago = (iso) => (iso ? `${duration((Date.now() - Date.parse(iso)) / 1000)} ago` : "");
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "");
// An axis label: k/M for large values, else as many decimals as the axis span needs.
function tick(v, span) {
  if (Math.abs(v) >= 1e6) return `${(v / 1e6).toPrecision(3)}M`;
  if (Math.abs(v) >= 1e4) return `${(v / 1e3).toPrecision(3)}k`;
  return v.toFixed(Math.min(6, Math.max(0, Math.ceil(-Math.log10(span / 2)) + 1)));
}
function bytes(n) {
  const [unit, size] = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]].find(([, v]) => n >= v) || ["B", 1];
  return `${(n / size).toFixed(size > 1 ? 1 : 0)} ${unit}`;
}

// ---- The API: every call carries the stored token; a 401 asks for one.
// Where a newcomer finds a token: the file `trainjobs up` wrote beside its data folder (default ./trainjobs-data).
const TOKEN_HINT = "paste a token above: the admin token is in trainjobs-data-secrets/admin.token, beside the " +
  "trainjobs-data folder where `trainjobs up` ran (or the token you gave `trainjobs login`; an admin makes one " +
  "per user with `trainjobs token create NAME`)";
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}
async function detailOf(r) {
  try {
    const d = (await r.json()).detail;
    if (Array.isArray(d)) return d.map((e) => `${(e.loc || []).join(".")}: ${e.msg}`).join("; ");
    return typeof d === "string" ? d : JSON.stringify(d);
  } catch { return `${r.status} ${r.statusText}`; }
}
async function api(path, { method = "GET", headers = {}, signal } = {}) {
  const token = localStorage.getItem(TOKEN_KEY);
  if (token) headers = { ...headers, Authorization: `Bearer ${token}` };
  const r = await fetch(path, { method, headers, signal, cache: "no-store" });
  if (r.status === 401) { showToken(true); throw new ApiError(401, `${await detailOf(r)}: ${TOKEN_HINT}`); }
  if (!r.ok && r.status !== 304) throw new ApiError(r.status, await detailOf(r));
  return r;
}
// GET with If-None-Match: a 304 means the copy we hold is current (changed: false).
const held = new Map();
async function getJson(path) {
  const copy = held.get(path);
  const r = await api(path, { headers: copy ? { "If-None-Match": copy.etag } : {} });
  if (r.status === 304 && copy) return { body: copy.body, changed: false };
  const body = await r.json();
  if (held.size > 100) held.clear();
  if (r.headers.get("ETag")) held.set(path, { etag: r.headers.get("ETag"), body });
  return { body, changed: true };
}
function report(err) {
  const banner = $("banner");
  banner.textContent = err ? `${err.message || err}` : "";
  banner.hidden = !err;
}
// Run fn now and then every ms until stop() or fn returns false; a failure shows in the banner (and a 404,
// which will not mend itself, ends the polling).
function every(ms, fn) {
  let timer, stopped = false;
  const tick = async () => {
    try { if ((await fn()) === false) return; report(null); } catch (e) {
      if (!stopped) report(e);
      if (e.status === 404) return;
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

// ---- The token form: shown when none is stored, highlighted when the API answered 401.
function showToken(needed = false) {
  const has = Boolean(localStorage.getItem(TOKEN_KEY));
  $("token-form").hidden = has && !needed;
  $("token-form").classList.toggle("needed", needed);
  $("token-label").textContent = needed ? "The API needs a token" : "API token (if auth is on)";
  $("token-set").hidden = !has || needed;
}
$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = $("token-input").value.trim();
  if (token) localStorage.setItem(TOKEN_KEY, token); else localStorage.removeItem(TOKEN_KEY);
  $("token-input").value = "";
  held.clear(); showToken(); route();
});
$("token-forget").addEventListener("click", () => { localStorage.removeItem(TOKEN_KEY); held.clear(); showToken(); });

// ---- Views: #/?status=&name=&tag= (jobs), #/jobs/<id>, #/compare?ids=a,b&metric=loss, #/sweeps,
// #/sweeps/<id> (sweeps.js), #/queue, #/workers. Each returns its stop(). The hash holds a view's state, so a
// filtered list or a comparison can be bookmarked and shared.
let stopView = () => {};
function show(name) {
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== `view-${name}`;
  const nav = name === "sweep" ? "sweeps" : name;
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("on", a.dataset.nav === nav);
}
function hashParts() {
  const hash = location.hash.slice(1) || "/", i = hash.indexOf("?");
  return i < 0 ? [hash, new URLSearchParams()] : [hash.slice(0, i), new URLSearchParams(hash.slice(i + 1))];
}
// The hash for a view and its state (empty values left out; commas kept readable in a list of ids).
function hashOf(path, params) {
  const q = Object.entries(params).filter(([, v]) => v)
    .map(([k, v]) => `${k}=${encodeURIComponent(v).replaceAll("%2C", ",")}`).join("&");
  return `#${path}${q ? `?${q}` : ""}`;
}
// A view's own change of its state: the URL follows without a hashchange (which would restart the view).
const keepInUrl = (path, params) => history.replaceState(null, "", hashOf(path, params));
function route() {
  stopView(); report(null);
  const [path, query] = hashParts();
  const m = path.match(/^\/jobs\/([^/]+)$/), sweep = path.match(/^\/sweeps\/([^/]+)$/);
  if (m) stopView = jobView(decodeURIComponent(m[1]));
  else if (sweep) stopView = sweepView(decodeURIComponent(sweep[1])); // sweeps.js
  else if (path === "/sweeps") stopView = sweepsView();
  else if (path === "/workers") stopView = workersView();
  else if (path === "/queue") stopView = queueView();
  else if (path === "/compare") stopView = compareView(query);
  else stopView = jobsView(query);
}
window.addEventListener("hashchange", route);

function statusBadge(status) { return el("span", { cls: `badge ${status}` }, status); }
function worldSize(spec) {
  const r = spec.resources || {};
  return `${r.nnodes ?? 1}×${r.nproc_per_node ?? 1}`;
}
function strategyOf(job) {
  return job.plan && job.plan.requested === "auto" ? `${job.spec.strategy} (auto)` : job.spec.strategy || "";
}
function progressText(job) {
  const p = job.progress, parts = [p.total_steps ? `${p.step}/${p.total_steps}` : `step ${p.step}`];
  if (p.eta_s !== null && p.eta_s !== undefined && !TERMINAL.has(job.status)) parts.push(`ETA ${duration(p.eta_s)}`);
  return parts.join(" · ");
}
function progressFraction(job) {
  const p = job.progress;
  if (p.total_steps) return Math.min(1, p.step / p.total_steps);
  return job.status === "succeeded" ? 1 : 0;
}
// A script of the user's own that never calls trainjobs.report(): no steps, no total, so no bar to fill (a full
// green "step 0" read as if the script had done nothing) and no series to chart.
function reportsNoSteps(job) {
  const p = job.progress || {};
  return !p.total_steps && !p.step;
}
const HOW_TO_REPORT = "to report them, call trainjobs.report(step, loss=..., total_steps=N) in the script " +
  "(docs: getting-started/own-script)";
function progressBar(job) {
  if (reportsNoSteps(job)) return el("span", { cls: "muted", title: HOW_TO_REPORT }, "no steps reported");
  const fill = el("div", { cls: `fill ${job.status}`, style: `width:${(progressFraction(job) * 100).toFixed(1)}%` });
  return el("div", { cls: "progress" }, fill, el("span", {}, progressText(job)));
}

// The list's filters come from the URL; the pages' cursors and the jobs picked for a comparison outlive a visit
// to a job's page (cursors[i]: the cursor of page i, null: the newest).
const listState = { filterKey: null, cursors: [null], selected: new Map() }; // selected: id → name, in order
function jobsView(query) {
  show("jobs");
  const filter = { status: query.get("status") || "", name: query.get("name") || "", tag: query.get("tag") || "",
    sweep: query.get("sweep") || "" };
  const filterKey = JSON.stringify(filter);
  if (filterKey !== listState.filterKey) { listState.filterKey = filterKey; listState.cursors = [null]; }
  const pageUrl = () => {
    const q = new URLSearchParams({ limit: PAGE_SIZE });
    for (const [k, v] of Object.entries(filter)) if (v) q.set(k, v);
    if (listState.cursors.at(-1)) q.set("cursor", listState.cursors.at(-1));
    return `/v1/jobs?${q}`;
  };
  let next = null, stop = () => {};
  const selected = listState.selected;
  const renderSelection = () => {
    const n = selected.size, fits = n >= MIN_COMPARE && n <= MAX_COMPARE;
    $("selected-count").textContent = n ? `${n} selected${n > MAX_COMPARE ? ` (at most ${MAX_COMPARE})` : ""}`
      : `select ${MIN_COMPARE}–${MAX_COMPARE} jobs to compare`;
    $("selected-clear").hidden = !n;
    $("compare-open").disabled = !fits;
    $("compare-open").textContent = fits ? `Compare ${n}` : "Compare";
  };
  const pick = (job) => {
    const box = el("input", { type: "checkbox", "aria-label": `select ${job.name}` });
    box.checked = selected.has(job.id);
    box.onchange = () => {
      if (box.checked) selected.set(job.id, job.name); else selected.delete(job.id);
      renderSelection();
    };
    return box;
  };
  const tagLink = (tag) => {
    const b = el("button", { type: "button", cls: "tag", title: `only jobs tagged ${tag}` }, tag);
    b.onclick = () => { $("filter-tag").value = tag; applyFilter(); };
    return b;
  };
  const render = (body) => {
    const rows = body.items.map((job) => el("tr", { "data-job": job.id },
      el("td", { cls: "pick" }, pick(job)),
      el("td", { title: job.status === "queued" && job.pending_reason ? `waiting: ${job.pending_reason}` : "" },
        statusBadge(job.status)),
      el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name),
        ...(job.spec.tags || []).map(tagLink)),
      el("td", {}, job.owner), el("td", {}, strategyOf(job)), el("td", { cls: "num" }, worldSize(job.spec)),
      el("td", {}, progressBar(job)),
      el("td", { cls: "age", "data-time": job.created_at, title: when(job.created_at) }, ago(job.created_at))));
    document.querySelector("#jobs-table tbody").replaceChildren(...rows);
    $("jobs-empty").hidden = rows.length > 0;
    next = body.next_cursor;
    $("page-next").disabled = !next;
    $("page-prev").disabled = listState.cursors.length < 2;
    $("page-no").textContent = `page ${listState.cursors.length}`;
  };
  // NOTE: the table may show another URL's answer (a filter just left): a 304 for this one (its copy unchanged
  // since we last asked) must still be drawn, or going back to a filter keeps the other filter's rows.
  let shown = null;
  const restart = () => {
    stop();
    stop = every(2000, async () => {
      const url = pageUrl();
      const { body, changed } = await getJson(url);
      if (changed || shown !== url) { render(body); shown = url; }
      for (const cell of document.querySelectorAll("#jobs-table td.age")) cell.textContent = ago(cell.dataset.time);
    });
  };
  // A new filter: back to the newest page, the URL rewritten (so the view can be bookmarked), a new poll.
  const applyFilter = () => {
    Object.assign(filter, { name: $("filter-name").value.trim(), tag: $("filter-tag").value.trim(),
      sweep: $("filter-sweep").value.trim() });
    listState.filterKey = JSON.stringify(filter); listState.cursors = [null];
    keepInUrl("/", filter);
    restart();
  };
  let typing;
  for (const id of ["filter-name", "filter-tag", "filter-sweep"]) {
    $(id).value = filter[id.slice("filter-".length)];
    $(id).oninput = () => { clearTimeout(typing); typing = setTimeout(applyFilter, 300); };
  }
  $("list-filter").onsubmit = (ev) => { ev.preventDefault(); clearTimeout(typing); applyFilter(); };
  for (const chip of document.querySelectorAll("#status-filter button")) {
    chip.classList.toggle("on", chip.dataset.status === filter.status);
    chip.onclick = () => {
      filter.status = chip.dataset.status;
      for (const c of document.querySelectorAll("#status-filter button")) c.classList.toggle("on", c === chip);
      applyFilter();
    };
  }
  $("selected-clear").onclick = () => {
    selected.clear(); renderSelection();
    for (const box of document.querySelectorAll("#jobs-table td.pick input")) box.checked = false;
  };
  $("compare-open").onclick = () => { location.hash = hashOf("/compare", { ids: [...selected.keys()].join(",") }); };
  $("page-next").onclick = () => { if (next) { listState.cursors.push(next); restart(); } };
  $("page-prev").onclick = () => { if (listState.cursors.length > 1) { listState.cursors.pop(); restart(); } };
  renderSelection();
  restart();
  return () => { clearTimeout(typing); stop(); };
}

// ---- Metric series: points from the stream are merged in step order (a step seen again replaces the old
// value: a retry's), and a series that grows past 2 * MAX_POINTS is thinned as the API does (min and max per
// bucket, always the last point), so a long job's charts stay small.
function upsert(s, step, value) {
  const n = s.steps.length;
  if (!n || step > s.steps[n - 1]) { s.steps.push(step); s.values.push(value); return; }
  let lo = 0, hi = n;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (s.steps[mid] < step) lo = mid + 1; else hi = mid; }
  if (s.steps[lo] === step) s.values[lo] = value;
  else { s.steps.splice(lo, 0, step); s.values.splice(lo, 0, value); }
}
function thin(s, max) {
  const out = { steps: [], values: [] }, size = Math.ceil(s.steps.length / Math.max(1, Math.floor(max / 2)));
  for (let i = 0; i < s.steps.length - 1; i += size) {
    const end = Math.min(i + size, s.steps.length - 1);
    let lo = i, hi = i;
    for (let k = i; k < end; k++) { if (s.values[k] < s.values[lo]) lo = k; if (s.values[k] > s.values[hi]) hi = k; }
    for (const k of lo === hi ? [lo] : [Math.min(lo, hi), Math.max(lo, hi)]) {
      out.steps.push(s.steps[k]); out.values.push(s.values[k]);
    }
  }
  out.steps.push(s.steps.at(-1)); out.values.push(s.values.at(-1));
  return out;
}
function mergeSeries(series, incoming) {
  for (const s of incoming) {
    const cur = series.get(s.name) || { steps: [], values: [] };
    s.steps.forEach((step, i) => upsert(cur, step, s.values[i]));
    series.set(s.name, cur.steps.length > 2 * MAX_POINTS ? thin(cur, MAX_POINTS) : cur);
  }
}

// A line chart: axes with three y ticks, the first and last step, one path per series, a legend if several.
// zero: the y axis starts at 0 (throughput, memory), so noise does not look like a trend. A line's colour is
// its `color` (0..9: the compare view keeps a job's colour while another job has no points), else its place.
// legend: false when the caller draws its own (the compare view's names are too long for the chart's corner).
// empty: what a chart without a point says ("no data yet" while the job may still report).
function drawChart(node, lines, { zero = false, width: W = 360, height: H = 170, legend = true,
  empty = "no data yet" } = {}) {
  const L = 52, R = 10, T = 12, B = 22;
  node.setAttribute("viewBox", `0 0 ${W} ${H}`);
  node.replaceChildren();
  const drawn = lines.filter((l) => l.steps.length);
  if (!drawn.length) { node.append(svg("text", { x: W / 2, y: H / 2, class: "empty" }, empty)); return; }
  const xs = drawn.flatMap((l) => [l.steps[0], l.steps.at(-1)]), ys = drawn.flatMap((l) => l.values);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (zero) y0 = Math.min(0, y0);
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    node.append(svg("line", { x1: L, x2: W - R, y1: py(y), y2: py(y), class: "grid" }),
      svg("text", { x: L - 6, y: py(y) + 4, class: "tick y" }, tick(y, y1 - y0)));
  }
  node.append(svg("text", { x: L, y: H - 6, class: "tick" }, `step ${x0}`),
    svg("text", { x: W - R, y: H - 6, class: "tick end" }, `${x1}`));
  drawn.forEach((l, i) => {
    const d = l.steps.map((s, k) => `${k ? "L" : "M"}${px(s).toFixed(1)},${py(l.values[k]).toFixed(1)}`).join("");
    const c = `s${l.color ?? i}`;
    node.append(svg("path", { d, class: `line ${c}` }));
    if (l.steps.length === 1) {
      node.append(svg("circle", { cx: px(l.steps[0]), cy: py(l.values[0]), r: 3, class: `dot ${c}` }));
    }
    if (legend && drawn.length > 1) {
      node.append(svg("text", { x: W - R, y: T + 10 + 12 * i, class: `legend end ${c}` }, l.name));
    }
  });
}
// nodes: a gang's other nodes' peak memory (node rank → series), one line each beside node 0's.
// ended: the job has ended, so a chart with no point will get none ("none reported", not "no data yet").
function drawCharts(series, nodes = new Map(), ended = false) {
  const get = (name) => ({ name, ...(series.get(name) || { steps: [], values: [] }) });
  const empty = ended ? "none reported" : "no data yet";
  drawChart($("chart-loss"), [get("loss"), get("eval_loss")], { empty });
  const rate = series.has("tokens_per_s") ? "tokens_per_s" : "samples_per_s";
  $("throughput-caption").textContent = rate.replaceAll("_", " ").replace(" per s", "/s");
  drawChart($("chart-throughput"), [get(rate)], { zero: true, empty });
  const memory = [{ ...get("peak_mem_mb"), name: nodes.size ? "node 0" : "peak_mem_mb" }];
  for (const [rank, s] of nodes) memory.push({ ...s, name: `node ${rank}` });
  drawChart($("chart-memory"), memory, { zero: true, empty });
  // Each rank's own step time (step_time_s/rank<r>, stragglers) and use of its device: a line per rank.
  const ranks = perRank(series, "step_time_s/rank").map((l) => ({ ...l, values: l.values.map((v) => v * 1000) }));
  drawChart($("chart-ranks"), ranks, { zero: true, empty });
  const gpu = series.has("gpu_util");
  $("usage-caption").textContent = gpu ? "GPU utilisation (%)" : "CPU use per rank (% of a core)";
  drawChart($("chart-usage"), gpu ? [get("gpu_util")] : perRank(series, "cpu_util/rank"), { zero: true, empty });
}
// The series `<prefix><rank>` as lines named "rank r": with many ranks, the MAX_RANK_LINES highest at their
// last point (for step time, the slowest ranks), in rank order.
function perRank(series, prefix) {
  const lines = [];
  for (const [name, s] of series) {
    const suffix = name.startsWith(prefix) ? name.slice(prefix.length) : "";
    if (/^\d+$/.test(suffix) && s.steps.length) lines.push({ ...s, rank: Number(suffix), name: `rank ${suffix}` });
  }
  lines.sort((a, b) => b.values.at(-1) - a.values.at(-1));
  return lines.slice(0, MAX_RANK_LINES).sort((a, b) => a.rank - b.rank);
}

// ---- Server-Sent Events over fetch(): EventSource cannot send an Authorization header.
async function readEvents(path, lastId, onEvent, signal) {
  const r = await api(path, { headers: lastId ? { "Last-Event-ID": lastId } : {}, signal });
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "", fields = {};
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let i;
    while ((i = buf.search(/[\r\n]/)) >= 0) {
      if (buf[i] === "\r" && i === buf.length - 1) break; // a \r\n split across chunks: wait for the \n
      const line = buf.slice(0, i);
      buf = buf.slice(buf[i] === "\r" && buf[i + 1] === "\n" ? i + 2 : i + 1);
      if (line === "") { if (fields.data !== undefined) onEvent(fields); fields = {}; continue; }
      if (line.startsWith(":")) continue; // a comment: the server's keep-alive ping
      const colon = line.indexOf(":"), key = colon < 0 ? line : line.slice(0, colon);
      const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      fields[key] = key === "data" && fields.data !== undefined ? `${fields.data}\n${val}` : val;
    }
  }
}

function jobView(id) {
  show("job");
  const base = `/v1/jobs/${encodeURIComponent(id)}`, aborter = new AbortController(), series = new Map();
  const nodes = new Map(); // a gang's nodes 1.. (up to MAX_NODE_LINES - 1): their own peak memory
  const decoder = new TextDecoder();
  let stopped = false, job = null, logOffset = 0, drawQueued = false;
  for (const k of ["job-name", "job-meta", "job-summary", "job-progress", "log", "job-spec", "plan-reason",
    "plan-check"]) $(k).textContent = "";
  $("job-cancel-error").hidden = true; $("job-error-box").hidden = true;
  for (const t of ["plan-table", "attempts-table"]) document.querySelector(`#${t} tbody`).replaceChildren();
  drawCharts(series);
  const redraw = () => {
    if (drawQueued) return;
    drawQueued = true;
    requestAnimationFrame(() => {
      drawQueued = false;
      drawCharts(series, nodes, Boolean(job) && TERMINAL.has(job.status));
    });
  };
  let jobReadAt = Date.now();
  const refreshJob = async () => {
    const { body, changed } = await getJson(base);
    const first = job === null; // a 304 on the first read (another view read it): still this view's first render
    job = body;
    if (changed || first) { renderJob(body); redraw(); } // an ended job's empty charts say so
  };
  const refreshAttempts = async () => renderAttempts((await (await api(`${base}/attempts`)).json()).items);
  let streamFrom = null; // the metrics answer's cursor: the stream then sends only newer points
  const loadMetrics = async () => {
    const body = await (await api(`${base}/metrics?max_points=${MAX_POINTS}`)).json();
    mergeSeries(series, body.series); redraw();
    streamFrom = String(body.cursor);
  };
  // The stream carries node 0's points (the job's series); each other node's memory is polled.
  let stopNodes = () => {};
  const loadNodes = async () => {
    const count = Math.min(job?.spec?.resources?.nnodes ?? 1, MAX_NODE_LINES);
    for (let rank = 1; rank < count; rank++) {
      const q = `name=peak_mem_mb&max_points=${MAX_POINTS}&node_rank=${rank}`;
      const body = await (await api(`${base}/metrics?${q}`, { signal: aborter.signal })).json();
      nodes.set(rank, body.series[0] || { steps: [], values: [] });
    }
    redraw();
    return count > 1 && !TERMINAL.has(job.status);
  };
  const onEvent = (ev) => {
    const data = JSON.parse(ev.data);
    if (ev.event === "metrics") { mergeSeries(series, data.series); redraw(); }
    if (ev.event === "progress" && job) {
      job.progress = { ...job.progress, ...data }; renderProgress(job);
      if (Date.now() - jobReadAt > 5000) { jobReadAt = Date.now(); refreshJob().catch(report); } // warnings
    }
    if (ev.event === "status") { refreshJob().catch(report); refreshAttempts().catch(report); }
    return ev.event === "status" && TERMINAL.has(data.status);
  };
  // The stream ends after the terminal status; any other end is a drop: reconnect where it left off.
  const follow = async () => {
    let lastId = streamFrom, ended = false;
    while (!stopped && !ended) {
      try {
        await readEvents(`${base}/events`, lastId, (ev) => {
          if (ev.id !== undefined) lastId = ev.id;
          ended = onEvent(ev) || ended;
        }, aborter.signal);
      } catch (e) { if (!stopped) report(e); }
      if (!ended && !stopped) await sleep(2000);
    }
  };
  const stopLog = every(1000, async () => {
    const r = await api(`${base}/logs?offset=${logOffset}`, { signal: aborter.signal });
    const bytes = await r.arrayBuffer();
    logOffset = Number(r.headers.get("X-Next-Offset") || logOffset + bytes.byteLength);
    appendLog(decoder.decode(bytes, { stream: true }));
    const done = TERMINAL.has(r.headers.get("X-Job-Status"));
    $("log-state").textContent = done ? "(ended)" : "(following)";
    return !done; // a read made once the job ended holds the whole log
  });
  $("job-cancel").onclick = async () => {
    $("job-cancel-error").hidden = true;
    try { renderJob(await (await api(`${base}/cancel`, { method: "POST" })).json()); } catch (e) {
      $("job-cancel-error").textContent = `Cancel refused: ${e.message}`; $("job-cancel-error").hidden = false;
    }
  };
  Promise.all([refreshJob(), refreshAttempts(), loadMetrics()]).then(() => {
    if (!stopped) stopNodes = every(5000, loadNodes);
    return follow();
  }, report);
  return () => { stopped = true; stopLog(); stopNodes(); aborter.abort(); };
}
function appendLog(text) {
  if (!text) return;
  const pre = $("log"), atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.textContent = (pre.textContent + text).slice(-LOG_KEEP);
  if (atBottom) pre.scrollTop = pre.scrollHeight;
}
function renderProgress(job) {
  const none = reportsNoSteps(job);
  $("job-progress-box").hidden = none;
  $("job-no-steps").hidden = !none;
  $("job-no-steps").textContent = none ? `${TERMINAL.has(job.status) ? "This job reported" : "No"} no steps` +
    `${TERMINAL.has(job.status) ? "" : " reported yet"}, so there is no step bar or chart: ${HOW_TO_REPORT}.` : "";
  $("job-bar").className = `fill ${job.status}`;
  $("job-bar").style.width = `${(progressFraction(job) * 100).toFixed(1)}%`;
  $("job-progress").textContent = progressText(job);
}
function renderJob(job) {
  $("job-name").textContent = job.name;
  $("job-status").className = `badge ${job.status}`;
  $("job-status").textContent = job.status;
  const ended = job.finished_at ? ` · ended ${ago(job.finished_at)}` : "";
  $("job-meta").textContent = `${job.id} · ${job.owner} · ${strategyOf(job)} on ${worldSize(job.spec)} ` +
    `${(job.spec.resources || {}).device || ""} · priority ${job.priority} · attempt ${job.attempt}/` +
    `${job.max_retries + 1} · submitted ${ago(job.created_at)}${ended}`;
  // Queued: why no worker has taken it (the sweeper's words), where the user looks first.
  $("job-pending").hidden = !(job.status === "queued" && job.pending_reason);
  $("job-pending").textContent = job.pending_reason ? `waiting: ${job.pending_reason}` : "";
  const cancel = $("job-cancel");
  cancel.hidden = TERMINAL.has(job.status);
  cancel.disabled = Boolean(job.cancel_requested_at);
  cancel.textContent = job.cancel_requested_at ? "Cancelling…" : "Cancel";
  renderProgress(job);
  const facts = Object.entries(job.summary || {}).filter(([, v]) => typeof v === "number");
  $("job-summary").textContent = facts
    .map(([k, v]) => `${k.replaceAll("_", " ")} ${Number.isInteger(v) ? v : v.toPrecision(4)}`).join(" · ");
  renderPerformance(job.performance);
  $("job-spec").textContent = JSON.stringify(job.spec, null, 2);
  $("job-error-box").hidden = !job.error;
  if (job.error) {
    const e = job.error, rank = e.rank !== undefined && e.rank !== null ? ` (rank ${e.rank})` : "";
    $("job-error").textContent = `${e.type || "error"}${rank}: ${e.message || ""}`;
    $("job-traceback").textContent = e.traceback || e.excerpt || "";
  }
  const warnings = job.warnings || [];
  $("job-warnings-box").hidden = warnings.length === 0;
  $("job-warnings").replaceChildren(...warnings.map((w) => el("li", {}, `${w.kind}: ${w.message}`)));
  renderPlan(job);
}
// Throughput and MFU from the run's summary (GET /v1/jobs/{id}'s `performance`); nothing where it has none.
function renderPerformance(perf) {
  const p = perf || {}, parts = [];
  if (typeof p.tokens_per_s === "number") parts.push(`${fmt(p.tokens_per_s)} tokens/s`);
  else if (typeof p.samples_per_s === "number") parts.push(`${fmt(p.samples_per_s)} samples/s`);
  if (typeof p.step_time_s === "number") parts.push(`${(1000 * p.step_time_s).toPrecision(3)} ms/step`);
  if (typeof p.mfu === "number") parts.push(`MFU ${(100 * p.mfu).toFixed(1)}% of ${p.device_name || "the device"}'s ` +
    `${p.precision || ""} peak`);
  else if (parts.length) parts.push("MFU unknown (no FLOPs count or an unknown device)");
  if (typeof p.gpu_util === "number") parts.push(`GPU busy ${p.gpu_util.toFixed(0)}%`);
  if (typeof p.gpu_mem_peak_mb === "number") parts.push(`GPU memory peak ${fmt(p.gpu_mem_peak_mb)} MB (NVML)`);
  if (p.compiled) parts.push("compiled");
  $("job-performance").hidden = !parts.length;
  $("job-performance").textContent = parts.length ? `Performance: ${parts.join(" · ")}` : "";
}
function renderStacks(attempts) {
  // The latest dump of any node of any attempt (a hang's, or one asked for with POST .../stacks).
  const dumped = attempts.filter((a) => a.stacks).sort((a, b) => (a.stacks.taken_at < b.stacks.taken_at ? 1 : -1));
  $("job-stacks-box").hidden = dumped.length === 0;
  if (!dumped.length) return;
  const a = dumped[0], s = a.stacks;
  $("job-stacks-meta").textContent = `attempt ${a.number}, node ${a.node_rank} · ${s.reason} · ${when(s.taken_at)}`;
  $("job-stacks").replaceChildren(...s.ranks.map((r) => el("details", {},
    el("summary", {}, `rank ${r.rank ?? "?"} (pid ${r.pid}): ${r.where}`), el("pre", {}, r.text))));
}
function renderPlan(job) {
  const plan = job.plan, head = document.querySelector("#plan-table thead");
  const body = document.querySelector("#plan-table tbody");
  if (!plan) {
    $("plan-reason").textContent = "No plan: the job runs its own script.";
    head.replaceChildren(); body.replaceChildren();
    return;
  }
  $("plan-reason").textContent = plan.reason;
  const cols = ["ddp", "fsdp"], chosen = (s) => (s === plan.strategy ? "chosen" : "");
  head.replaceChildren(el("tr", {}, el("th", {}, ""), ...cols.map((s) => el("th", { cls: chosen(s) }, s))));
  const parts = [...new Set(cols.flatMap((s) => Object.keys(plan[s].breakdown)))];
  const row = (label, f, cls = "") => el("tr", { cls }, el("th", {}, label),
    ...cols.map((s) => el("td", { cls: `num ${chosen(s)}` }, f(plan[s]))));
  body.replaceChildren(...parts.map((p) => row(p.replaceAll("_", " "), (e) => bytes(e.breakdown[p] || 0))),
    row("per device", (e) => bytes(e.total_bytes), "total"));
  const m = job.memory || {};
  const measured = m.measured_peak_mb ? ` · measured peak ${m.measured_peak_mb.toFixed(1)} MB` : "";
  $("plan-check").textContent = `${plan.device} memory ${plan.device_memory_gib} GiB per rank ` +
    `(${plan.device_memory_source}), limit ${plan.limit_gib} GiB${measured}`;
}
function renderAttempts(attempts) {
  renderStacks(attempts);
  document.querySelector("#attempts-table tbody").replaceChildren(...attempts.map((a) => el("tr", {},
    el("td", { cls: "num" }, a.number), el("td", {}, a.worker), el("td", {}, statusBadge(a.status)),
    el("td", { title: when(a.started_at) }, ago(a.started_at)),
    el("td", { title: when(a.finished_at) }, ago(a.finished_at)), el("td", { cls: "num" }, a.exit_code ?? ""),
    el("td", { cls: "error" }, a.error ? `${a.error.type}: ${a.error.message}` : ""))));
}

// ---- The compare view: 2–10 jobs' curves of one metric on shared axes, their summaries side by side, and the
// spec fields that differ. One job read and one metrics read (every series, thinned) per job, repeated every 5 s
// for a job that has not ended; a job the API does not show this user (another's, or none) is a 404: its column
// says so and the others are drawn.
const fmt = (v) => (typeof v !== "number" ? (v ?? "") : Number.isInteger(v) ? String(v) : v.toPrecision(4));
// A spec as dotted paths: objects are walked, anything else (a list too) is one value.
function flatten(value, prefix = "", out = new Map()) {
  if (value && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
    for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else out.set(prefix, value);
  return out;
}
// The paths whose values are not all equal (one missing counts as different), and how many are. `name` is left
// out: every column is headed by it.
function specDiff(specs) {
  const flat = specs.map((spec) => flatten(spec));
  const paths = [...new Set(flat.flatMap((f) => [...f.keys()]))].filter((p) => p !== "name");
  const differs = (p) => new Set(flat.map((f) => JSON.stringify(f.get(p)))).size > 1;
  return { flat, differ: paths.filter(differs), same: paths.filter((p) => !differs(p)) };
}
function specValue(v) {
  if (v === undefined) return el("span", { cls: "muted", title: "not in this spec" }, "—");
  return typeof v === "string" ? v : JSON.stringify(v);
}
function runSummary(run) {
  const job = run.job, sum = job.summary || {}, loss = run.series.get("loss");
  const rate = sum.tokens_per_s !== undefined ? ["tokens_per_s", "tokens/s"] : ["samples_per_s", "samples/s"];
  const started = job.started_at ? Date.parse(job.started_at) : null;
  const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
  return {
    status: statusBadge(job.status),
    steps: job.progress.total_steps ? `${sum.steps ?? job.progress.step}/${job.progress.total_steps}`
      : fmt(sum.steps ?? job.progress.step),
    "final loss": sum.final_loss === null ? "not finite" : sum.final_loss !== undefined ? fmt(sum.final_loss)
      : loss && loss.values.length ? `${fmt(loss.values.at(-1))} (last)` : "",
    throughput: typeof sum[rate[0]] === "number" ? `${fmt(sum[rate[0]])} ${rate[1]}` : "",
    duration: started === null ? "" : `${duration((end - started) / 1000)}${job.finished_at ? "" : " so far"}`,
  };
}

function compareView(query) {
  show("compare");
  const asked = [...new Set((query.get("ids") || "").split(",").map((id) => id.trim()).filter(Boolean))];
  const runs = asked.slice(0, MAX_COMPARE).map((id, color) => ({ id, color, job: null, series: new Map(),
    error: null, done: false }));
  let metric = query.get("metric") || "", names = "", showSame = false, stopped = false;
  const notes = [];
  if (asked.length > MAX_COMPARE) notes.push(`Showing the first ${MAX_COMPARE} of ${asked.length} jobs.`);
  if (asked.length < MIN_COMPARE) notes.push(`Pick ${MIN_COMPARE}–${MAX_COMPARE} jobs on the Jobs page to compare.`);
  $("compare-note").textContent = notes.join(" ");
  $("compare-note").hidden = !notes.length;
  $("compare-count").textContent = `${runs.length} job${runs.length === 1 ? "" : "s"}`;
  $("compare-metric").replaceChildren();
  const label = (run) => (run.job ? run.job.name : run.id);
  const swatch = (run) => el("span", { cls: run.job ? `swatch s${run.color}` : "swatch" }); // grey: no line
  const head = (run) => el("th", { cls: "run" }, swatch(run),
    run.job ? el("a", { href: `#/jobs/${encodeURIComponent(run.id)}` }, run.job.name) : run.id,
    el("div", { cls: "muted id" }, run.job ? run.id : ""));

  const load = async (run) => {
    const base = `/v1/jobs/${encodeURIComponent(run.id)}`;
    try {
      const { body } = await getJson(base);
      const metrics = await (await api(`${base}/metrics?max_points=${MAX_POINTS}`)).json();
      Object.assign(run, { job: body, error: null, done: TERMINAL.has(body.status),
        series: new Map(metrics.series.map((s) => [s.name, s])) });
    } catch (e) {
      // NOTE: the API answers 404 alike for another user's job and for none, so the page cannot say which.
      // Another refusal (a malformed id) will not mend itself either; an outage or a 429 is tried again, and
      // what was drawn before it stays.
      const refused = e.status >= 400 && e.status < 500 && e.status !== 429;
      if (refused) Object.assign(run, { job: null, series: new Map(), done: true });
      run.error = e.status === 404 ? "not found" : e.message;
    }
  };
  const renderMetricChoice = () => {
    const all = new Set(runs.flatMap((run) => [...run.series.keys()]));
    const sorted = [...all].sort((a, b) => (a === "loss" ? -1 : b === "loss" ? 1 : a.localeCompare(b)));
    if (!all.has(metric) && all.size) metric = all.has("loss") ? "loss" : sorted[0];
    if (sorted.join("\n") !== names) { // rebuilt only when the union changes, so an open select stays open
      names = sorted.join("\n");
      $("compare-metric").replaceChildren(...sorted.map((n) => el("option", { value: n }, n)));
    }
    $("compare-metric").value = metric;
    $("compare-caption").textContent = metric || "no metrics yet";
  };
  const renderChart = () => {
    const lines = runs.filter((run) => run.job).map((run) => ({ name: label(run), color: run.color,
      ...(run.series.get(metric) || { steps: [], values: [] }) }));
    drawChart($("compare-chart"), lines, { width: 900, height: 300, legend: false });
    $("compare-legend").replaceChildren(...runs.map((run) => el("li", { cls: run.job ? "" : "error" },
      swatch(run), el("span", { cls: "name" }, label(run)), " ",
      el("span", { cls: "muted" }, run.job ? run.id : run.error || "loading…"),
      run.job && !run.series.get(metric) ? el("span", { cls: "muted" }, ` (no ${metric})`) : null)));
  };
  const renderSummary = () => {
    const rows = ["status", "steps", "final loss", "throughput", "duration"], cells = runs.map((run) =>
      (run.job ? runSummary(run) : { status: el("span", { cls: "error" }, run.error || "loading…") }));
    document.querySelector("#compare-summary thead").replaceChildren(el("tr", {}, el("th", {}), ...runs.map(head)));
    document.querySelector("#compare-summary tbody").replaceChildren(...rows.map((row) => el("tr", {},
      el("th", {}, row), ...cells.map((c) => el("td", { cls: "num" }, c[row] ?? "")))));
  };
  const renderSpec = () => {
    const found = runs.filter((run) => run.job), { flat, differ, same } = specDiff(found.map((run) => run.job.spec));
    $("compare-same").textContent = found.length < 2 ? "" : differ.length
      ? `${same.length} identical field${same.length === 1 ? "" : "s"} ${showSame ? "shown" : "hidden"}`
      : `none: the ${same.length} fields are identical`;
    $("compare-show-same").hidden = found.length < 2 || !same.length;
    $("compare-show-same").textContent = showSame ? "hide" : "show";
    const row = (path, cls) => el("tr", { cls }, el("th", {}, path),
      ...flat.map((f) => el("td", {}, specValue(f.get(path)))));
    document.querySelector("#compare-spec thead").replaceChildren(el("tr", {}, el("th", {}, "field"),
      ...found.map(head)));
    document.querySelector("#compare-spec tbody").replaceChildren(...differ.map((p) => row(p, "differs")),
      ...(showSame ? same.map((p) => row(p, "same muted")) : []));
  };
  const render = () => { renderMetricChoice(); renderChart(); renderSummary(); renderSpec(); };

  $("compare-metric").onchange = () => {
    metric = $("compare-metric").value;
    keepInUrl("/compare", { ids: asked.join(","), metric });
    render();
  };
  $("compare-show-same").onclick = () => { showSame = !showSame; renderSpec(); };
  render();
  const stop = every(5000, async () => {
    await Promise.all(runs.filter((run) => !run.done).map(load));
    if (stopped) return false;
    render();
    return runs.some((run) => !run.done);
  });
  return () => { stopped = true; stop(); };
}

// The jobs a worker runs now: every holder of its devices (a shared worker runs several), else its current job.
function runningJobs(w) {
  if (w.jobs && w.jobs.length) return w.jobs;
  return w.current_job ? [w.current_job] : [];
}

// #/workers?state=&label=&free=: a page of GET /v1/workers at a time (WORKERS_PAGE, by worker id), filtered by
// the API (state, every label k=v, at least `free` free devices); cursors[i]: the cursor of page i.
const WORKERS_PAGE = 50;
function workersView() {
  show("workers");
  const [, query] = hashParts();
  const filter = { state: query.get("state") || "", label: query.get("label") || "", free: query.get("free") || "" };
  let cursors = [null], next = null, shown = null, stop = () => {};
  const pageUrl = () => {
    const q = new URLSearchParams({ limit: WORKERS_PAGE });
    if (filter.state) q.set("state", filter.state);
    for (const label of filter.label.split(/[\s,]+/).filter((l) => l.includes("="))) q.append("label", label);
    if (Number(filter.free) > 0) q.set("min_free_devices", String(Math.floor(Number(filter.free))));
    if (cursors.at(-1)) q.set("cursor", cursors.at(-1));
    return `/v1/workers?${q}`;
  };
  const render = (body) => {
    const rows = body.items.map((w) => el("tr", {},
      el("td", { title: w.pressure || "" }, statusBadge(w.state), w.pressure ? " disk pressure" : ""),
      el("td", {}, w.id), el("td", { title: w.address }, w.host),
      el("td", {}, w.device),
      el("td", { cls: "muted" }, Object.entries(w.labels || {}).map(([k, v]) => `${k}=${v}`).join(", ")),
      el("td", { cls: "num" }, w.memory_gb !== null && w.memory_gb !== undefined ? `${w.memory_gb} GiB` : ""),
      el("td", { cls: "num" }, `${w.busy_slots}/${w.slots}`),
      el("td", { cls: "devices" }, ...(w.devices || []).map((d) => el("span", {
        cls: `dev ${d.state}`,
        title: `${w.device === "cuda" ? "GPU" : "slot"} ${d.index}${d.uuid ? ` (${d.uuid})` : ""}: ${d.state}` +
          `${d.job ? ` by ${d.job}` : ""}${d.reason ? ` (${d.reason})` : ""}`,
      }))),
      el("td", {}, ...(runningJobs(w).length ? runningJobs(w).flatMap((id, i) => [i ? " " : "",
        el("a", { href: `#/jobs/${encodeURIComponent(id)}` }, id)]) : ["idle"])),
      el("td", { title: when(w.last_seen) }, ago(w.last_seen))));
    document.querySelector("#workers-table tbody").replaceChildren(...rows);
    $("workers-empty").hidden = rows.length > 0;
    next = body.next_cursor;
    $("workers-next").disabled = !next;
    $("workers-prev").disabled = cursors.length < 2;
    $("workers-page-no").textContent = `page ${cursors.length}`;
  };
  const restart = () => {
    stop();
    stop = every(2000, async () => {
      const url = pageUrl();
      const { body, changed } = await getJson(url);
      if (changed || shown !== url) { render(body); shown = url; } // (a 304 for a page another filter replaced)
    });
  };
  // A new filter: back to the first page, the URL rewritten (so the view can be bookmarked), a new poll.
  const applyFilter = () => {
    Object.assign(filter, { label: $("filter-label").value.trim(), free: $("filter-free").value.trim() });
    cursors = [null];
    keepInUrl("/workers", filter);
    restart();
  };
  let typing;
  $("filter-label").value = filter.label;
  $("filter-free").value = filter.free;
  for (const id of ["filter-label", "filter-free"]) {
    $(id).oninput = () => { clearTimeout(typing); typing = setTimeout(applyFilter, 300); };
  }
  $("workers-filter").onsubmit = (ev) => { ev.preventDefault(); clearTimeout(typing); applyFilter(); };
  for (const chip of document.querySelectorAll("#worker-state-filter button")) {
    chip.classList.toggle("on", chip.dataset.state === filter.state);
    chip.onclick = () => {
      filter.state = chip.dataset.state;
      for (const c of document.querySelectorAll("#worker-state-filter button")) c.classList.toggle("on", c === chip);
      applyFilter();
    };
  }
  $("workers-next").onclick = () => { if (next) { cursors.push(next); restart(); } };
  $("workers-prev").onclick = () => { if (cursors.length > 1) { cursors.pop(); restart(); } };
  restart();
  return () => { clearTimeout(typing); stop(); };
}

// The fair pool's queue (GET /v1/queue): your waiting jobs in start order and why; others' only counted.
function queueView() {
  show("queue");
  return every(3000, async () => {
    const { body: q } = await getJson("/v1/queue");
    const you = q.you;
    $("queue-standing").textContent = `policy ${q.policy} · ${q.waiting} waiting · you (${you.user}` +
      `${you.team ? `, team ${you.team}` : ""}): ${you.usage_device_hours.toFixed(2)} device-hours recently, ` +
      `share ${you.share.toFixed(2)} · ${q.others_waiting} job(s) of others waiting, ${q.others_ahead} ahead of ` +
      "your first";
    $("queue-reservation").hidden = q.reservations.length === 0;
    $("queue-reservation").replaceChildren(...q.reservations.map((r) => el("div", {},
      `reservation: ${r.held} of ${r.workers} workers held for ` +
      `${r.job_id ? `job ${r.job_id}` : "another user's job"}, filled by ${when(r.fill_by)}, deadline ` +
      when(r.deadline))));
    const rows = q.jobs.map((j) => el("tr", {},
      el("td", { cls: "num" }, j.position),
      el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.name || j.id)),
      el("td", {}, j.owner), el("td", {}, j.priority),
      el("td", { title: when(j.estimated_start) }, j.estimated_start ? when(j.estimated_start) : "-"),
      el("td", { cls: "reason" }, j.reason || "starting now")));
    document.querySelector("#queue-table tbody").replaceChildren(...rows);
    $("queue-empty").hidden = rows.length > 0;
  });
}

showToken();
route();
