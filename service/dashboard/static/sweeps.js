// The sweeps views (#/sweeps, #/sweeps/<id>): the list, and one sweep's trials table (sortable by its metric)
// with a scatter of one chosen parameter against the metric. Loaded before app.js, whose helpers (el, svg, $,
// api, getJson, every, show, statusBadge, ago, tick) these functions use when called; app.js's route() calls them.
"use strict";

function sweepsView() {
  show("sweeps");
  return every(2000, async () => {
    const { body, changed } = await getJson("/v1/sweeps?limit=50");
    if (!changed) return;
    const rows = body.items.map((s) => el("tr", { "data-sweep": s.id },
      el("td", {}, statusBadge(s.status)),
      el("td", {}, el("a", { href: `#/sweeps/${encodeURIComponent(s.id)}` }, s.name)),
      el("td", {}, s.owner), el("td", {}, s.method),
      el("td", { cls: "num" }, `${s.trials.made}/${s.trials.total}`),
      el("td", { cls: "num" }, s.best ? `${s.metric.name} ${sweepFmt(s.best.best)}` : ""),
      el("td", { title: when(s.created_at) }, ago(s.created_at))));
    document.querySelector("#sweeps-table tbody").replaceChildren(...rows);
    $("sweeps-empty").hidden = rows.length > 0;
  });
}

const sweepFmt = (v) => (v === null || v === undefined ? "" : typeof v === "number" && !Number.isInteger(v)
  ? String(Number(v.toPrecision(4))) : String(v));

function sweepView(id) {
  show("sweep");
  const base = `/v1/sweeps/${encodeURIComponent(id)}`;
  $("sweep-jobs").href = `#/?sweep=${encodeURIComponent(id)}`; // the list, filtered to this sweep's trials
  const state = { sweep: null, trials: [], order: 1, param: null }; // order 1: best first
  for (const k of ["sweep-name", "sweep-meta", "sweep-best"]) $(k).textContent = "";
  document.querySelector("#trials-table tbody").replaceChildren();
  const render = () => {
    const s = state.sweep;
    if (!s) return;
    $("sweep-name").textContent = s.name;
    $("sweep-status").className = `badge ${s.status}`;
    $("sweep-status").textContent = s.status;
    const t = s.trials, stop = s.early_stopping && s.early_stopping.type !== "none" ? s.early_stopping.type : "none";
    $("sweep-meta").textContent = `${s.id} · ${s.owner} · ${s.method} · ${t.made}/${t.total} trials made, ` +
      `${s.parallel} at a time · ${t.succeeded} succeeded, ${t.stopped_early} stopped early, ${t.failed} failed, ` +
      `${t.cancelled} cancelled · early stopping ${stop} · ${s.metric.goal} ${s.metric.name}` +
      (s.error ? ` · error: ${s.error}` : "");
    $("sweep-best").textContent = s.best
      ? `best ${s.metric.name} ${sweepFmt(s.best.best)}: trial ${s.best.index} ${JSON.stringify(s.best.params)}` : "";
    $("sweep-cancel").hidden = s.status !== "running";
    renderTrials();
    renderScatter();
  };
  const renderTrials = () => {
    const s = state.sweep, paths = Object.keys(s.parameters), sign = s.metric.goal === "minimize" ? 1 : -1;
    const head = document.querySelector("#trials-table thead");
    const sortBtn = el("button", { type: "button", id: "trials-sort", cls: "link" },
      `${s.metric.name} best ${state.order > 0 ? "▲" : "▼"}`);
    sortBtn.onclick = () => { state.order = -state.order; renderTrials(); };
    head.replaceChildren(el("tr", {}, el("th", {}, "#"), el("th", {}, "status"),
      ...paths.map((p) => el("th", {}, p)), el("th", {}, "steps"), el("th", {}, `${s.metric.name} last`),
      el("th", {}, sortBtn)));
    const key = (t) => (t.best === null ? Infinity : state.order * sign * t.best);
    const rows = [...state.trials].sort((a, b) => key(a) - key(b) || a.index - b.index).map((t) => el("tr",
      { "data-trial": t.index, cls: s.best && s.best.index === t.index ? "chosen" : "" },
      el("td", { cls: "num" }, el("a", { href: `#/jobs/${encodeURIComponent(t.job_id)}` }, t.index)),
      el("td", {}, statusBadge(t.reason || t.status)),
      ...paths.map((p) => el("td", { cls: "num" }, sweepFmt(t.params[p]))), el("td", { cls: "num" }, t.steps),
      el("td", { cls: "num" }, sweepFmt(t.last)), el("td", { cls: "num best" }, sweepFmt(t.best))));
    document.querySelector("#trials-table tbody").replaceChildren(...rows);
  };
  const renderScatter = () => {
    const s = state.sweep, paths = Object.keys(s.parameters), pick = $("scatter-param");
    if (!state.param || !paths.includes(state.param)) state.param = paths[0];
    if (pick.options.length !== paths.length) {
      pick.replaceChildren(...paths.map((p) => el("option", { value: p }, p)));
      pick.onchange = () => { state.param = pick.value; renderScatter(); };
    }
    pick.value = state.param;
    const spec = s.parameters[state.param], log = spec.distribution === "log_uniform";
    const shown = state.trials.filter((t) => t.best !== null && typeof t.params[state.param] === "number");
    drawScatter($("sweep-scatter"), shown.map((t) => ({ x: t.params[state.param], y: t.best, index: t.index,
      stopped: t.reason === "stopped_early" })), { log, xLabel: state.param, yLabel: `${s.metric.name} best` });
  };
  $("sweep-cancel").onclick = async () => {
    try { state.sweep = await (await api(`${base}/cancel`, { method: "POST" })).json(); render(); } catch (e) {
      report(e);
    }
  };
  return every(2000, async () => {
    const [{ body: sweep }, trials] = await Promise.all([getJson(base), api(`${base}/trials`).then((r) => r.json())]);
    state.sweep = sweep; state.trials = trials.data;
    render();
    return sweep.status === "running";
  });
}

