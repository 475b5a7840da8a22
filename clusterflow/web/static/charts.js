// clusterflow dashboard: what every chart of every page shares, as TensorBoard has it: smoothing
// (exponential, debiased), a log y axis, x by step, wall-clock time or time since the run's
// first point, a PNG and a CSV of what is plotted, and these choices kept per browser
// (localStorage). Loaded before dashboard.js, which draws the charts through chart().
"use strict";

// -- the choices, kept per browser ---------------------------------------------------------------

const PREFS_KEY = "clusterflow-dashboard-prefs";
const PREFS_DEFAULT = {
  smoothing: 0, logy: false, x: "step", rankMode: "aggregated", reduce: "last", marked: [],
};

const Prefs = {
  values: { ...PREFS_DEFAULT },
  load() {
    try {
      const kept = JSON.parse(window.localStorage.getItem(PREFS_KEY) || "{}");
      for (const k of Object.keys(PREFS_DEFAULT)) {
        if (kept[k] !== undefined && typeof kept[k] === typeof PREFS_DEFAULT[k]) this.values[k] = kept[k];
      }
    } catch (e) {
      // storage off or a damaged entry: the defaults
    }
    this.values.smoothing = Math.min(0.99, Math.max(0, Number(this.values.smoothing) || 0));
    if (!["step", "wall", "relative"].includes(this.values.x)) this.values.x = "step";
    if (!Array.isArray(this.values.marked)) this.values.marked = [];
    return this.values;
  },
  set(patch) {
    Object.assign(this.values, patch);
    try { window.localStorage.setItem(PREFS_KEY, JSON.stringify(this.values)); } catch (e) { /* off */ }
  },
};
Prefs.load();

// -- smoothing and the x axis ------------------------------------------------------------------

// TensorBoard's smoothing: an exponential moving average, debiased so that its first points are
// not pulled towards zero; a gap (null) stays a gap and does not reset the average.
function smoothed(ys, weight) {
  if (!weight) return ys.slice();
  let last = 0;
  let n = 0;
  return ys.map((y) => {
    if (y === null || y === undefined || !Number.isFinite(y)) return y === undefined ? null : y;
    last = last * weight + (1 - weight) * y;
    n += 1;
    return last / (1 - Math.pow(weight, n));
  });
}

// The x of each point in the chosen mode: the step, the wall-clock time (a date axis), or hours
// since the series' own first point. A point without a time (a row of an older version) is
// left out of the time axes.
function xsOf(steps, times, mode) {
  if (mode === "step" || !times) return steps.slice();
  const t0 = times.find((t) => t !== null && t !== undefined);
  return times.map((t) => {
    if (t === null || t === undefined) return null;
    return mode === "wall" ? new Date(t * 1000) : (t - t0) / 3600;
  });
}

const X_TITLE = { step: "step", wall: "wall-clock time", relative: "hours since the first point" };

// A line of the chosen options: { name, steps, times, ys } -> a Plotly trace, with the raw values
// kept (meta) for the CSV and the hover. ``extra``: more trace properties.
function lineTrace(s, opts, extra) {
  const mode = opts.x;
  const xs = xsOf(s.steps, s.times, mode);
  const keep = xs.map((x) => x !== null);
  const ys = smoothed(s.ys, opts.smoothing);
  const pick = (a) => a.filter((_, i) => keep[i]);
  return {
    type: "scatter",
    mode: "lines",
    name: s.name,
    x: pick(xs),
    y: pick(ys),
    customdata: pick(s.steps),
    meta: { raw: pick(s.ys), steps: pick(s.steps), times: s.times ? pick(s.times) : null },
    hovertemplate: "%{fullData.name}: %{y:.4g} at step %{customdata}<extra></extra>",
    ...extra,
  };
}

function axesOf(opts, layout) {
  const x = { ...(layout && layout.xaxis), title: { text: X_TITLE[opts.x] } };
  if (opts.x === "wall") x.type = "date";
  else delete x.type;
  const y = { ...(layout && layout.yaxis) };
  if (opts.logy && !y.fixed) y.type = "log";
  else if (!y.fixed) delete y.type;
  delete y.fixed;
  return { xaxis: x, yaxis: y };
}

// -- the controls --------------------------------------------------------------------------------

