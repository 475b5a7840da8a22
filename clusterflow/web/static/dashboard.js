// clusterflow dashboard: the Runs page and a run's page (the compare page is compare.js, the
// charts' options charts.js). The pages hold no data: it arrives as server-sent events
// (/api/stream, read with fetch so that the token goes in a header); charts are Plotly
// (plotly.min.js from plotly's wheel). Text from run dirs is only ever set as textContent,
// never parsed as HTML.
"use strict";

const NOW = () => Date.now() / 1000;
// --root-path: every address the pages make starts with it ("" without a proxy).
const ROOT = document.querySelector('meta[name="clusterflow-root"]').content;

// -- the token -----------------------------------------------------------------------------------
// Kept in this page's own storage (per scheme, host and port: no page of another port reads it)
// and sent in a header: never in a cookie, which the browser would send to every port of the
// host (clusterflow/web/guard.py). Taken out of the address bar as soon as the page has it.

const TOKEN_HEADER = "x-clusterflow-token";
// Per root path too: behind a proxy, every app shares the proxy's origin.
const TOKEN_KEY = "clusterflow-dashboard-token" + ROOT;
const TOKEN = takeToken();

function takeToken() {
  const url = new URL(window.location.href);
  const given = url.searchParams.get("token");
  let token = given || "";
  try {
    if (given) window.localStorage.setItem(TOKEN_KEY, given);
    else token = window.localStorage.getItem(TOKEN_KEY) || "";
  } catch (e) {
    // storage turned off: this page keeps the token it was given, the next one asks again
  }
  if (given) {
    url.searchParams.delete("token");
    window.history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
  return token;
}

// The moment a page first showed its data (performance.getEntriesByName: benchmarks/dashboard.py).
function markDrawn(name) {
  if (!performance.getEntriesByName(name).length) performance.mark(name);
}

function refused(status, said) {
  // 403: no token, or another dashboard's (this port served one before): forget it.
  if (status === 403) {
    try { window.localStorage.removeItem(TOKEN_KEY); } catch (e) { /* storage off */ }
  }
  const node = document.getElementById("refused");
  node.textContent = /^\d{3}: /.test(said) ? said : `${status}: ${said || "refused"}`;
  node.hidden = false;
  live(false, "refused");
}

// What a refusal says: the guard's {"error": ...}, or the text of a 404.
async function errorOf(reply) {
  const text = await reply.text().catch(() => "");
  try { return String(JSON.parse(text).error || text); } catch (e) { return text.trim(); }
}

// -- small helpers -------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function num(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return digits === undefined ? String(v) : Number(v).toFixed(digits);
}

function pct(v) {
  return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%";
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

// An age that counts up in the page (see tick()).
function ageCell(t) {
  return el("span", { class: "age", dataset: { t: t === null || t === undefined ? "" : t } },
    t ? seconds(Math.max(0, NOW() - t)) + " ago" : "–");
}

function tick() {
  for (const node of document.querySelectorAll(".age")) {
    const t = parseFloat(node.dataset.t);
    if (!Number.isNaN(t)) node.textContent = seconds(Math.max(0, NOW() - t)) + " ago";
  }
  // The job's clocks, counted from squeue's answer (asked every few seconds).
  for (const node of document.querySelectorAll(".clock")) {
    if (node.dataset.until) node.textContent = hms(parseFloat(node.dataset.until) - NOW());
    else if (node.dataset.since) node.textContent = hms(NOW() - parseFloat(node.dataset.since));
  }
}

// [D-]H:MM:SS, as Slurm writes a duration.
function hms(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  const whole = Math.max(0, Math.round(s));
  const d = Math.floor(whole / 86400);
  const r = whole % 86400;
  const text = `${Math.floor(r / 3600)}:${String(Math.floor((r % 3600) / 60)).padStart(2, "0")}:${String(r % 60).padStart(2, "0")}`;
  return d ? `${d}-${text}` : text;
}
setInterval(tick, 1000);

function stateBadge(state) {
  return el("span", { class: "state " + (state || "unknown") }, state || "unknown");
}

function plain(text) {
  // Names shown in charts: Plotly reads a few HTML tags in labels; a run dir's names have none.
  return String(text).replace(/[<>&]/g, "");
}

function live(on, text) {
  const node = document.getElementById("live");
  node.className = on ? "live" : "live off";
  node.textContent = text || (on ? "live" : "reconnecting");
}

// A server-sent event stream read with fetch (EventSource cannot send a header): each event's
// JSON to handlers[event]; picked up again a second after a lost connection, until close().
function stream(query, handlers) {
  let stopped = false;
  let controller = null;
  let retry = null;

  function dispatch(lines) {
    let name = "message";
    const data = [];
    for (const line of lines) {
      if (line.startsWith(":")) continue; // a ping
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") name = value;
      else if (field === "data") data.push(value);
    }
    if (data.length && handlers[name]) handlers[name](JSON.parse(data.join("\n")));
  }

  async function run() {
    controller = new AbortController();
    try {
      const reply = await fetch(ROOT + "/api/stream" + query, {
        headers: { [TOKEN_HEADER]: TOKEN, accept: "text/event-stream" },
        cache: "no-store",
        signal: controller.signal,
      });
      if (reply.status === 403 || reply.status === 404 || reply.status === 400) {
        stopped = true;
        refused(reply.status, await errorOf(reply));
        return;
      }
      if (!reply.ok || !reply.body) throw new Error(`HTTP ${reply.status}`);
      live(true);
      const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
      let rest = "";
      let lines = [];
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const parts = (rest + value).split("\n");
        rest = parts.pop();
        for (const part of parts) {
          const line = part.endsWith("\r") ? part.slice(0, -1) : part;
          if (line) lines.push(line);
          else if (lines.length) { dispatch(lines); lines = []; }
        }
      }
    } catch (e) {
      if (stopped) return;
    }
    if (stopped) return;
    live(false);
    retry = setTimeout(run, 1000);
  }

  run();
  return {
    close() {
      stopped = true;
      clearTimeout(retry);
      if (controller) controller.abort();
    },
  };
}

