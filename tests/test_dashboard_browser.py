"""The dashboard in a real browser (Debian's chromium, headless, driven by Selenium) at
`python -m clusterflow.dashboard` while a real 2-rank `submit --local` run trains: the run
appears and the token leaves the address bar, a page of another port of the host learns nothing
that opens the dashboard, a new step reaches the chart without a reload, the per-rank toggle
changes the charts, the GPUs (NVML replaced at its boundary) name the run that holds them, the
run killed with SIGKILL and resumed shows two attempts and the restart, cancel from the page
stops it, both own-loop examples (run as docs/own-loop.md says) show their charts and logs, a
folder with no runs says so, no page breaks its Content-Security-Policy, and a request without
the token or with ``..`` is refused.

One run, one dashboard and one browser serve every check, in order, in one test (the checks build
on each other: the run must train before it is killed, be killed before it is resumed): 1-3
minutes here, most of it the run's two start-ups (the examples train meanwhile).

CLUSTERFLOW_DOCS_SCREENSHOTS=1 writes the pages' screenshots into docs/images/ for
docs/dashboard.md (the suite leaves the tree alone otherwise).
"""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO
from dashboards import (
    Dashboard,
    browser,
    close_browser,
    get,
    have_browser,
    make_sweep,
    poll_until,
    raw_get,
    served,
)

from clusterflow import rundir

pytestmark = pytest.mark.slow

SCREENSHOTS = os.environ.get("CLUSTERFLOW_DOCS_SCREENSHOTS") == "1"
IMAGES = os.path.join(REPO, "docs", "images")
WAIT_S = 240.0