// One dot per trial: the parameter's value (log scale for a log-uniform one) against the trial's best metric;
// a trial stopped early is a hollow dot.
function drawScatter(node, points, { log = false, xLabel = "", yLabel = "" } = {}) {
  const W = 520, H = 250, L = 58, R = 12, T = 24, B = 34;
  node.setAttribute("viewBox", `0 0 ${W} ${H}`);
  node.replaceChildren();
  if (!points.length) { node.append(svg("text", { x: W / 2, y: H / 2, class: "empty" }, "no data yet")); return; }
  const fx = (x) => (log ? Math.log10(x) : x);
  const xs = points.map((p) => fx(p.x)), ys = points.map((p) => p.y);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 0.5; x1 += 0.5; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const px = (x) => L + ((fx(x) - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    node.append(svg("line", { x1: L, x2: W - R, y1: py(y), y2: py(y), class: "grid" }),
      svg("text", { x: L - 6, y: py(y) + 4, class: "tick y" }, tick(y, y1 - y0)));
  }
  const xTick = (v) => (log ? (10 ** v).toPrecision(2) : tick(v, x1 - x0));
  node.append(svg("text", { x: L, y: H - 18, class: "tick" }, xTick(x0)),
    svg("text", { x: W - R, y: H - 18, class: "tick end" }, xTick(x1)),
    svg("text", { x: (L + W - R) / 2, y: H - 4, class: "tick axis" }, `${xLabel}${log ? " (log)" : ""}`),
    svg("text", { x: 4, y: 10, class: "tick" }, yLabel));
  for (const p of points) {
    node.append(svg("circle", { cx: px(p.x).toFixed(1), cy: py(p.y).toFixed(1), r: 4,
      class: `dot s0${p.stopped ? " hollow" : ""}`, "data-trial": p.index }));
  }
}