function gpuRows(tbody, gpus) {
  const section = document.getElementById("gpus-section");
  section.hidden = !gpus || !gpus.length;
  tbody.replaceChildren();
  for (const g of gpus || []) {
    const used = g.memory_used_mb || 0;
    const total = g.memory_total_mb || 1;
    const holders = (g.processes || []).map((p) =>
      p.run_id
        ? el("a", { href: ROOT + "/run/" + p.run_id }, `${p.run} rank ${p.rank}`)
        : `pid ${p.pid} (${p.name || "?"})`);
    tbody.append(el("tr", {},
      el("td", {}, g.index),
      el("td", {}, g.name || "?"),
      el("td", {}, el("span", { class: "bar" }, el("span", { style: `width:${100 * used / total}%` })),
        `${(used / 1024).toFixed(1)} / ${(total / 1024).toFixed(1)} GiB`),
      el("td", {}, g.util_pct === undefined ? "–" : g.util_pct + "%"),
      el("td", { class: "wrap" }, holders.length ? holders.flatMap((h, i) => (i ? [", ", h] : [h])) : "none"),
      el("td", { class: "wrap" }, g.why)));
  }
}

// -- the Runs page -------------------------------------------------------------------------------

// -- being told: browser notifications for the runs the user marked ------------------------------
// A marked run's news (the Runs page's rows, or a run page's summary) is compared with what was
// seen before; a run that failed, stalled, was requeued or completed since raises a notification
// (the Notification API, once the user allowed it). The marks are kept per browser (Prefs).

const told = new Map(); // run id -> [state, stalled] last seen

function isMarked(id) {
  return Prefs.values.marked.includes(id);
}

function mark(id, on) {
  const marked = new Set(Prefs.values.marked);
  if (on) marked.add(id); else marked.delete(id);
  Prefs.set({ marked: [...marked] });
  if (on && "Notification" in window && Notification.permission === "default") {
    Notification.requestPermission();
  }
}

function bell(id, onChange) {
  const on = isMarked(id);
  return el("button", {
    class: "bell" + (on ? " on" : ""), title: on ? "notifications on: click to stop" : "notify me",
    "aria-pressed": on ? "true" : "false",
    onclick: () => { mark(id, !isMarked(id)); onChange(); },
  }, on ? "★" : "☆");
}

const NEWS = { failed: "failed", requeued: "was requeued", completed: "completed" };

function tell(r) {
  const before = told.get(r.id);
  const now = [r.state, !!r.stalled];
  told.set(r.id, now);
  if (!before || !isMarked(r.id)) return;
  let news = null;
  if (now[1] && !before[1]) news = "stalled";
  else if (now[0] !== before[0] && NEWS[now[0]]) news = NEWS[now[0]];
  if (!news || !("Notification" in window) || Notification.permission !== "granted") return;
  const body = r.error || r.note || `step ${num(r.global_step)}`;
  const n = new Notification(`${r.name} ${news}`, { body, tag: `clusterflow-${r.id}-${now[0]}` });
  n.onclick = () => { window.focus(); window.location.href = ROOT + "/run/" + r.id; };
}

// How far a run is, 0 to 1 (null when its length is unknown): its steps of run.steps(max_steps),
// else its epochs.
function progress(r) {
  if (r.max_steps) return Math.min(1, r.global_step / r.max_steps);
  if (!r.epochs || !r.steps_per_epoch) return null;
  return Math.min(1, (r.epoch + (r.step_in_epoch || 0) / r.steps_per_epoch) / r.epochs);
}