def until(what, check, timeout=WAIT_S, every=0.25):
    """Wait for ``check()`` to return something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # noqa: BLE001 - an element not there yet
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last seen: {last!r})")


def screenshot(driver, name, height=None):
    if not SCREENSHOTS:
        return
    os.makedirs(IMAGES, exist_ok=True)
    size = driver.get_window_size()
    if height is not None:
        driver.set_window_size(size["width"], height)
        time.sleep(1.0)  # Plotly redraws at the new size
    driver.save_screenshot(os.path.join(IMAGES, name))
    if height is not None:
        driver.set_window_size(size["width"], size["height"])


class LiveRun:
    """``python -m clusterflow.submit configs/tiny.yaml --local`` as a user types it, with the
    slow test task (a sleep per step) so that it trains long enough to be watched."""

    def __init__(self, run_dir, log_dir):
        self.paths = rundir.RunPaths(str(run_dir))
        self.log_dir, self.proc, self.starts = log_dir, None, 0
        self.argv = [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            "--local",
            f"run.dir={run_dir}",
            "task.target=testtasks:Slow",
            "task.params.step_sleep=0.4",
            # far longer than the checks take, even on a loaded machine: cancel ends it
            "train.epochs=200",
            "mining.every_epochs=5",
            "dist.heartbeat_s=1",
        ]

    def start(self):
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests"), OMP_NUM_THREADS="1")
        out = open(os.path.join(self.log_dir, f"submit-{self.starts}.txt"), "w")
        self.starts += 1
        self.proc = subprocess.Popen(
            self.argv,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def status(self):
        return rundir.read_object(self.paths.status)[0]

    def kill(self):
        """SIGKILL the whole local job (submit, submitit's controller, the ranks): no record."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        pids = [p[1] for a in rundir.read_jsonl(self.paths.attempts) for p in a.get("procs") or []]
        until("the killed ranks to be gone", lambda: not any(_alive(p) for p in pids), 60)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


EXAMPLE_ARGS = {
    "ddp_classifier": ["--epochs", "1", "--width", "8"],
    "pretrain": ["--steps", "4", "--seq-len", "16", "--d-model", "16", "--layers", "1"]
    + ["--global-batch", "64", "--warmup", "2"],
}


class Examples:
    """Both own-loop examples at toy size, each submitted as docs/own-loop.md says
    (``python -m clusterflow.submit --script examples/X.py --local -- ARGS``), started at once
    and in the background: they train while the live run starts."""

    def __init__(self, root, log_dir):
        self.dirs = {name: str(root / name) for name in EXAMPLE_ARGS}
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs = {}
        for name, args in EXAMPLE_ARGS.items():
            out = open(os.path.join(log_dir, f"{name}.txt"), "w")
            argv = [sys.executable, "-m", "clusterflow.submit", "--script", f"examples/{name}.py"]
            argv += ["--local", f"run.dir={self.dirs[name]}", "--", *args]
            self.procs[name] = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self):
        for name, proc in self.procs.items():
            assert proc.wait(timeout=WAIT_S) == 0, f"examples/{name}.py did not complete"
        return self.dirs

    def close(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # submit, submitit's controller, the rank
                proc.wait()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard") / "runs"
    os.makedirs(root)
    # A finished sweep beside the live run: the Runs page groups it.
    make_sweep(root / "sweep-lr", {"lr=0.001": 0.001, "lr=0.003": 0.003, "lr=0.01": 0.01})
    return root


@pytest.fixture
def live(runs, tmp_path_factory):
    run = LiveRun(runs / "live", str(tmp_path_factory.mktemp("live-logs")))
    run.start()
    yield run
    run.close()


@pytest.fixture
def examples(tmp_path_factory):
    ex = Examples(tmp_path_factory.mktemp("examples"), str(tmp_path_factory.mktemp("ex-logs")))
    yield ex
    ex.close()


@pytest.fixture
def dashboard(runs, tmp_path_factory):
    d = Dashboard([runs], str(tmp_path_factory.mktemp("dashboard-logs")))
    yield d
    d.close()


@pytest.fixture
def driver():
    assert have_browser(), (
        "Debian's chromium and chromium-driver are needed: tests/run.sh installs them "
        "(apt-get install chromium chromium-driver)"
    )
    d = browser()
    yield d
    close_browser(d)


def texts(driver, css):
    """The text of each element ``css`` selects, read in one step (the pages redraw their
    tables as news arrives, so an element found first may be gone when read)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map((n) => n.innerText);", css
    )


def _rows(driver):
    return driver.execute_script(
        "return Object.fromEntries(Array.from(document.querySelectorAll('#runs tbody tr'))"
        ".map((r) => [r.querySelector('td a').textContent, r.dataset.state]));"
    )


def _traces(driver, chart):
    return driver.execute_script(
        "const n = document.getElementById(arguments[0]);"
        "return n && n.data ? n.data.map((t) => t.name) : null;",
        chart,
    )


def _last_step(driver):
    return driver.execute_script(
        "const n = document.getElementById('chart-loss');"
        "return n && n.data && n.data[0].x.length ? Math.max(...n.data[0].x) : null;"
    )


def check_the_run_appears_on_the_runs_page(runs, live, dashboard, driver, examples):
    driver.get(dashboard.url)
    # The page keeps the token in its own storage and takes it out of the address bar.
    until("the token out of the address bar", lambda: "token" not in driver.current_url)
    assert driver.current_url == dashboard.base + "/"
    rows = until(
        "the live run listed as running",
        lambda: _rows(driver).get("runs/live") == "running" and _rows(driver),
    )
    assert "runs/sweep-lr/lr=0.003" not in rows  # members are under their sweep
    (sweep,) = texts(driver, "#sweeps .sweep")
    assert "3 member(s), 3 completed" in sweep and "lr=0.003" in sweep


class OtherService:
    """Another local service on another port of the same host (a forwarded TensorBoard of a
    teammate): it records what each request brings, and its page reports what its script can
    see of the dashboard (a cookie, the page's storage, an answer of its API)."""

    def __init__(self, dashboard_base):
        seen, reports = [], []
        page = OTHER_PAGE.replace("DASHBOARD", dashboard_base).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(dict(self.headers))
                self.send_response(200)
                self.send_header("content-type", "text/html")
                self.end_headers()
                self.wfile.write(page)

            def do_POST(self):
                seen.append(dict(self.headers))
                reports.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.seen, self.reports = seen, reports
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


OTHER_PAGE = """<!doctype html><title>another service</title><script>
const seen = { cookie: document.cookie, stored: JSON.stringify(Object.entries(localStorage)) };
fetch("DASHBOARD/api/runs", { credentials: "include" })
  .then((r) => r.text()).then((t) => { seen.api = t; }, (e) => { seen.api = "failed: " + e; })
  .finally(() => fetch("/report", { method: "POST", body: JSON.stringify(seen) }));
</script>"""


def check_another_port_of_the_host_learns_nothing(runs, live, dashboard, driver, examples):
    """Browsers send a host's cookies to every port of it: whatever a page of another port
    receives (its server: the requests' headers; its script: cookies, storage, answers) must
    neither hold the token nor open the dashboard when replayed."""
    other = OtherService(dashboard.base)
    try:
        driver.get(other.url)
        report = until("the other page's report", lambda: other.reports and other.reports[0])
    finally:
        other.close()
    assert dashboard.token not in json.dumps(report) and "runs/live" not in report["api"], report
    assert dashboard.token not in json.dumps(other.seen), other.seen
    for headers in other.seen:
        cookie = {k.lower(): v for k, v in headers.items()}.get("cookie", "")
        code, _, _ = get(f"{dashboard.base}/api/runs", headers={"cookie": cookie})
        assert code == 403, cookie  # replayed from the same host: it opens nothing
    driver.get(dashboard.base + "/")  # back: the page still has its token
    until("the live run listed again", lambda: "runs/live" in _rows(driver))


def check_a_new_step_reaches_the_chart_without_a_reload(runs, live, dashboard, driver, examples):
    driver.find_element("link text", "runs/live").click()
    until("the run page", lambda: driver.find_element("id", "run-name").text == "runs/live")
    driver.execute_script("window.notReloaded = true;")
    first = until("a step on the loss chart", lambda: _last_step(driver))
    later = until(
        "a later step on the loss chart",
        lambda: (_last_step(driver) or 0) > first and _last_step(driver),
    )
    assert later > first
    assert driver.execute_script("return window.notReloaded === true;")


def check_the_per_rank_toggle_changes_the_charts(runs, live, dashboard, driver, examples):
    aggregated = until(
        "the step-time chart's mean of both ranks",
        lambda: (
            "mean of 2" in (_traces(driver, "chart-step-time") or [])
            and _traces(driver, "chart-step-time")
        ),
    )
    assert set(aggregated) == {"min", "min–max", "mean of 2"}
    driver.find_element("css selector", '#rank-toggle button[data-mode="per-rank"]').click()
    per_rank = until(
        "one line per rank",
        lambda: (
            {n.split(" (")[0] for n in _traces(driver, "chart-step-time") or []}
            == {"rank 0", "rank 1"}
            and _traces(driver, "chart-step-time")
        ),
    )
    assert len(per_rank) == 2
    assert len(_traces(driver, "chart-busy") or []) == 2
    driver.find_element("css selector", '#rank-toggle button[data-mode="aggregated"]').click()
    until("the mean again", lambda: "mean of 2" in (_traces(driver, "chart-step-time") or []))
    assert texts(driver, "#ranks tbody tr td:first-child") == ["0", "1"]


def check_the_gpus_name_the_run_that_holds_them(runs, live, dashboard, driver, examples):
    """NVML replaced at its boundary: a snapshot where GPU 0 and 1 are held by the live run's
    two rank processes (their heartbeats name their pids), GPU 2 by another user's process."""
    pids = until(
        "both ranks' heartbeats",
        lambda: [json.load(open(live.paths.heartbeat_file(r)))["pid"] for r in (0, 1)],
    )

    def gpu(index, used, procs, util):
        return {
            "index": index,
            "uuid": f"GPU-{index}",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mb": 81559,
            "memory_used_mb": used,
            "util_pct": util,
            "temp_c": 41,
            "processes": [{"pid": p, "name": n, "used_mb": mb} for p, n, mb in procs],
        }

    snapshot = [
        gpu(0, 30500, [(pids[0], "python", 30000)], 96),
        gpu(1, 30400, [(pids[1], "python", 29900)], 94),
        gpu(2, 12000, [(4242, "jupyter", 11700)], 7),
        gpu(3, 310, [], 0),
    ]
    with served([runs], snapshot=lambda: snapshot) as s:
        driver.get(f"{s.url}/?token={s.token}")

        def row(i):
            return texts(driver, "#gpus tbody tr")[i]

        until("the run holding GPU 0", lambda: "runs/live rank 0" in row(0))
        assert "runs/live rank 1" in row(1)
        assert "pid 4242 (jupyter)" in row(2) and "busy: held by pid 4242" in row(2)
        assert "free: no process" in row(3) and "H100" in row(3)
        until("the live run's progress", lambda: "epoch" in texts(driver, "#runs tbody tr")[0])
        screenshot(driver, "dashboard-runs.png")


def check_a_killed_and_resumed_run_shows_two_attempts_and_the_restart(
    runs, live, dashboard, driver, examples
):
    run_id = until(
        "the run's id",
        lambda: next(
            r["id"]
            for r in json.loads(get(f"{dashboard.base}/api/runs?token={dashboard.token}")[1])[
                "runs"
            ]
            if r["name"] == "runs/live"
        ),
    )
    driver.get(f"{dashboard.base}/run/{run_id}?token={dashboard.token}")
    until(
        "a committed checkpoint",
        lambda: any(n.startswith("step-") for n in os.listdir(live.paths.checkpoints)),
    )
    assert live.status().get("state") == "running"
    live.kill()
    live.start()
    driver.execute_script("window.notReloaded = true;")
    rows = until(
        "two attempts and the restart on the page",
        lambda: (
            (r := texts(driver, "#attempts tbody tr")) and len(r) == 2 and "resumed" in r[1] and r
        ),
    )
    assert "after attempt 0 ended without a record (killed)" in rows[1], rows
    assert "resumed from step" in rows[1] and "no record (killed)" in rows[0], rows
    # The kill is the first attempt's fault: when, the time until training again, and the disk
    # checkpoint the second attempt took its state from.
    fault = until(
        "the kill's recovery on the page",
        lambda: (f := texts(driver, "#attempts tbody tr td.fault")) and "again after" in f[0] and f,
    )
    restored = rundir.read_object(live.paths.timeline_file(1))[0]["restored_step"]
    assert fault[0].startswith("killed at "), fault
    assert f"from the disk checkpoint at step {restored};" in fault[0], fault
    assert "step(s) trained again; charged " in fault[0] and fault[1] == "–", fault
    notes = driver.execute_script(
        "return document.getElementById('chart-attempts').layout.annotations.map((a) => a.text);"
    )
    assert notes == ["restart → attempt 1"]
    assert driver.execute_script("return window.notReloaded === true;")
    until(
        "attempt 1 training",
        lambda: (
            (live.status().get("global_step") or 0) > 8 and live.status().get("state") == "running"
        ),
    )
    until("the new attempt's steps on the chart", lambda: (_last_step(driver) or 0) > 8)
    screenshot(driver, "dashboard-run.png", height=4200)


def check_cancel_from_the_page_stops_the_run(runs, live, dashboard, driver, examples):
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    button = driver.find_element("id", "cancel")
    assert button.is_displayed() and button.is_enabled()
    # Its handler opens a prompt, which holds the page's one thread until answered: the click is
    # dispatched by the page's own timer, so that no command of the driver waits on the prompt
    # (a click command that does can outwait the driver's read timeout on a loaded machine).
    driver.execute_script("const b = arguments[0]; setTimeout(() => b.click(), 0);", button)
    alert = WebDriverWait(driver, WAIT_S).until(expected_conditions.alert_is_present())
    alert.send_keys("runs/live")
    alert.accept()
    said = until("the cancel's answer", lambda: driver.find_element("id", "cancel-said").text)
    assert "marked cancelled" in said, said
    assert os.path.exists(live.paths.cancelled)
    live.proc.wait(timeout=WAIT_S)
    until(
        "the page to say cancelled",
        lambda: texts(driver, "#card-state .v") == ["cancelled"],
    )


def check_the_own_loop_examples_show_their_charts_and_logs(runs, live, dashboard, driver, examples):
    """An own loop's metrics.jsonl starts each attempt with a purge at a step it logs no value
    at: both examples' pages draw their loss and show their log all the same."""
    dirs = examples.wait()
    with served(list(dirs.values())) as s:
        assert poll_until(s.catalog, lambda: len(s.catalog.runs) == 2)
        driver.get(f"{s.url}/?token={s.token}")
        # ddp_classifier's loop was run.epochs(1) (config.yaml keeps train.epochs' default, 4):
        # its row shows the script's one epoch.
        row = until(
            "ddp_classifier's progress",
            lambda: next(
                (
                    t
                    for t in texts(driver, "#runs tbody tr")
                    if "ddp_classifier" in t and "epoch" in t
                ),
                None,
            ),
        )
        assert "epoch 1/1, step " in row, row
        for run in list(s.catalog.runs.values()):
            driver.get(f"{s.url}/run/{run.id}")
            until(f"{run.name}'s loss chart", lambda: _last_step(driver))
            until(
                f"{run.name}'s log",
                lambda: "run completed" in driver.find_element("id", "log").text,
            )
            assert driver.find_element("id", "live").text == "live"
            assert texts(driver, "#card-state .v") == ["completed"]
            if "ddp_classifier" in run.name:
                (progress,) = texts(driver, "#card-progress .v")
                assert progress.startswith("epoch 1/1, step "), progress


def check_a_folder_with_no_runs_says_so(runs, live, dashboard, driver, examples):
    empty = os.path.join(os.path.dirname(str(runs)), "nothing-here")
    os.makedirs(os.path.join(empty, "some", "folder"), exist_ok=True)
    with served([empty]) as s:
        driver.get(f"{s.url}/?token={s.token}")
        said = until(
            "the page saying so",
            lambda: "searched" in (t := driver.find_element("id", "empty").text) and t,
        )
        assert said.startswith("No run or sweep under ") and "nothing-here" in said, said
        assert "3 folder(s) searched" in said and "config.yaml" in said, said


def check_a_request_without_the_token_is_refused_and_dot_dot_is_404(
    runs, live, dashboard, driver, examples
):
    # Every page so far kept to its Content-Security-Policy (Plotly included).
    broken = [e["message"] for e in driver.get_log("browser") if "Security Policy" in e["message"]]
    assert not broken, broken
    for path in ("/api/runs", "/api/stream", f"/api/stream?run={'0' * 12}"):
        code, body, _ = get(dashboard.base + path)
        assert code == 403 and "needs its token" in body, path
    driver.get(f"{dashboard.base}/run/{'0' * 12}")  # no such run: the page says so
    until(
        "the page saying there is no such run",
        lambda: "404: no such run" in driver.find_element("id", "refused").text,
    )
    driver.get(dashboard.base + "/")
    driver.execute_script("window.localStorage.clear();")  # this origin's: the token is gone
    driver.refresh()
    until(
        "the page saying it needs its token",
        lambda: "403: this dashboard needs its token" in driver.find_element("id", "refused").text,
    )
    assert not _rows(driver)
    for path in (
        f"/static/../../../../etc/passwd?token={dashboard.token}",
        f"/static/..%2F..%2F..%2Fetc%2Fpasswd?token={dashboard.token}",
        f"/run/../../etc?token={dashboard.token}",
    ):
        code, body = raw_get(dashboard.port, path)
        assert code == 404 and "root:" not in body, path


CHECKS = (
    check_the_run_appears_on_the_runs_page,
    check_another_port_of_the_host_learns_nothing,
    check_a_new_step_reaches_the_chart_without_a_reload,
    check_the_per_rank_toggle_changes_the_charts,
    check_the_gpus_name_the_run_that_holds_them,
    check_a_killed_and_resumed_run_shows_two_attempts_and_the_restart,
    check_cancel_from_the_page_stops_the_run,
    check_the_own_loop_examples_show_their_charts_and_logs,
    check_a_folder_with_no_runs_says_so,
    check_a_request_without_the_token_is_refused_and_dot_dot_is_404,
)


def test_the_dashboard_in_a_browser_while_a_real_run_trains(
    runs, live, examples, dashboard, driver
):
    """Every check above, in order, against one live run, one dashboard and one browser."""
    for check in CHECKS:
        started = time.monotonic()
        check(runs, live, dashboard, driver, examples)
        print(f"{check.__name__}: {time.monotonic() - started:.1f} s")
