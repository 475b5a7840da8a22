"""Dashboard benchmark: many runs whose records grow, one server, one headless browser.

    python benchmarks/dashboard.py                      # 200 runs x 16 ranks, 2 minutes, a
                                                        # compare page of 8 runs open
    python benchmarks/dashboard.py --minutes 10         # the memory check over 10 minutes
    python benchmarks/dashboard.py --runs 20 --minutes 1

A writer process makes ``--runs`` run dirs of ``--ranks`` ranks each (config.yaml, status.json,
attempts.jsonl naming the writer's own process so every run reads as running, a heartbeat per
rank, a timeline, 500 steps of metrics with per-rank step and busy times) and then keeps their
records growing as training does: every ``--every`` seconds each run gets a metrics row (loss,
lr, throughput, per-rank times), a new status.json and timeline, and rank 0 of the watched run a
log line; every 10 s each rank a new heartbeat. ``python -m clusterflow.dashboard`` serves them;
Debian's chromium (Selenium) opens the pages. Measured, as the issue asks:

- page load: the Runs page (every run in its table), a run's page (its summary) and the compare
  page of 8 runs (``--compare``: their table), navigation start to the page drawn (its data
  comes by its stream, after the page), median of 10 loads each, in the browser; and the plain
  HTTP time of each page's data (``/api/runs``, ``/api/run/ID``, ``/api/compare?runs=...``);
- a new record on the page: the time from the writer appending a metrics row to the open run
  page drawing that step on its loss chart (Plotly's afterplot event), the same for the compare
  page (open all the while in a second window: its 8 runs' metrics are followed too), and from a
  status.json with a new step to the Runs page showing it;
- the server's CPU when nothing changes: the writer paused (its process alive, so the runs stay
  running), a Runs page and the compare page open, CPU seconds of the server over 60 s;
- memory over the run: the server's resident set size every 10 s while the records grow, with
  both pages open.

Prints the figures, then the ratios to the targets last (each under 1 is within the target).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from dashboards import browser, close_browser
from selenium.webdriver.remote.webdriver import WebDriver

from clusterflow import rundir
from clusterflow.rundir import lease
from clusterflow.storage import durable

HOST = socket.gethostname()
# performance.mark()s of the pages (clusterflow/web/static/dashboard.js): their data first drawn.
RUNS_DRAWN, SUMMARY_DRAWN = "clusterflow-runs-drawn", "clusterflow-summary-drawn"
COMPARE_DRAWN = "clusterflow-compare-drawn"
LOAD_TARGET_S, LATENCY_TARGET_S, IDLE_TARGET, GROWTH_TARGET = 0.3, 2.0, 0.05, 0.10


# -- the runs and their writer ------------------------------------------------------------------


def _heartbeat(rank: int, step: int, now: float) -> dict[str, object]:
    return {
        "rank": rank,
        "host": f"node{rank // 8 + 1}",
        "pid": 100_000 + rank,
        "time": now,
        "step": step,
        "phase": "train",
        "beats": step,
        "progress_at": now,
        "step_time_s": 0.25,
        "busy_s": 0.2 + 0.01 * (rank % 3),
        "heartbeat_s": 10.0,
    }


def _row(step: int, ranks: int) -> dict[str, object]:
    row: dict[str, object] = {
        "step": step,
        "attempt": 0,
        "train/loss": 5.0 / (1 + step / 100),
        "train/lr": 0.003,
        "perf/samples_per_s_total": 1000.0 + step % 7,
        "eval/recall": min(1.0, step / 5000),
    }
    for r in range(ranks):
        row[f"ranks/step_time_s/rank{r}"] = 0.25 + 0.001 * r
        row[f"ranks/busy_s/rank{r}"] = 0.2 + 0.01 * (r % 3)
    return row


class Runs:
    def __init__(self, root: str, runs: int, ranks: int) -> None:
        self.paths = [rundir.RunPaths(os.path.join(root, f"run{i:03d}")) for i in range(runs)]
        self.ranks = ranks
        self.step = 500

    def make(self) -> None:
        me = [HOST, os.getpid(), lease.process_start(os.getpid())]
        now = time.time()
        for p in self.paths:
            os.makedirs(p.heartbeats, exist_ok=True)
            os.makedirs(p.logs, exist_ok=True)
            with open(p.config, "w") as f:
                f.write(
                    f"run: {{dir: {p.root}}}\ntrain: {{epochs: 100}}\ndist: {{heartbeat_s: 10}}\n"
                )
            rundir.append_jsonl(
                p.attempts,
                {
                    "attempt": 0,
                    "started_at": now - 600,
                    "job_id": str(os.getpid()),
                    "source": "local",
                    "world_size": self.ranks,
                    "hosts": [HOST],
                    "procs": [me],
                },
            )
            with open(p.metrics, "w") as f:
                f.writelines(
                    json.dumps(_row(s, self.ranks)) + "\n" for s in range(1, self.step + 1)
                )
            self._status(p, now)
            self._heartbeats(p, now)

    def _status(self, p: rundir.RunPaths, now: float) -> None:
        status = {
            "state": "running",
            "epoch": self.step // 100,
            "global_step": self.step,
            "step_in_epoch": self.step % 100,
            "steps_per_epoch": 100,
            "world_size": self.ranks,
            "hosts": [HOST],
            "updated_at": now,
            "last_loss": 5.0 / (1 + self.step / 100),
        }
        durable.write_atomic(p.status, json.dumps(status), fsync=False)
        timeline = {
            "attempt": 0,
            "world_size": self.ranks,
            "process_started_at": now - 600,
            "first_step_at": now - 590,
            "last_step": self.step,
            "written_at": now,
            "seconds": {"train": 500.0, "eval": 10.0, "mining": 0.0, "checkpoint": 5.0},
        }
        durable.write_atomic(p.timeline_file(0), json.dumps(timeline), fsync=False)

    def _heartbeats(self, p: rundir.RunPaths, now: float) -> None:
        for r in range(self.ranks):
            durable.write_atomic(
                p.heartbeat_file(r), json.dumps(_heartbeat(r, self.step, now)), fsync=False
            )

    def grow(self, now: float, heartbeats: bool) -> float:
        """One round: a step for every run; returns when the watched run's row landed."""
        self.step += 1
        landed = 0.0
        for i, p in enumerate(self.paths):
            with open(p.metrics, "a") as f:
                f.write(json.dumps(_row(self.step, self.ranks)) + "\n")
            if i == 0:
                landed = time.time()
                with open(p.log_file(0, 0), "a") as f:
                    f.write(f"step {self.step} loss {5.0 / (1 + self.step / 100):.4f}\n")
            self._status(p, now)
            if heartbeats:
                self._heartbeats(p, now)
        return landed