function runsPage() {
  const rows = new Map();
  const sweeps = new Map();
  const chosen = new Set();
  let sortKey = "name";
  let sortDir = 1;
  const tbody = document.querySelector("#runs tbody");
  const compareButton = document.getElementById("compare-selected");

  function choose(id, on) {
    if (on) chosen.add(id); else chosen.delete(id);
    compareButton.disabled = chosen.size < 1;
    compareButton.textContent = chosen.size ? `compare the ${chosen.size} chosen run(s)` : "compare the chosen runs";
  }

  function value(r, key) {
    if (key === "progress") return progress(r);
    return r[key];
  }

  function render() {
    const state = document.getElementById("state-filter").value;
    const name = document.getElementById("name-filter").value.toLowerCase();
    const shown = [...rows.values()]
      .filter((r) => !r.sweep)
      .filter((r) => !state || (r.state || "unknown") === state)
      .filter((r) => !name || r.name.toLowerCase().includes(name))
      .sort((a, b) => {
        const x = value(a, sortKey); const y = value(b, sortKey);
        if (x === y) return a.name < b.name ? -1 : 1;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * sortDir;
      });
    tbody.replaceChildren(...shown.map((r) => {
      const p = progress(r);
      const marks = [];
      if (r.stragglers) marks.push(`${r.stragglers} straggler(s)`);
      if (r.silent && r.state === "running") marks.push(`${r.silent} silent`);
      return el("tr", { id: "run-" + r.id, dataset: { state: r.state || "unknown" } },
        el("td", {}, el("input", { type: "checkbox", class: "choose", "aria-label": "choose " + r.name,
          checked: chosen.has(r.id) ? "checked" : null, onchange: (e) => choose(r.id, e.target.checked) })),
        el("td", {}, bell(r.id, render)),
        el("td", {}, el("a", { href: ROOT + "/run/" + r.id }, r.name)),
        el("td", { title: r.error || r.note || r.problem || "" }, stateBadge(r.state)),
        el("td", {}, p === null ? "–" : [el("span", { class: "bar" },
          el("span", { style: `width:${100 * p}%` })),
          r.max_steps ? `step ${r.global_step}/${r.max_steps}` : `epoch ${r.current_epoch}/${r.epochs}, step ${r.global_step}`]),
        el("td", {}, num(r.world_size), marks.length ? " · " + marks.join(", ") : ""),
        el("td", {}, pct(r.goodput)),
        el("td", {}, ageCell(r.last_heartbeat)),
        el("td", {}, num(r.attempts)),
        el("td", {}, num(r.last_loss, 4)),
        el("td", {}, r.job_id || "–"));
    }));
    const total = [...rows.values()].filter((r) => !r.sweep).length;
    document.getElementById("counts").textContent = `${shown.length} of ${total} run(s)`;
    renderSweeps();
  }

  function renderSweeps() {
    const box = document.getElementById("sweeps");
    document.getElementById("sweeps-section").hidden = sweeps.size === 0;
    const state = document.getElementById("state-filter").value;
    box.replaceChildren(...[...sweeps.values()].sort((a, b) => (a.name < b.name ? -1 : 1)).map((s) => {
      const members = s.members.filter((m) => !state || m.state === state);
      const keys = s.keys || [];
      const done = s.members.filter((m) => m.state === "completed").length;
      return el("div", { class: "sweep", id: "sweep-" + s.id },
        el("h3", {}, s.name, el("span", { class: "muted" },
          ` · ${s.members.length} member(s), ${done} completed · `),
        el("a", { href: `${ROOT}/compare?sweep=${s.id}`, class: "compare-sweep" }, "compare the members")),
        s.problem ? el("p", { class: "warn" }, s.problem) : null,
        el("table", { class: "grid" },
          el("thead", {}, el("tr", {}, el("th", {}, ""), el("th", {}, "notify"), ...keys.map((k) => el("th", {}, k)),
            el("th", {}, "state"), el("th", {}, "epoch"), el("th", {}, "step"),
            el("th", {}, "loss"), el("th", {}, "NMI"), el("th", {}, "ARI"), el("th", {}, "member"))),
          el("tbody", {}, ...members.map((m) => el("tr", { dataset: { member: m.member } },
            el("td", {}, m.id ? el("input", { type: "checkbox", class: "choose", "aria-label": "choose " + m.member,
              checked: chosen.has(m.id) ? "checked" : null, onchange: (e) => choose(m.id, e.target.checked) }) : ""),
            el("td", {}, m.id ? bell(m.id, render) : ""),
            ...keys.map((k) => el("td", {}, m.values[k])),
            el("td", {}, stateBadge(m.state)), el("td", {}, num(m.current_epoch)),
            el("td", {}, num(m.global_step)), el("td", {}, num(m.last_loss, 4)),
            el("td", {}, num(m.nmi, 3)), el("td", {}, num(m.ari, 3)),
            el("td", {}, m.id ? el("a", { href: ROOT + "/run/" + m.id }, m.member) : m.member))))));
    }));
  }

  function load(data) {
    rows.clear(); sweeps.clear();
    for (const r of data.runs) { rows.set(r.id, r); tell(r); }
    for (const s of data.sweeps) sweeps.set(s.id, s);
    document.getElementById("truncated").hidden = !data.truncated;
    const empty = document.getElementById("empty");
    empty.hidden = data.runs.length + data.sweeps.length > 0;
    empty.textContent = !data.searched ? "Looking for runs…"
      : `No run or sweep under ${data.paths.join(", ")} (${data.searched} folder(s) searched, ` +
        "up to 8 deep). A run dir holds the config.yaml that submit writes, a sweep dir its " +
        "sweep.json: pass the run.dir you submitted, or a folder above it. Runs appear here " +
        "as they start.";
    gpuRows(document.querySelector("#gpus tbody"), data.gpus);
    render();
    if (data.searched) markDrawn("clusterflow-runs-drawn");
  }

  for (const th of document.querySelectorAll("#runs th[data-key]")) {
    th.addEventListener("click", () => {
      sortDir = sortKey === th.dataset.key ? -sortDir : 1;
      sortKey = th.dataset.key;
      for (const other of document.querySelectorAll("#runs th")) other.className = "";
      th.className = sortDir > 0 ? "asc" : "desc";
      render();
    });
  }
  document.getElementById("state-filter").addEventListener("change", render);
  document.getElementById("name-filter").addEventListener("input", render);
  compareButton.addEventListener("click", () => {
    window.location.href = `${ROOT}/compare?runs=${[...chosen].join(",")}`;
  });
  stream("", {
    runs: load,
    rows: (data) => {
      for (const r of data.runs) { rows.set(r.id, r); tell(r); }
      for (const s of data.sweeps) sweeps.set(s.id, s);
      render();
    },
    gpus: (gpus) => gpuRows(document.querySelector("#gpus tbody"), gpus),
  });
}

// -- a run's page --------------------------------------------------------------------------------

const LAYOUT = {
  margin: { l: 48, r: 12, t: 28, b: 32 },
  font: { size: 11 },
  showlegend: false,
  xaxis: { title: { text: "step" } },
  uirevision: "keep",
};
const CONFIG = { displayModeBar: false, responsive: true };

const drawn = new Map(); // chart id -> what it shows now, as JSON: an unchanged chart is left be

// Draw ``traces`` into the node ``id`` (left be when nothing changed), with PNG and CSV
// downloads named ``name`` (charts.js).
function chart(id, traces, layout, name) {
  const node = document.getElementById(id);
  if (!node || typeof Plotly === "undefined") return;
  const key = JSON.stringify([traces, layout]);
  if (drawn.get(id) === key && node.isConnected) return;
  drawn.set(id, key);
  if (!traces.length) {
    if (node.data) Plotly.purge(node);
    node.replaceChildren(el("div", { class: "empty" }, (layout && layout.empty) || "no data yet"));
    return;
  }
  if (!node.data) node.replaceChildren();
  const merged = { ...LAYOUT, ...layout };
  delete merged.empty;
  Plotly.react(node, traces, merged, CONFIG);
  chartTools(node, name || (layout && layout.title && layout.title.text) || id);
}