// The toolbar that sets the options of every chart below it: smoothing, log y, the x axis.
// ``changed()`` is called after each change (the choice is kept for the next page too).
function chartOptions(box, changed) {
  const o = Prefs.values;
  const value = el("span", { class: "muted", id: "smoothing-value" }, o.smoothing.toFixed(2));
  const slider = el("input", {
    type: "range", min: "0", max: "0.99", step: "0.01", value: String(o.smoothing),
    id: "smoothing", "aria-label": "smoothing",
    oninput: (e) => {
      Prefs.set({ smoothing: Number(e.target.value) });
      value.textContent = Prefs.values.smoothing.toFixed(2);
      changed();
    },
  });
  const logy = el("input", {
    type: "checkbox", id: "logy", checked: o.logy ? "checked" : null,
    onchange: (e) => { Prefs.set({ logy: e.target.checked }); changed(); },
  });
  const x = el("select", {
    id: "x-axis", onchange: (e) => { Prefs.set({ x: e.target.value }); changed(); },
  }, ...Object.entries(X_TITLE).map(([k, t]) => el("option", { value: k }, k === "step" ? "step" : t)));
  x.value = o.x;
  box.replaceChildren(
    el("label", {}, "smoothing ", slider, " ", value),
    el("label", {}, logy, " log scale"),
    el("label", {}, "x ", x));
}

// -- downloads -----------------------------------------------------------------------------------

function fileName(text) {
  return String(text || "chart").replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "") || "chart";
}

function save(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = el("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

function csvCell(v) {
  if (v === null || v === undefined) return "";
  if (v instanceof Date) return v.toISOString();
  const text = String(v);
  // A cell a spreadsheet would run as a formula is quoted with a leading apostrophe.
  const safe = /^[=+\-@\t\r]/.test(text) && !/^-?[0-9.]+(e-?[0-9]+)?$/i.test(text) ? "'" + text : text;
  return /[",\n\r]/.test(safe) ? `"${safe.replace(/"/g, '""')}"` : safe;
}

// What a chart plots, as CSV: a row per point of each line, its x and y as drawn, and for
// lines drawn from a run's metrics the step, the time and the raw (unsmoothed) value.
function csvOf(node) {
  const rows = [["series", "x", "y", "step", "time", "raw"]];
  for (const t of node.data || []) {
    if (!t.x || !t.y || t.visible === false) continue;
    const meta = t.meta || {};
    t.x.forEach((x, i) => {
      rows.push([t.name, x, t.y[i], meta.steps ? meta.steps[i] : "",
        meta.times ? meta.times[i] : "", meta.raw ? meta.raw[i] : ""]);
    });
  }
  return rows.map((r) => r.map(csvCell).join(",")).join("\n") + "\n";
}

function downloadCsv(node, name) {
  save(new Blob([csvOf(node)], { type: "text/csv" }), fileName(name) + ".csv");
}

// A data: URL's bytes (the page's Content-Security-Policy lets fetch reach this server only).
function dataBlob(url) {
  const [head, body] = url.split(",", 2);
  const bytes = atob(body);
  const out = new Uint8Array(bytes.length);
  for (let i = 0; i < bytes.length; i += 1) out[i] = bytes.charCodeAt(i);
  return new Blob([out], { type: head.slice(5).split(";")[0] });
}

function downloadPng(node, name) {
  Plotly.toImage(node, { format: "png", width: node.clientWidth * 2, height: node.clientHeight * 2 })
    .then((url) => save(dataBlob(url), fileName(name) + ".png"));
}

// PNG and CSV buttons on a drawn chart: inside its node, after Plotly's own container (Plotly
// keeps a node's other children), so grids and lookups by id see the chart's node as before.
function chartTools(node, name) {
  let tools = node.querySelector(":scope > .chart-tools");
  if (!tools) {
    tools = el("div", { class: "chart-tools" },
      el("button", { class: "png", title: "download the chart as PNG",
        onclick: () => downloadPng(node, tools.dataset.name) }, "PNG"),
      el("button", { class: "csv", title: "download the plotted points as CSV",
        onclick: () => downloadCsv(node, tools.dataset.name) }, "CSV"));
    node.append(tools);
  }
  tools.dataset.name = name;
}