def writer(
    root: str,
    runs: int,
    ranks: int,
    every: float,
    control: multiprocessing.Queue,
    log: multiprocessing.Queue,
) -> None:
    """The writer process: makes the runs, then grows them until told to pause or stop."""
    w = Runs(root, runs, ranks)
    w.make()
    log.put(("made", time.time()))
    paused, last_hb = False, 0.0
    while True:
        while not control.empty():
            what = control.get()
            if what == "stop":
                return
            paused = what == "pause"
        if not paused:
            now = time.time()
            hb = now - last_hb >= 10.0
            last_hb = now if hb else last_hb
            landed = w.grow(now, hb)
            log.put(("step", w.step, landed))
        time.sleep(every)


# -- the measurements ---------------------------------------------------------------------------


@dataclasses.dataclass
class Figures:
    first_collect_s: float = 0.0
    runs_load_s: list[float] = dataclasses.field(default_factory=list)
    runs_http_s: list[float] = dataclasses.field(default_factory=list)
    run_load_s: list[float] = dataclasses.field(default_factory=list)
    run_http_s: list[float] = dataclasses.field(default_factory=list)
    run_charts_s: list[float] = dataclasses.field(default_factory=list)  # the loss chart drawn
    compare_load_s: list[float] = dataclasses.field(default_factory=list)
    compare_http_s: list[float] = dataclasses.field(default_factory=list)
    latency_s: list[float] = dataclasses.field(default_factory=list)  # metrics row -> chart
    compare_latency_s: list[float] = dataclasses.field(default_factory=list)  # ... compare page
    runs_latency_s: list[float] = dataclasses.field(default_factory=list)  # status -> Runs page
    steps_written: int = 0
    grow_s: float = 0.0  # seconds per round of the writer over every run, as it managed
    load_avg: list[float] = dataclasses.field(default_factory=list)  # the machine's, 1 min
    idle_cpu: float = 0.0  # of one core
    rss_mb: list[tuple[float, float]] = dataclasses.field(default_factory=list)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _load_s(driver: WebDriver, url: str, ready: str, mark: str) -> float:
    """Navigation start to ``url`` drawn: its load event, or the page's ``mark`` (the moment it
    first drew its data, which comes by its stream after the page) if that came later; ``ready``
    says the page is complete."""
    driver.get(url)
    _until(driver, ready, 60)
    timing = driver.execute_script(
        "const n = performance.getEntriesByType('navigation')[0];"
        "const m = performance.getEntriesByName(arguments[0]);"
        "return Math.max(n.loadEventEnd, m.length ? m[0].startTime : Infinity);",
        mark,
    )
    return timing / 1000


