// clusterflow dashboard: the compare page. Runs chosen on the Runs page (or a sweep's members)
// on shared charts, each line named by the config keys that tell the runs apart; for a sweep
// (or any choice whose runs differ in a number), the swept values against the final, smallest
// or largest value of a metric, and a parallel-coordinates view of them all. Loaded after
// charts.js and dashboard.js (its helpers); the page's data comes from /api/stream?compare=...
"use strict";

// Tags that are no training curve of a run's own (per-rank and per-GPU series, phases).
const NOT_COMPARED = /^(ranks\/|gpus\/|phases\/|checkpoint\/|goodput\/|mining\/|train\/epoch$)/;
const FIRST_TAGS = ["train/loss", "perf/samples_per_s_total", "train/lr"];
const COLOURS = ["#1565c0", "#c62828", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457",
  "#4e342e", "#283593", "#9e9d24", "#37474f", "#d84315"];

function comparePage() {
  const params = new URLSearchParams(window.location.search);
  const query = params.get("sweep") ? `?sweep=${encodeURIComponent(params.get("sweep"))}`
    : `?compare=${encodeURIComponent(params.get("runs") || "")}`;
  const data = new Map(); // run id -> { table: Map(step -> {tag: value}), times: Map(step -> t) }
  let info = { runs: [], keys: [], sweep: null, left_out: 0 };
  let timer = null;
  let drewAt = 0;

  function runData(id) {
    if (!data.has(id)) data.set(id, { table: new Map(), times: new Map() });
    return data.get(id);
  }

  function onMetrics(d) {
    const r = runData(d.run);
    if (d.reset) { r.table.clear(); r.times.clear(); }
    for (const [step, values, time] of d.items) {
      r.table.set(step, Object.assign(r.table.get(step) || {}, values));
      if (time !== null && time !== undefined) r.times.set(step, time);
    }
    schedule();
  }

  function schedule() {
    if (timer !== null) return;
    timer = setTimeout(() => requestAnimationFrame(redraw), Math.max(0, drewAt + 500 - Date.now()));
  }

  // A run's legend: its values of the keys that tell the runs apart (its name when none do);
  // as a chart's label, without the few HTML tags Plotly would read in it.
  function legendText(run) {
    const parts = Object.entries(run.legend || {}).map(([k, v]) => `${k}=${v}`);
    return parts.length ? parts.join(", ") : run.name;
  }

  function label(run) {
    return plain(legendText(run));
  }

  function seriesOf(run, tag) {
    const r = data.get(run.id);
    if (!r) return null;
    const steps = [...r.table.keys()].filter((s) => r.table.get(s)[tag] !== undefined).sort((a, b) => a - b);
    if (!steps.length) return null;
    const times = steps.map((s) => (r.times.has(s) ? r.times.get(s) : null));
    return { name: label(run), steps, times: times.some((t) => t !== null) ? times : null,
      ys: steps.map((s) => r.table.get(s)[tag]) };
  }

  function tags() {
    const names = new Set();
    for (const r of data.values()) for (const values of r.table.values()) {
      for (const k of Object.keys(values)) if (!NOT_COMPARED.test(k)) names.add(k);
    }
    const rest = [...names].filter((t) => !FIRST_TAGS.includes(t)).sort();
    return [...FIRST_TAGS.filter((t) => names.has(t)), ...rest];
  }

  function renderHeader() {
    document.getElementById("compare-title").textContent = info.sweep
      ? `sweep ${info.sweep.name}: ${info.runs.length} member(s)` : `${info.runs.length} run(s)`;
    document.getElementById("compare-keys").textContent = info.keys.length
      ? "the runs differ in " + info.keys.join(", ") : "the runs' configs do not differ";
    const body = document.querySelector("#compare-runs tbody");
    body.replaceChildren(...info.runs.map((run, i) => el("tr", { dataset: { run: run.id } },
      el("td", {}, el("span", { class: "swatch", style: `background:${COLOURS[i % COLOURS.length]}` })),
      el("td", {}, el("a", { href: ROOT + "/run/" + run.id }, run.name)),
      el("td", {}, stateBadge(run.state)),
      el("td", {}, num(run.global_step)),
      el("td", { class: "wrap" }, legendText(run)))));
    document.getElementById("compare-left-out").hidden = !info.left_out;
    document.getElementById("compare-left-out").textContent = info.left_out
      ? `${info.left_out} more run(s) chosen than one page compares; the first ${info.runs.length} are shown` : "";
  }

  function redraw() {
    timer = null;
    drewAt = Date.now();
    const opts = Prefs.values;
    const box = document.getElementById("compare-charts");
    const wanted = tags();
    const ids = wanted.map((t) => "chart-compare-" + t.replace(/[^A-Za-z0-9_-]/g, "_"));
    for (const child of [...box.children]) if (!ids.includes(child.id)) child.remove();
    wanted.forEach((tag, i) => {
      if (!document.getElementById(ids[i])) box.append(el("div", { class: "chart", id: ids[i] }));
      const traces = [];
      info.runs.forEach((run, k) => {
        const s = seriesOf(run, tag);
        if (s) traces.push(lineTrace(s, opts, { line: { color: COLOURS[k % COLOURS.length] } }));
      });
      chart(ids[i], traces, { title: { text: plain(tag), font: { size: 12 } }, showlegend: true,
        legend: { orientation: "h", y: -0.3, yanchor: "top", font: { size: 10 } },
        margin: { l: 48, r: 12, t: 28, b: 96 }, ...axesOf(opts) }, tag);
    });
    renderMetricChoice(wanted);
    renderSweep();
  }

  // -- the swept values against a metric ----------------------------------------------------------

  function renderMetricChoice(wanted) {
    const select = document.getElementById("sweep-metric");
    const keep = select.value || (wanted.find((t) => t.startsWith("eval/")) || wanted[0] || "");
    const options = wanted.map((t) => t);
    if ([...select.options].map((o) => o.value).join("\n") !== options.join("\n")) {
      select.replaceChildren(...options.map((t) => el("option", { value: t }, t)));
    }
    select.value = options.includes(keep) ? keep : options[0] || "";
  }

  function reduced(run, tag, how) {
    const s = seriesOf(run, tag);
    if (!s) return null;
    const ys = s.ys.filter((y) => y !== null && Number.isFinite(y));
    if (!ys.length) return null;
    if (how === "min") return Math.min(...ys);
    if (how === "max") return Math.max(...ys);
    return ys[ys.length - 1];
  }

  // The swept keys and each run's value of them (a sweep's index; else the differing keys whose
  // values are numbers for every run).
  function axes() {
    if (info.sweep) return info.sweep.keys.map((k) => ({ key: k, values: info.sweep.values[k] || {} }));
    return info.keys.map((k) => ({ key: k, values: Object.fromEntries(info.runs.map((r) => [r.id, r.values[k]])) }))
      .filter((a) => info.runs.every((r) => typeof a.values[r.id] === "number"));
  }

  // One axis of the parallel coordinates: the runs' values placed between 0 and 1 (numbers by
  // value, anything else by its rank among the names), and the labels of its ends.
  function dimension(label, vals) {
    if (vals.every((v) => typeof v === "number")) {
      const lo = Math.min(...vals); const hi = Math.max(...vals);
      return { label, pos: vals.map((v) => (hi > lo ? (v - lo) / (hi - lo) : 0.5)),
        ends: [num(lo, 4).replace(/\.?0+$/, ""), num(hi, 4).replace(/\.?0+$/, "")], vals };
    }
    const names = [...new Set(vals.map((v) => String(v)))].sort();
    return { label, pos: vals.map((v) => (names.length > 1 ? names.indexOf(String(v)) / (names.length - 1) : 0.5)),
      ends: [names[0], names[names.length - 1]], vals };
  }

  // Viridis at t in [0, 1] (a few of its stops, linearly between them).
  function viridis(t) {
    const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
    const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(stops.length - 2, Math.floor(x));
    const f = x - i;
    const c = stops[i].map((v, k) => Math.round(v + f * (stops[i + 1][k] - v)));
    return `rgb(${c.join(",")})`;
  }

  // Parallel coordinates drawn as lines (SVG, no WebGL): an axis per swept key and one for the
  // metric, a line per run coloured by its metric.
  function parallel(swept, runs, ys, yTitle) {
    const dims = [...swept.map((a) => dimension(a.key, runs.map((r) => a.values[r.id]))),
      dimension(yTitle, ys)];
    const metric = dims[dims.length - 1];
    const xs = dims.map((_, i) => i);
    const traces = runs.map((r, k) => ({
      type: "scatter", mode: "lines+markers", x: xs, y: dims.map((d) => d.pos[k]), name: plain(r.name),
      line: { color: viridis(metric.pos[k]), width: 2 }, marker: { size: 5 },
      text: dims.map((d) => `${plain(d.label)} = ${plain(d.vals[k])}`),
      hovertemplate: `${plain(r.name)}: %{text}<extra></extra>`,
    }));
    const shapes = xs.map((x) => ({ type: "line", x0: x, x1: x, y0: 0, y1: 1, line: { color: "#9aa1ab", width: 1 } }));
    const notes = dims.flatMap((d, i) => [
      { x: i, y: 1, text: plain(d.ends[1]), showarrow: false, yanchor: "bottom", font: { size: 10 } },
      { x: i, y: 0, text: plain(d.ends[0]), showarrow: false, yanchor: "top", font: { size: 10 } }]);
    return { traces, layout: { shapes, annotations: notes, showlegend: false,
      title: { text: plain(`parallel coordinates: ${yTitle}`), font: { size: 12 } },
      xaxis: { tickvals: xs, ticktext: dims.map((d) => plain(d.label)), range: [-0.3, xs.length - 0.7],
        title: { text: "" }, zeroline: false, showgrid: false },
      yaxis: { visible: false, range: [-0.12, 1.12] }, margin: { l: 20, r: 20, t: 30, b: 40 } } };
  }

  function renderSweep() {
    const section = document.getElementById("sweep-section");
    const swept = axes();
    const tag = document.getElementById("sweep-metric").value;
    const how = document.getElementById("sweep-reduce").value;
    section.hidden = !swept.length || !tag;
    if (section.hidden) return;
    const runs = info.runs.filter((r) => reduced(r, tag, how) !== null);
    const ys = runs.map((r) => reduced(r, tag, how));
    const yTitle = `${{ last: "final", min: "smallest", max: "largest" }[how] || "final"} ${tag}`;
    const plots = document.getElementById("sweep-charts");
    const ids = [];
    // A value that is no number is a category: its label is text (Plotly's labels would take
    // <a href>, <b> and <br> in it as markup).
    const ynum = (v) => (typeof v === "number" ? v : plain(v));
    for (const a of swept.slice(0, 2)) {
      const id = "chart-sweep-" + a.key.replace(/[^A-Za-z0-9_-]/g, "_");
      ids.push(id);
      if (!document.getElementById(id)) plots.append(el("div", { class: "chart", id }));
      const xs = runs.map((r) => ynum(a.values[r.id]));
      const numeric = xs.every((x) => typeof x === "number");
      const order = xs.map((_, i) => i).sort((i, j) => (xs[i] < xs[j] ? -1 : xs[i] > xs[j] ? 1 : 0));
      chart(id, [{ type: "scatter", mode: "lines+markers", name: plain(yTitle),
        x: order.map((i) => xs[i]), y: order.map((i) => ys[i]),
        text: order.map((i) => plain(runs[i].name)),
        hovertemplate: "%{text}: %{y:.4g}<extra></extra>" }],
      { title: { text: plain(`${yTitle} by ${a.key}`), font: { size: 12 } },
        xaxis: { title: { text: plain(a.key) }, type: numeric && positive(xs) && spread(xs) ? "log" : "-" },
        yaxis: Prefs.values.logy ? { type: "log" } : {} }, `${yTitle} by ${a.key}`);
    }
    if (swept.length >= 2) {
      const [a, b] = swept;
      const id = "chart-sweep-two";
      ids.push(id);
      if (!document.getElementById(id)) plots.append(el("div", { class: "chart", id }));
      chart(id, [{ type: "scatter", mode: "markers", name: plain(yTitle),
        x: runs.map((r) => ynum(a.values[r.id])), y: runs.map((r) => ynum(b.values[r.id])),
        text: runs.map((r) => plain(r.name)),
        marker: { size: 14, color: ys, colorscale: "Viridis", showscale: true,
          colorbar: { title: { text: plain(yTitle), side: "right" } } },
        hovertemplate: "%{text}: %{marker.color:.4g}<extra></extra>" }],
      { title: { text: plain(`${yTitle} over ${a.key} and ${b.key}`), font: { size: 12 } },
        xaxis: { title: { text: plain(a.key) } }, yaxis: { title: { text: plain(b.key) } } },
      `${yTitle} over ${a.key} and ${b.key}`);
    }
    const par = "chart-parallel";
    ids.push(par);
    if (!document.getElementById(par)) plots.append(el("div", { class: "chart wide parallel", id: par }));
    const drawing = parallel(swept, runs, ys, yTitle);
    chart(par, runs.length ? drawing.traces : [], drawing.layout, `parallel coordinates ${yTitle}`);
    for (const child of [...plots.children]) if (!ids.includes(child.id)) child.remove();
  }

  function positive(xs) { return xs.every((x) => x > 0); }
  function spread(xs) { return Math.max(...xs) / Math.min(...xs) >= 20; }

  const options = document.getElementById("chart-options");
  chartOptions(options, () => { drawn.clear(); schedule(); });
  document.getElementById("sweep-metric").addEventListener("change", renderSweep);
  const reduce = document.getElementById("sweep-reduce");
  reduce.value = Prefs.values.reduce || "last";
  reduce.addEventListener("change", () => { Prefs.set({ reduce: reduce.value }); renderSweep(); });
  // Plotly (4.6 MB, a few hundred ms of the browser's one thread to read) is fetched once the
  // runs' table has been drawn, as a run's page does.
  const plotly = document.querySelector('meta[name="clusterflow-plotly"]');
  let plotlyWanted = () => {
    plotlyWanted = () => {};
    if (!plotly) return;
    const script = el("script", { src: plotly.content });
    script.addEventListener("load", () => { drawn.clear(); schedule(); });
    requestAnimationFrame(() => setTimeout(() => document.head.append(script), 0));
  };
  stream(query, {
    compare: (d) => {
      info = d;
      renderHeader();
      schedule();
      markDrawn("clusterflow-compare-drawn");
      plotlyWanted();
    },
    metrics: onMetrics,
  });
}