function runPage() {
  const runId = document.querySelector('meta[name="clusterflow-run"]').content;
  const table = new Map(); // step -> {tag: value}
  const times = new Map(); // step -> when it was logged (seconds since 1970)
  let summary = {};
  let plotlyWanted = () => {}; // set below: reads Plotly once, after the first summary
  let mode = Prefs.values.rankMode === "per-rank" ? "per-rank" : "aggregated";
  let logRank = 0;
  let source = null;
  let timer = null;
  let steps = []; // the table's steps in order, as of the last redraw
  let known = []; // its tags

  // A tag's points, with the times of their steps (null where a row said none).
  function series(tag, name) {
    const st = []; const ys = []; const ts = [];
    for (const step of steps) {
      const v = table.get(step)[tag];
      if (v !== undefined) { st.push(step); ys.push(v); ts.push(times.has(step) ? times.get(step) : null); }
    }
    return { name: plain(name || tag), steps: st, ys, times: ts.some((t) => t !== null) ? ts : null };
  }

  function tags() {
    return known;
  }

  // A line as the chart options draw it (smoothing, the x axis: charts.js).
  function line(tag, name, extra) {
    return lineTrace(series(tag, name), Prefs.values, extra);
  }

  // Per-rank series (step time, busy time, GPU, CPU, memory, data wait): one line each, or
  // their mean (smoothed as the options say) and range.
  function group(matching, nameOf, stragglers) {
    const members = tags().filter((t) => matching.test(t));
    if (!members.length) return [];
    if (mode === "per-rank") {
      return members.map((t) => {
        const name = nameOf(t);
        const slow = stragglers.has(name);
        return line(t, slow ? name + " (straggler)" : name,
          slow ? { line: { width: 3, dash: "dash", color: "#c62828" } } : {});
      });
    }
    const st = []; const ts = []; const lo = []; const hi = []; const mean = [];
    for (const step of steps) {
      const vals = members.map((t) => table.get(step)[t]).filter((v) => v !== undefined && v !== null);
      if (!vals.length) continue;
      st.push(step); ts.push(times.has(step) ? times.get(step) : null);
      lo.push(Math.min(...vals)); hi.push(Math.max(...vals));
      mean.push(vals.reduce((a, b) => a + b, 0) / vals.length);
    }
    const opts = Prefs.values;
    const at = ts.some((t) => t !== null) ? ts : null;
    const band = (ys, name, extra) => lineTrace({ name, steps: st, times: at, ys }, { ...opts, smoothing: 0 }, extra);
    return [
      band(lo, "min", { line: { width: 0 }, hoverinfo: "skip", hovertemplate: null }),
      band(hi, "min–max", { fill: "tonexty", line: { width: 0 }, fillcolor: "rgba(21,101,192,0.15)" }),
      lineTrace({ name: `mean of ${members.length}`, steps: st, times: at, ys: mean }, opts,
        { line: { color: "#1565c0" } }),
    ];
  }

  function redraw() {
    timer = null;
    drewAt = Date.now();
    steps = [...table.keys()].sort((a, b) => a - b);
    const names = new Set();
    for (const values of table.values()) for (const k of Object.keys(values)) names.add(k);
    known = [...names].sort();
    const axes = axesOf(Prefs.values);
    const title = (text) => ({ title: { text, font: { size: 12 } }, ...axes });
    chart("chart-loss", table.size ? [line("train/loss", "loss")].filter((t) => t.x.length) : [],
      title("loss"));
    chart("chart-lr", [line("train/lr", "lr")].filter((t) => t.x.length), title("learning rate"));
    chart("chart-throughput", [line("perf/samples_per_s_total", "samples/s")].filter((t) => t.x.length),
      title("throughput (samples/s, all ranks)"));
    const skip = /^(train\/(loss|lr|epoch)$|perf\/|ranks\/|gpus\/|mining\/|phases\/|checkpoint\/|goodput\/)/;
    const box = document.getElementById("task-charts");
    const wanted = tags().filter((t) => !skip.test(t));
    const ids = wanted.map((t) => "chart-task-" + t.replace(/[^A-Za-z0-9_-]/g, "_"));
    for (const child of [...box.children]) if (!ids.includes(child.id)) child.remove();
    wanted.forEach((t, i) => {
      if (!document.getElementById(ids[i])) box.append(el("div", { class: "chart", id: ids[i] }));
      chart(ids[i], [line(t)], title(plain(t)));
    });
    const ranks = summary.ranks || [];
    const slow = new Set(ranks.filter((r) => r.straggler).map((r) => "rank " + r.rank));
    const gpuRank = new Map(ranks.filter((r) => r.gpu_index !== undefined)
      .map((r) => [`${r.host} gpu${r.gpu_index}`, r.rank]));
    const gpuName = (t) => {
      const m = t.match(/^gpus\/(.+)\/gpu(\d+)\//);
      const key = `${m[1]} gpu${m[2]}`;
      return gpuRank.has(key) ? `${key} (rank ${gpuRank.get(key)})` : key;
    };
    const rankName = (t) => "rank " + t.match(/rank(\d+)$/)[1];
    const cpu = "no GPU readings (a CPU run, or NVML is not installed)";
    chart("chart-step-time", group(/^ranks\/step_time_s\/rank\d+$/, rankName, slow),
      { ...title("step time per rank (s)"), empty: "no per-rank step times yet (dist.heartbeat_s)" });
    chart("chart-busy", group(/^ranks\/busy_s\/rank\d+$/, rankName, slow),
      { ...title("busy time per step (s)"), empty: "no busy times yet" });
    chart("chart-gpu-util", group(/^gpus\/.+\/gpu\d+\/util_pct$/, gpuName, new Set()),
      { ...title("GPU utilisation (%)"), empty: cpu });
    chart("chart-gpu-mem", group(/^gpus\/.+\/gpu\d+\/mem_used_gb$/, gpuName, new Set()),
      { ...title("GPU memory used (GB)"), empty: cpu });
    const beats = "no readings yet (the heartbeats, dist.heartbeat_s, logged at log steps)";
    chart("chart-cpu", group(/^ranks\/cpu_percent\/rank\d+$/, rankName, slow),
      { ...title("CPU per rank (% of a core)"), empty: beats });
    chart("chart-rss", group(/^ranks\/rss_gb\/rank\d+$/, rankName, slow),
      { ...title("resident memory per rank (GiB)"), empty: beats });
    chart("chart-data-wait", group(/^ranks\/data_wait_fraction\/rank\d+$/, rankName, slow),
      { ...title("share of the step waiting for data"), empty: beats });
  }

  // Charts are drawn again at most twice a second, whatever the rate of news: a busy machine
  // (or a run logging every few milliseconds) must not keep the page from answering.
  let drewAt = 0;
  function schedule() {
    if (timer !== null) return;
    const wait = Math.max(0, drewAt + 500 - Date.now());
    timer = setTimeout(() => requestAnimationFrame(redraw), wait);
  }

  function card(k, v, id) {
    return el("div", { class: "card", id }, el("div", { class: "k" }, k), el("div", { class: "v" }, v));
  }

  function renderSummary(s) {
    summary = s;
    if (document.getElementById("run-name").textContent !== s.name) {
      document.getElementById("run-name").textContent = s.name;
      document.title = `${s.name} · clusterflow`;
    }
    const p = progress(s) === null ? "" : ` (${(100 * progress(s)).toFixed(0)}%)`;
    document.getElementById("summary").replaceChildren(
      card("state", stateBadge(s.state), "card-state"),
      card("progress", s.max_steps ? `step ${num(s.global_step)}/${num(s.max_steps)}${p}`
        : `epoch ${num(s.current_epoch)}/${num(s.epochs)}, step ${num(s.global_step)}${p}`, "card-progress"),
      card("ranks", `${num(s.world_size)} on ${(s.hosts || []).join(", ") || "?"}`),
      card("attempts", num(s.attempts), "card-attempts"),
      card("goodput", pct(s.goodput)),
      card("last heartbeat", ageCell(s.last_heartbeat)),
      card("loss", num(s.last_loss, 4)),
      card("job", s.job_id || "–"));
    const notes = [];
    const said = (cls, text) => notes.push(el("div", { class: cls }, text));
    if (s.problem) said("warn", s.problem);
    if (s.error) said("warn", "cause: " + s.error);
    if (s.note) said("muted", s.note);
    if (s.liveness) said("muted", s.liveness);
    if (s.ranks_summary) said("warn", s.ranks_summary);
    if (s.checkpoint_error) said("warn", "checkpoint: " + s.checkpoint_error);
    for (const d of s.damaged_records || []) said("muted", "record ignored: " + d);
    for (const w of s.goodput_warnings || []) said("muted", "goodput: " + w);
    if ((s.excluded_nodes || []).length) said("muted", "nodes left out: " + s.excluded_nodes.join(", "));
    document.getElementById("notes").replaceChildren(...notes);
    tell(s);
    renderNotify();
    renderEfficiency(s);
    changed("job", [s.job, s.eta_s, s.steps_left, s.state], () => renderJob(s));
    changed("config", [s.config, s.script], () => renderConfig(s));
    renderRanks(s);
    changed("attempts", [s.attempts_detail, s.state], () => renderAttempts(s));
    changed("mining", s.mining, () => renderMining(s));
    changed("samples", s.samples, () => renderSamples(s));
    const select = document.getElementById("log-rank");
    const n = Math.max(1, s.world_size || 1);
    if (select.options.length !== n) {
      select.replaceChildren(...Array.from({ length: n }, (_, i) => el("option", { value: i }, i)));
      select.value = String(logRank);
    }
    // The per-rank charts name stragglers and GPUs' ranks from the summary.
    changed("rank-names", (s.ranks || []).map((r) => [r.rank, r.straggler, r.host, r.gpu_index]),
      schedule);
    markDrawn("clusterflow-summary-drawn");
    plotlyWanted();
  }

  const rendered = new Map();
  function changed(section, data, render) {
    const key = JSON.stringify(data === undefined ? null : data);
    if (rendered.get(section) === key) return;
    rendered.set(section, key);
    render();
  }

  function renderNotify() {
    const b = document.getElementById("notify");
    const on = isMarked(runId);
    b.classList.toggle("on", on);
    b.setAttribute("aria-pressed", on ? "true" : "false");
    b.textContent = on ? "★ notifying" : "☆ notify me";
  }

  // CPU use, resident memory and data wait from the ranks' latest heartbeats: their mean and
  // the largest (aggregated), or each rank's (per rank), as the toggle says.
  function renderEfficiency(s) {
    const ranks = (s.ranks || []).filter((r) => !r.silent);
    const box = document.getElementById("efficiency");
    const have = (k) => ranks.filter((r) => r[k] !== null && r[k] !== undefined);
    const gib = (b) => `${(b / 2 ** 30).toFixed(2)} GiB`;
    const share = (f) => `${(100 * f).toFixed(0)}%`;
    const cpu = (c) => `${c.toFixed(0)}%`;
    const measures = [["cpu_percent", "CPU", cpu], ["rss_bytes", "memory", gib],
      ["data_wait_fraction", "data wait", share]];
    if (!measures.some(([k]) => have(k).length)) { box.replaceChildren(); return; }
    if (mode === "per-rank") {
      box.replaceChildren(...ranks.map((r) => card(`rank ${r.rank}`,
        measures.map(([k, , f]) => (r[k] === null || r[k] === undefined ? "–" : f(r[k]))).join(" · "),
        `eff-rank-${r.rank}`)));
      return;
    }
    box.replaceChildren(...measures.map(([k, label, f]) => {
      const vals = have(k).map((r) => r[k]);
      if (!vals.length) return card(label, "–", `eff-${k}`);
      const mean = vals.reduce((a, b) => a + b, 0) / vals.length;
      const top = have(k).reduce((a, b) => (b[k] > a[k] ? b : a));
      return card(`${label}, mean of ${vals.length}`, [f(mean),
        el("span", { class: "muted small" }, ` max ${f(top[k])} (rank ${top.rank})`)], `eff-${k}`);
    }));
  }

  // The Slurm job as squeue gave it (its clocks counting from that answer), and the run's own
  // estimate of its end.
  function renderJob(s) {
    const j = s.job;
    const section = document.getElementById("job-section");
    section.hidden = !j && (s.eta_s === null || s.eta_s === undefined);
    const cards = [];
    if (j) {
      cards.push(card("Slurm state", [j.state, j.reason ? ` (${j.reason})` : ""], "job-state"));
      if (j.state === "PENDING") {
        cards.push(card("expected start", j.start_at ? new Date(j.start_at * 1000).toLocaleString()
          : "not planned yet", "job-start"));
        if (j.scheduled_nodes) cards.push(card("planned nodes", j.scheduled_nodes, "job-planned"));
      } else {
        cards.push(card("elapsed", el("span", { class: "clock", dataset: { since: j.asked_at - (j.elapsed_s || 0) } },
          hms(j.elapsed_s)), "job-elapsed"));
        cards.push(card("time left", j.left_s === null || j.left_s === undefined ? "no limit"
          : el("span", { class: "clock", dataset: { until: j.asked_at + j.left_s } }, hms(j.left_s)), "job-left"));
      }
      cards.push(card("time limit", j.time_limit_s === null || j.time_limit_s === undefined ? "none" : hms(j.time_limit_s), "job-limit"));
      if (j.nodes) cards.push(card("nodes", `${j.nodes} (${num(j.node_count)})`, "job-nodes"));
    }
    if (s.eta_s !== null && s.eta_s !== undefined) {
      const late = j && j.left_s !== null && j.left_s !== undefined && s.eta_s > j.left_s;
      cards.push(card("to finish, at the current step time", [hms(s.eta_s),
        el("span", { class: "muted small" }, ` ${num(s.steps_left)} steps` +
          (late ? "; after the time limit: it saves and is requeued" : ""))], "job-eta"));
    }
    document.getElementById("job").replaceChildren(...cards);
    tick();
  }

  function renderConfig(s) {
    const rows = s.config || [];
    document.getElementById("config-section").hidden = !rows.length;
    document.getElementById("config-count").textContent = `${rows.length} keys`;
    document.querySelector("#config tbody").replaceChildren(...rows.map(([k, v]) =>
      el("tr", {}, el("td", { class: "mono" }, k), el("td", { class: "mono wrap" }, v))));
    const script = document.getElementById("script");
    script.hidden = !s.script;
    script.textContent = s.script ? `script: ${[s.script.path, ...s.script.args].join(" ")}` : "";
  }

  function renderRanks(s) {
    const body = document.querySelector("#ranks tbody");
    body.replaceChildren(...(s.ranks || []).map((r) => {
      const marks = [r.silent ? "silent" : null, r.straggler ? "straggler" : null].filter(Boolean);
      const mem = r.gpu_mem_used_mb !== undefined && r.gpu_mem_total_mb
        ? `${(r.gpu_mem_used_mb / 1024).toFixed(1)} / ${(r.gpu_mem_total_mb / 1024).toFixed(0)} GiB` : "–";
      return el("tr", { class: marks.join(" ") },
        el("td", {}, r.rank), el("td", {}, r.host || "?"), el("td", {}, num(r.step)),
        el("td", {}, r.phase || "–"), el("td", {}, ageCell(r.time)),
        el("td", {}, ageCell(r.progress_at)), el("td", {}, num(r.step_time_s, 3)),
        el("td", {}, num(r.busy_s, 3) + (r.busy_ratio ? ` (${r.busy_ratio.toFixed(2)}x)` : "")),
        el("td", {}, r.cpu_percent === null || r.cpu_percent === undefined ? "–" : r.cpu_percent.toFixed(0) + "%"),
        el("td", {}, r.rss_bytes === null || r.rss_bytes === undefined ? "–" : `${(r.rss_bytes / 2 ** 30).toFixed(2)} GiB`),
        el("td", {}, pct(r.data_wait_fraction)),
        el("td", {}, mem),
        el("td", {}, r.gpu_util_pct === undefined ? "–" : r.gpu_util_pct + "%"),
        el("td", {}, marks.join(", ")));
    }));
    document.getElementById("stragglers").replaceChildren(...(s.stragglers_named || []).map((g) =>
      el("li", {}, `straggler: rank ${g.rank} on ${g.node} at ${num(g.ratio, 2)}x the others' median`)));
  }

  function restartText(a, prev) {
    const parts = [];
    if (a.restart_in_job) {
      const r = a.restart_in_job;
      parts.push(`restart in the job after a ${r.cause || "fault"}` +
        (r.rank !== null && r.rank !== undefined ? ` of rank ${r.rank}` : "") +
        (r.host ? ` on ${r.host}` : "") +
        ((r.left_out || []).length ? `; left out ${r.left_out.join(", ")}` : "") +
        (r.restored_from ? `; restored from the ${r.restored_from === "shared" ? "shared filesystem" : r.restored_where}` : "") +
        (r.recovery_s !== null && r.recovery_s !== undefined ? `; training again after ${r.recovery_s.toFixed(1)} s` : ""));
    } else if (prev) {
      parts.push(`after attempt ${prev.attempt} ${prev.outcome ? "ended " + prev.outcome : "ended without a record (killed)"}`);
    }
    if (a.steps && a.steps.restored) parts.push(`resumed from step ${a.steps.restored}`);
    else if (prev) parts.push("started from step 0");
    return parts.join("; ");
  }

  // The fault that ended an attempt (rundir/faults.py, charged by the goodput ledger): its kind,
  // where, when, the time to train again, where the state came from, what it cost.
  function faultText(f, labels) {
    if (!f) return "–";
    const where = (f.rank !== null && f.rank !== undefined ? `, rank ${f.rank}` : "") +
      (f.host ? ` on ${f.host}` : "");
    const when = f.at ? new Date(f.at * 1000).toLocaleTimeString() : "?";
    const step = f.restored_step;
    const from = f.recovered_by === null || f.recovered_by === undefined ? null
      : f.restored_from === "memory" ? `the memory snapshot at step ${step}`
      : f.restored_from === "replica" ? `a peer's replica at step ${step}`
      : f.restored_from === "shared" ? `the disk checkpoint at step ${step}`
      : "step 0 (no checkpoint)";
    const parts = [`${labels[f.kind] || f.kind}${where} at ${when}`];
    if (from === null) parts.push("not training again yet");
    else parts.push((f.recovery_s !== null && f.recovery_s !== undefined
      ? `training again after ${f.recovery_s.toFixed(1)} s` : "training again") + ` from ${from}`);
    if (f.steps_lost !== null && f.steps_lost !== undefined) parts.push(`${f.steps_lost} step(s) trained again`);
    if (f.lost_s !== undefined) parts.push(`charged ${f.lost_s.toFixed(1)} s`);
    return parts.join("; ");
  }

  function renderAttempts(s) {
    const attempts = s.attempts_detail || [];
    const body = document.querySelector("#attempts tbody");
    body.replaceChildren(...attempts.map((a, i) => el("tr", { dataset: { attempt: a.attempt } },
      el("td", {}, a.attempt), el("td", {}, a.job_id || "–"), el("td", {}, a.ranks),
      el("td", {}, a.outcome || (i === attempts.length - 1 && s.state === "running" ? "running" : "no record (killed)")),
      el("td", { class: "wrap" }, a.first_error ? `rank ${a.first_error.rank}: ${a.first_error.error}` : "–"),
      el("td", { class: "wrap fault" }, faultText(a.fault, s.fault_labels || {})),
      el("td", {}, a.steps ? `${a.steps.restored} → ${a.steps.last}` : "–"),
      el("td", {}, a.steps ? a.steps.recomputed : "–"),
      el("td", {}, a.steps ? a.steps.lost : "–"),
      el("td", {}, pct(a.ratio)),
      el("td", { class: "wrap restart" }, restartText(a, i ? attempts[i - 1] : null)))));
    if (!attempts.length) { chart("chart-attempts", [], { empty: "no attempt has started yet" }); return; }
    const t0 = Math.min(...attempts.map((a) => a.queued_at));
    const names = attempts.map((a) => "attempt " + a.attempt);
    const colours = s.colours || {};
    const traces = [];
    for (const k of s.categories || []) {
      const base = []; const width = [];
      for (const a of attempts) {
        let left = a.queued_at - t0;
        for (const c of s.categories) { if (c === k) break; left += a.seconds[c] || 0; }
        base.push(left); width.push(a.seconds[k] || 0);
      }
      if (!width.some((w) => w > 0)) continue;
      traces.push({ type: "bar", orientation: "h", y: names, x: width, base, name: s.labels[k],
        marker: { color: colours[k] }, hovertemplate: `%{y}: ${s.labels[k]} %{x:.1f} s<extra></extra>` });
    }
    const shapes = []; const notes = [];
    attempts.forEach((a, i) => {
      if (!i) return;
      const at = a.queued_at - t0;
      shapes.push({ type: "line", x0: at, x1: at, yref: "paper", y0: 0, y1: 1,
        line: { color: "#c62828", width: 1, dash: "dot" } });
      notes.push({ x: at, yref: "paper", y: 1, text: plain("restart → attempt " + a.attempt),
        showarrow: false, font: { size: 10, color: "#c62828" }, xanchor: "left", yanchor: "bottom" });
    });
    const node = document.getElementById("chart-attempts");
    node.style.height = `${120 + 36 * attempts.length}px`;
    chart("chart-attempts", traces, { barmode: "overlay", showlegend: true,
      legend: { orientation: "h", y: -0.12, yanchor: "top" }, xaxis: { title: { text: "" } },
      title: { text: "seconds since the first submission", font: { size: 11 }, x: 0.01, xanchor: "left" },
      yaxis: { autorange: "reversed" }, shapes, annotations: notes, margin: { l: 80, r: 12, t: 30, b: 60 } });
  }

  function renderMining(s) {
    const rounds = s.mining || [];
    document.getElementById("mining-section").hidden = !rounds.length;
    if (!rounds.length) return;
    const x = rounds.map((r) => r.epoch);
    const traces = [
      { type: "scatter", mode: "lines+markers", x, y: rounds.map((r) => r.num_clusters), name: "clusters" },
      { type: "scatter", mode: "lines+markers", x, y: rounds.map((r) => r.num_singletons), name: "singletons" },
      { type: "scatter", mode: "lines+markers", x, y: rounds.map((r) => r.largest_cluster), name: "largest" },
    ];
    for (const q of ["nmi", "ari"]) {
      if (rounds.some((r) => r[q] !== undefined && r[q] !== null)) {
        traces.push({ type: "scatter", mode: "lines+markers", x, y: rounds.map((r) => r[q]),
          name: q.toUpperCase(), yaxis: "y2", line: { dash: "dot" } });
      }
    }
    chart("chart-rounds", traces, { title: { text: "rounds, after each epoch", font: { size: 12 } }, showlegend: true,
      margin: { l: 48, r: 40, t: 28, b: 60 },
      legend: { orientation: "h", y: -0.12, yanchor: "top" }, xaxis: { title: { text: "" } },
      yaxis2: { overlaying: "y", side: "right", range: [0, 1] } });
    const select = document.getElementById("round");
    const keep = select.value;
    select.replaceChildren(...rounds.map((r, i) => el("option", { value: i }, `after epoch ${r.epoch}`)));
    select.value = keep && Number(keep) < rounds.length ? keep : String(rounds.length - 1);
    renderRound(rounds[Number(select.value)]);
  }

  function renderRound(r) {
    const c = r.curve;
    if (c && c.thresholds) {
      const t = c.thresholds;
      const traces = [
        { type: "scatter", mode: "lines", x: t, y: c.num_clusters, name: "clusters" },
        { type: "scatter", mode: "lines", x: t, y: c.largest_cluster, name: "largest" },
      ];
      if (c.nmi) traces.push({ type: "scatter", mode: "lines", x: t, y: c.nmi, name: "NMI", yaxis: "y2" });
      const shapes = r.threshold === undefined || r.threshold === null ? [] : [{ type: "line",
        x0: r.threshold, x1: r.threshold, yref: "paper", y0: 0, y1: 1, line: { color: "#c62828", dash: "dot" } }];
      chart("chart-curve", traces, { title: { text: `threshold curve (chosen ${num(r.threshold, 3)})`, font: { size: 12 } },
        margin: { l: 48, r: 40, t: 28, b: 60 },
        showlegend: true, legend: { orientation: "h", y: -0.12, yanchor: "top" }, xaxis: { title: { text: "" } },
        yaxis: { type: "log" }, yaxis2: { overlaying: "y", side: "right", range: [0, 1] }, shapes });
    } else {
      chart("chart-curve", [], { empty: "no threshold curve in this round (mining.threshold=auto records one)" });
    }
    const h = r.size_histogram || [];
    chart("chart-sizes", h.length ? [{ type: "bar", x: h.map((p) => p[0]), y: h.map((p) => p[1]),
      name: "clusters" }] : [], { title: { text: "clusters by number of members", font: { size: 12 } },
      xaxis: { title: { text: "" }, type: "category" }, empty: "no cluster sizes recorded" });
  }

  function renderSamples(s) {
    if (s.samples && s.samples.steps) return renderSteps(s);
    const epochs = (s.samples && s.samples.epochs) || [];
    document.getElementById("samples-section").hidden = !epochs.length;
    if (!epochs.length) return;
    const byAttempt = new Map();
    const y = (e) => `epoch ${e.epoch + 1}`;
    const rest = { type: "bar", orientation: "h", y: [], x: [], base: [], name: "not trained yet",
      marker: { color: "#e3e6ea" }, hovertemplate: "%{y}: %{x} samples not trained yet<extra></extra>" };
    for (const e of epochs) {
      let trained = 0;
      for (const r of e.ranges) {
        if (!byAttempt.has(r.attempt)) {
          byAttempt.set(r.attempt, { type: "bar", orientation: "h", y: [], x: [], base: [], customdata: [],
            name: `attempt ${r.attempt}`,
            hovertemplate: "%{y}: samples [%{base}, %{customdata}) by " + `attempt ${r.attempt}<extra></extra>` });
        }
        const t = byAttempt.get(r.attempt);
        t.y.push(y(e)); t.base.push(r.start); t.x.push(r.end - r.start); t.customdata.push(r.end);
        trained += r.end - r.start;
      }
      if (trained < e.samples) { rest.y.push(y(e)); rest.base.push(trained); rest.x.push(e.samples - trained); }
    }
    const node = document.getElementById("chart-samples");
    node.style.height = `${110 + 26 * epochs.length}px`;
    chart("chart-samples", [...byAttempt.values(), rest], { barmode: "overlay", showlegend: true,
      legend: { orientation: "h", y: -0.12, yanchor: "top" }, xaxis: { title: { text: "" } },
      title: { text: "position in the epoch's sample order", font: { size: 11 }, x: 0.01, xanchor: "left" },
      yaxis: { autorange: "reversed" }, margin: { l: 70, r: 12, t: 30, b: 50 } });
  }

  // A loop without a loader (run.steps(max_steps)): the steps each attempt trained, no samples.
  function renderSteps(s) {
    const runs = s.samples.steps;
    document.getElementById("samples-section").hidden = !runs.length;
    const byAttempt = new Map();
    for (const r of runs) {
      if (!byAttempt.has(r.attempt)) {
        byAttempt.set(r.attempt, { type: "bar", orientation: "h", y: [], x: [], base: [], customdata: [],
          name: `attempt ${r.attempt}`,
          hovertemplate: "steps %{customdata} by " + `attempt ${r.attempt}<extra></extra>` });
      }
      const t = byAttempt.get(r.attempt);
      t.y.push("steps"); t.base.push(r.start); t.x.push(r.end - r.start); t.customdata.push(`${r.start + 1}-${r.end}`);
    }
    const trained = runs.length ? runs[runs.length - 1].end : 0;
    const rest = { type: "bar", orientation: "h", y: [], x: [], base: [], name: "not trained yet",
      marker: { color: "#e3e6ea" }, hovertemplate: "%{x} steps not trained yet<extra></extra>" };
    if (s.max_steps > trained) { rest.y.push("steps"); rest.base.push(trained); rest.x.push(s.max_steps - trained); }
    document.getElementById("chart-samples").style.height = "136px";
    chart("chart-samples", [...byAttempt.values(), rest], { barmode: "overlay", showlegend: true,
      legend: { orientation: "h", y: -0.12, yanchor: "top" }, xaxis: { title: { text: "" } },
      title: { text: "the run's steps, by the attempt that trained them", font: { size: 11 }, x: 0.01, xanchor: "left" },
      margin: { l: 70, r: 12, t: 30, b: 50 } });
  }

  function onMetrics(d) {
    if (d.reset) { table.clear(); times.clear(); }
    for (const [step, values, time] of d.items) {
      table.set(step, Object.assign(table.get(step) || {}, values));
      if (time !== null && time !== undefined) times.set(step, time);
    }
    schedule();
  }

  function onLog(d) {
    const pre = document.getElementById("log");
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
    const text = d.items.join("");
    pre.textContent = (d.reset ? "" : pre.textContent) + text;
    if (pre.textContent.length > 200000) pre.textContent = pre.textContent.slice(-150000);
    if (atEnd || d.reset) pre.scrollTop = pre.scrollHeight;
  }

  function connect() {
    if (source) source.close();
    table.clear();
    document.getElementById("log").textContent = "";
    source = stream(`?run=${runId}&rank=${logRank}`, {
      summary: renderSummary,
      metrics: onMetrics,
      log: onLog,
      gpus: (gpus) => gpuRows(document.querySelector("#gpus tbody"), gpus),
      gone: () => { live(false); source.close(); },
    });
  }

  for (const b of document.querySelectorAll("#rank-toggle button")) {
    b.classList.toggle("on", b.dataset.mode === mode);
    b.addEventListener("click", () => {
      mode = b.dataset.mode;
      Prefs.set({ rankMode: mode });
      for (const other of document.querySelectorAll("#rank-toggle button")) other.classList.toggle("on", other === b);
      renderEfficiency(summary);
      schedule();
    });
  }
  chartOptions(document.getElementById("chart-options"), () => { drawn.clear(); schedule(); });
  document.getElementById("notify").addEventListener("click", () => {
    mark(runId, !isMarked(runId));
    renderNotify();
  });
  document.getElementById("log-rank").addEventListener("change", (e) => {
    logRank = Number(e.target.value);
    connect();
  });
  document.getElementById("round").addEventListener("change", (e) => renderRound(summary.mining[Number(e.target.value)]));
  document.getElementById("cancel").addEventListener("click", async () => {
    const name = summary.name;
    if (!name) return; // nothing shown yet
    const typed = window.prompt(`Cancel ${name} for good (clusterflow cancel)? Type its name to confirm:`);
    if (typed === null) return;
    const said = document.getElementById("cancel-said");
    const reply = await fetch(ROOT + "/api/cancel", {
      method: "POST",
      headers: { "content-type": "application/json", [TOKEN_HEADER]: TOKEN },
      body: JSON.stringify({ run: runId, confirm: typed }),
    });
    const body = await reply.json();
    said.textContent = reply.ok ? body.lines.join("; ") : body.error;
  });
  connect();
  // Plotly (4.6 MB, a few hundred ms of the browser's one thread to read) is fetched once the
  // summary has been drawn: the summary, tables and logs show at once, the charts as soon as it
  // has been read.
  const plotly = document.querySelector('meta[name="clusterflow-plotly"]');
  plotlyWanted = () => {
    plotlyWanted = () => {};
    if (!plotly) return;
    const script = el("script", { src: plotly.content });
    script.addEventListener("load", () => {
      rendered.clear();
      if (summary.name) renderSummary(summary);
      schedule();
    });
    // after this summary is painted: a frame's callbacks run before its paint, a timeout after
    requestAnimationFrame(() => setTimeout(() => document.head.append(script), 0));
  };
}

if (document.body.dataset.page === "runs") runsPage();
else if (document.body.dataset.page === "compare") comparePage();
else runPage();