def _until(driver: WebDriver, script: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not driver.execute_script(script):
        time.sleep(0.05)


def _drain(log: multiprocessing.Queue, landed: dict[int, float]) -> None:
    while not log.empty():
        kind, step, at = log.get()
        if kind == "step":
            landed[step] = at


def _http_s(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        r.read()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--minutes", type=float, default=2.0, help="how long the records grow")
    p.add_argument("--every", type=float, default=1.0, help="seconds between steps of every run")
    p.add_argument("--compare", type=int, default=8, help="runs on the compare page (0: none)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="cf-dashboard-bench-")
    control: multiprocessing.Queue = multiprocessing.Queue()
    log: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(
        target=writer, args=(root, a.runs, a.ranks, a.every, control, log)
    )
    proc.start()
    assert log.get(timeout=600)[0] == "made"
    print(f"{a.runs} runs x {a.ranks} ranks in {root}; records grow every {a.every:g} s")
    server = subprocess.Popen(
        [sys.executable, "-m", "clusterflow.dashboard", root],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdout is not None
    url = server.stdout.readline().strip().split(": ", 1)[1]
    base, token = url.split("/?token=")
    driver = browser(1400, 1000)
    try:
        figures = measure(a, driver, server.pid, base, token, control, log)
    finally:
        close_browser(driver)
        control.put("stop")
        proc.join(timeout=30)
        server.terminate()
        server.wait(timeout=30)
    report(figures)


def measure(
    a: argparse.Namespace,
    d: WebDriver,
    pid: int,
    base: str,
    token: str,
    control: multiprocessing.Queue,
    log: multiprocessing.Queue,
) -> Figures:
    f = Figures()
    # Every run listed, then collected once (the first poll reads them all).
    rows = f"return document.querySelectorAll('#runs tbody tr').length === {a.runs};"
    running = (
        "return Array.from(document.querySelectorAll('#runs tbody tr'))"
        ".every((r) => r.dataset.state === 'running');"
    )
    t0 = time.time()
    _load_s(d, f"{base}/?token={token}", rows, RUNS_DRAWN)
    _until(d, running, 600)
    f.first_collect_s = time.time() - t0
    with urllib.request.urlopen(f"{base}/api/runs?token={token}") as r:
        runs = json.loads(r.read())["runs"]
    first = next(r["id"] for r in runs if r["name"].endswith("run000"))
    f.runs_load_s = [_load_s(d, f"{base}/", rows, RUNS_DRAWN) for _ in range(10)]
    f.runs_http_s = [_http_s(f"{base}/api/runs?token={token}") for _ in range(10)]
    chart = "const n = document.getElementById('chart-loss'); return !!(n && n.data);"
    for _ in range(10):
        summary = "return document.getElementById('run-name').textContent !== '';"
        f.run_load_s.append(_load_s(d, f"{base}/run/{first}", summary, SUMMARY_DRAWN))
        _until(d, chart, 60)  # the charts: Plotly is read after the load event
        f.run_charts_s.append(d.execute_script("return performance.now();") / 1000)
    f.run_http_s = [_http_s(f"{base}/api/run/{first}?token={token}") for _ in range(10)]
    ids = ",".join(r["id"] for r in sorted(runs, key=lambda r: r["name"])[: a.compare])
    compare = f"{base}/compare?runs={ids}"
    compared = f"return document.querySelectorAll('#compare-runs tbody tr').length === {a.compare};"
    loss = "const n = document.getElementById('chart-compare-train_loss'); return !!(n && n.data);"
    main_window = compare_window = d.current_window_handle
    if a.compare:
        for _ in range(10):
            f.compare_load_s.append(_load_s(d, compare, compared, COMPARE_DRAWN))
            _until(d, loss, 60)
        f.compare_http_s = [
            _http_s(f"{base}/api/compare?runs={ids}&token={token}") for _ in range(10)
        ]
        # The compare page stays open in a second window for the rest (a hidden tab would not
        # draw); its first run's line is timed as the run page's loss chart is.
        d.switch_to.new_window("window")
        d.get(compare)
        _until(d, loss, 120)
        d.execute_script(
            "window.drawn = {}; const n = document.getElementById('chart-compare-train_loss');"
            "n.on('plotly_afterplot', () => { const now = Date.now() / 1000;"
            " for (const s of n.data[0].x) if (!(s in window.drawn)) window.drawn[s] = now; });"
        )
        compare_window = d.current_window_handle
        d.switch_to.window(main_window)
    # A new row on the open run page: Plotly's afterplot names each step drawn, with its time.
    d.get(f"{base}/run/{first}")
    _until(d, chart, 120)
    d.execute_script(
        "window.drawn = {}; const n = document.getElementById('chart-loss');"
        "n.on('plotly_afterplot', () => { const now = Date.now() / 1000;"
        " for (const s of n.data[0].x) if (!(s in window.drawn)) window.drawn[s] = now; });"
    )
    landed: dict[int, float] = {}
    _drain(log, {})  # steps written before the page listened
    t_start = next_rss = time.time()
    f.load_avg.append(os.getloadavg()[0])
    while time.time() - t_start < a.minutes * 60:
        _drain(log, landed)
        if time.time() >= next_rss:
            f.rss_mb.append((time.time() - t_start, _rss_mb(pid)))
            next_rss += 10
        time.sleep(0.5)
    f.load_avg.append(os.getloadavg()[0])
    drawn = d.execute_script("return window.drawn;")
    if a.compare:
        d.switch_to.window(compare_window)
        on_compare = d.execute_script("return window.drawn;")
        f.compare_latency_s = [
            float(on_compare[str(s)]) - t
            for s, t in sorted(landed.items())
            if str(s) in on_compare and t >= t_start
        ]
        d.switch_to.window(main_window)
    # A round's steps are reported once the writer finished it: a step whose row landed before
    # the page listened was drawn unseen.
    f.latency_s = [
        float(drawn[str(s)]) - t
        for s, t in sorted(landed.items())
        if str(s) in drawn and t >= t_start
    ]
    f.steps_written = len(landed)
    f.grow_s = a.minutes * 60 / max(1, len(landed))
    # A new step on the Runs page (status.json lands with the metrics row).
    d.get(f"{base}/")
    _until(d, rows, 60)
    d.execute_script(
        "window.seen = {}; setInterval(() => { const r = document.querySelector('#runs tbody tr');"
        " const m = r && r.innerText.match(/step (\\d+)/); if (m && !(m[1] in window.seen))"
        " window.seen[m[1]] = Date.now() / 1000; }, 20);"
    )
    landed = {}
    _drain(log, {})
    t0 = time.time()
    while time.time() - t0 < 30:
        _drain(log, landed)
        time.sleep(0.5)
    seen = d.execute_script("return window.seen;")
    f.runs_latency_s = [float(seen[str(s)]) - t for s, t in landed.items() if str(s) in seen]
    # Nothing changes: the writer paused (alive: the runs stay running), the Runs page open (and
    # the compare page, in its window).
    control.put("pause")
    time.sleep(30)
    c0, w0 = _cpu_s(pid), time.time()
    time.sleep(60)
    f.idle_cpu = (_cpu_s(pid) - c0) / (time.time() - w0)
    return f


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))] if ordered else float("nan")


def report(f: Figures) -> None:
    ms = 1000
    warm = [m for t, m in f.rss_mb if t >= 60] or [m for _, m in f.rss_mb]
    growth = (warm[-1] - warm[0]) / warm[0] if warm else float("nan")
    lat95 = _pct(f.latency_s, 0.95)
    print(f"{'writer: a step of every run every':<38}{f.grow_s:.1f} s (as fast as it managed)")
    loads = ", ".join(f"{x:.1f}" for x in f.load_avg)
    print(f"{'load average while records grew':<38}{loads} ({os.cpu_count()} cores)")
    print(f"first collect of every run            {f.first_collect_s:.1f} s")
    for name, load, http in (
        ("Runs page", f.runs_load_s, f.runs_http_s),
        ("run page", f.run_load_s, f.run_http_s),
        ("compare page (8 runs)", f.compare_load_s, f.compare_http_s),
    ):
        if not load:
            continue
        print(
            f"{name + ' load (browser)':<38}median {statistics.median(load) * ms:.0f} ms, "
            f"worst {max(load) * ms:.0f} ms; HTTP alone {statistics.median(http) * ms:.0f} ms"
        )
    print(
        f"{'run page: loss chart drawn':<38}median {statistics.median(f.run_charts_s) * ms:.0f} ms"
        " after navigation start (Plotly is read after the summary is drawn)"
    )
    print(
        f"{'new metrics row to the chart':<38}median {_pct(f.latency_s, 0.5):.2f} s, "
        f"95th {lat95:.2f} s, worst {_pct(f.latency_s, 1.0):.2f} s "
        f"({len(f.latency_s)} of {f.steps_written} steps drawn)"
    )
    if f.compare_latency_s:
        print(
            f"{'new metrics row to the compare chart':<38}median "
            f"{_pct(f.compare_latency_s, 0.5):.2f} s, 95th {_pct(f.compare_latency_s, 0.95):.2f}"
            f" s, worst {_pct(f.compare_latency_s, 1.0):.2f} s ({len(f.compare_latency_s)} steps)"
        )
    print(
        f"{'new step to the Runs page':<38}median {_pct(f.runs_latency_s, 0.5):.2f} s, "
        f"worst {_pct(f.runs_latency_s, 1.0):.2f} s ({len(f.runs_latency_s)} steps seen)"
    )
    print(f"{'server CPU, nothing changing':<38}{100 * f.idle_cpu:.1f}% of one core")
    print(f"{'server RSS every 10 s (MB)':<38}" + " ".join(f"{m:.0f}" for _, m in f.rss_mb))
    print(f"{'RSS, first minute to the end':<38}{growth:+.1%}")
    print("ratios to the targets (under 1: within):")
    runs_load, run_load = statistics.median(f.runs_load_s), statistics.median(f.run_load_s)
    compare_load = statistics.median(f.compare_load_s) if f.compare_load_s else float("nan")
    print(
        f"  page load / 300 ms          Runs {runs_load / LOAD_TARGET_S:.2f}, "
        f"run {run_load / LOAD_TARGET_S:.2f}, compare {compare_load / LOAD_TARGET_S:.2f}"
    )
    print(
        f"  new record / 2 s (95th)     run page {lat95 / LATENCY_TARGET_S:.2f}, compare page "
        f"{_pct(f.compare_latency_s, 0.95) / LATENCY_TARGET_S:.2f}"
    )
    print(f"  idle CPU / 5% of a core     {f.idle_cpu / IDLE_TARGET:.2f}")
    print(f"  RSS growth / 10%            {abs(growth) / GROWTH_TARGET:.2f}")


if __name__ == "__main__":
    main()
