"""The dashboard's compare, config, chart and alert views in a real browser (Debian's chromium,
headless, Selenium) over real runs: a 4-member `--sweep` of `submit --local` runs (train.lr),
and a run that fails when the test says so, whose run dir's name and config carry HTML. One
sweep, one failing run, one `python -m clusterflow.dashboard` and one browser serve every test
of this module (module-scoped: the suite builds them once).

- two runs chosen on the Runs page overlaid on one chart, their differing key in the legend;
- the sweep's 4 members plotted against their swept value, and in parallel coordinates;
- a run's config with its secret masked; a sweep over secrets (a script's --api-key and -k, a
  tracker's key, a URL's password) with none on the Runs page, a member's page or the compare
  page, its members' names included;
- smoothing, the log scale and the wall-time axis change the chart, as computed here;
- the CSV download holds the plotted points, the PNG is a PNG;
- a marked run that fails raises a notification (the Notification API stubbed in the page);
- names, config values and log lines are shown as text, never as HTML;
- --root-path, --token-file and --list: a second dashboard behind a path prefix.

CLUSTERFLOW_DOCS_SCREENSHOTS=1 writes the compare page's screenshot into docs/images/.
"""

import csv
import io
import json
import os
import re
import stat
import subprocess
import sys

import pytest
from conftest import REPO, run_cli
from dashboards import (
    PLANTED,
    Dashboard,
    add_metrics,
    browser,
    close_browser,
    get,
    have_browser,
    make_secret_sweep,
    make_sweep,
)
from test_dashboard_browser import screenshot, texts, until

from clusterflow import rundir
from clusterflow.config.masking import MASK
from clusterflow.observe.metrics import read_metrics

pytestmark = pytest.mark.slow

LRS = ("0.001", "0.003", "0.01", "0.03")
SECRET = "s3cr3t-w4ndb-9f8e7d"
HTML = '<img src=x onerror="window.xss=1">'
ENV = {"PYTHONPATH": os.path.join(REPO, "tests"), "OMP_NUM_THREADS": "1"}


class RealRuns:
    """The sweep and the failing run, started at once in the background (the sweep's members
    run one after another, --local); ``wait()`` for the sweep to have completed."""

    def __init__(self, root, logs):
        self.root, self.logs = root, logs
        self.sweep = os.path.join(root, "sweep-lr")
        self.failing = os.path.join(root, f"fails {HTML}")
        self.fail_file = os.path.join(logs, f"fail-now {HTML}")  # its error's log line
        env = dict(os.environ, **ENV)
        sweep = [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            f"run.dir={self.sweep}",
            "--sweep",
            f"train.lr={','.join(LRS)}",
            "cluster.tasks_per_node=1",
            "train.epochs=2",
            "mining.enabled=false",
            f"cluster.setup=[export WANDB_API_KEY={SECRET}]",
            "--local",
        ]
        failing = [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            f"run.dir={self.failing}",
            "task.target=testtasks:FailWhenFileAppears",
            f"task.params.fail_file={self.fail_file}",
            "task.params.step_sleep=0.3",
            f"run.name=run {HTML}",
            "cluster.tasks_per_node=1",
            "train.epochs=500",
            "mining.enabled=false",
            "dist.heartbeat_s=1",
            "--local",
        ]
        self.procs = [
            subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdout=open(os.path.join(logs, f"{name}.txt"), "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for name, argv in (("sweep", sweep), ("failing", failing))
        ]

    def wait_sweep(self):
        code = self.procs[0].wait(timeout=600)
        assert code == 0, open(os.path.join(self.logs, "sweep.txt")).read()[-3000:]

    def members(self):
        return {
            lr: next(
                os.path.join(self.sweep, n)
                for n in os.listdir(self.sweep)
                if n.startswith(f"lr={lr}-")
            )
            for lr in LRS
        }

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=60)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("views") / "runs"
    os.makedirs(root)
    runs = RealRuns(str(root), str(tmp_path_factory.mktemp("views-logs")))
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def board(real_runs, tmp_path_factory):
    state = str(tmp_path_factory.mktemp("xdg-state"))
    d = Dashboard([real_runs.root], real_runs.logs, env={"XDG_STATE_HOME": state})
    d.state = state
    yield d
    d.close()


@pytest.fixture(scope="module")
def page():
    assert have_browser(), "Debian's chromium and chromium-driver are needed (tests/run.sh)"
    d = browser()
    yield d
    close_browser(d)


def _ids(board):
    """Run name -> id, as the dashboard lists them."""
    code, body, _ = get(f"{board.base}/api/runs?token={board.token}")
    assert code == 200, body
    return {r["name"]: r["id"] for r in json.loads(body)["runs"]}


def _open(page, board, path):
    """``path`` in the browser, with the chart options back at their defaults."""
    page.get(f"{board.base}{path}{'&' if '?' in path else '?'}token={board.token}")
    page.execute_script("window.localStorage.removeItem('clusterflow-dashboard-prefs');")
    page.refresh()


def _data(page, chart):
    return page.execute_script(
        "const n = document.getElementById(arguments[0]);"
        "return n && n.data ? n.data.map((t) => ({name: t.name, x: t.x, y: t.y})) : null;",
        chart,
    )


def _click(page, what, css):
    """Click the element ``css`` once it is there (in one step of the page's own script: the
    Runs page redraws its tables as news arrives, so an element found first may be gone when
    clicked)."""
    until(
        what,
        lambda: page.execute_script(
            "const n = document.querySelector(arguments[0]); if (n) n.click(); return !!n;", css
        ),
    )


def _layout(page, chart):
    return page.execute_script(
        "const n = document.getElementById(arguments[0]); return n && n.layout;", chart
    )


def _member_names(real_runs):
    rel = os.path.relpath(real_runs.sweep, os.path.dirname(real_runs.root))
    return {lr: os.path.join(rel, os.path.basename(p)) for lr, p in real_runs.members().items()}


def _ready(real_runs, board):
    """Every sweep member listed and completed."""
    real_runs.wait_sweep()
    names = _member_names(real_runs)

    def listed():
        _, body, _ = get(f"{board.base}/api/runs?token={board.token}")
        runs = {r["name"]: r for r in json.loads(body)["runs"]}
        return all(runs.get(n, {}).get("state") == "completed" for n in names.values()) and runs

    return until("the sweep's members completed on the dashboard", listed, 120)


def test_two_chosen_runs_overlaid_with_their_differing_key_in_the_legend(real_runs, board, page):
    _ready(real_runs, board)
    names = _member_names(real_runs)
    _open(page, board, "/")
    for lr in ("0.001", "0.003"):
        _click(page, f"the member lr={lr}", f'.sweep tr[data-member^="lr={lr}-"] input.choose')
    _click(page, "the compare button", "#compare-selected")
    traces = until(
        "both runs on the loss chart",
        lambda: (d := _data(page, "chart-compare-train_loss")) and len(d) == 2 and d,
    )
    assert sorted(t["name"] for t in traces) == ["train.lr=0.001", "train.lr=0.003"]
    for t in traces:
        member = real_runs.members()[t["name"].split("=")[1]]
        loss = {s: v["train/loss"] for s, v in read_metrics(member).items() if "train/loss" in v}
        assert t["x"] == sorted(loss) and t["y"] == [loss[s] for s in sorted(loss)]
    legend = texts(page, "#compare-runs tbody tr td:last-child")
    assert sorted(legend) == ["train.lr=0.001", "train.lr=0.003"], legend
    assert "the runs differ in train.lr" in page.find_element("id", "compare-keys").text
    assert set(texts(page, "#compare-runs tbody tr td:nth-child(2)")) == {
        names["0.001"],
        names["0.003"],
    }


def test_a_sweep_of_4_members_against_its_swept_value(real_runs, board, page):
    _ready(real_runs, board)
    _open(page, board, "/")
    _click(page, "the sweep's compare link", "a.compare-sweep")
    until("the metric choice", lambda: "train/loss" in texts(page, "#sweep-metric option"))
    page.execute_script(
        "const s = document.getElementById('sweep-metric'); s.value = 'train/loss';"
        "s.dispatchEvent(new Event('change'));"
    )
    # The reference, from each member's metrics.jsonl: its last and its smallest loss.
    final, least = {}, {}
    for lr, member in real_runs.members().items():
        loss = [
            v["train/loss"] for _, v in sorted(read_metrics(member).items()) if "train/loss" in v
        ]
        final[float(lr)], least[float(lr)] = loss[-1], min(loss)
    plotted = until(
        "the final loss of 4 members by train.lr",
        lambda: (d := _data(page, "chart-sweep-train_lr")) and len(d[0]["x"]) == 4 and d[0],
    )
    assert plotted["x"] == sorted(final) and plotted["y"] == [final[x] for x in sorted(final)]
    page.execute_script(
        "const s = document.getElementById('sweep-reduce'); s.value = 'min';"
        "s.dispatchEvent(new Event('change'));"
    )
    smallest = until(
        "the smallest loss instead",
        lambda: (d := _data(page, "chart-sweep-train_lr")) and d[0]["y"] != plotted["y"] and d[0],
    )
    assert smallest["y"] == [least[x] for x in sorted(least)]
    lines = until(
        "4 lines of the parallel coordinates",
        lambda: (d := _data(page, "chart-parallel")) and len(d) == 4 and d,
    )
    assert all(len(t["x"]) == 2 for t in lines)  # the swept key and the metric
    assert _layout(page, "chart-parallel")["xaxis"]["ticktext"] == [
        "train.lr",
        "smallest train/loss",
    ]
    screenshot(page, "dashboard-compare.png", height=1500)


def test_a_runs_config_with_its_secret_masked(real_runs, board, page):
    _ready(real_runs, board)
    member = _member_names(real_runs)["0.01"]
    _open(page, board, f"/run/{_ids(board)[member]}")
    rows = until(
        "the config table",
        lambda: dict(
            page.execute_script(
                "return Array.from(document.querySelectorAll('#config tbody tr'))"
                ".map((r) => Array.from(r.cells).map((c) => c.textContent));"
            )
        ),
    )
    assert rows["cluster.setup"] == f'["export WANDB_API_KEY={MASK}"]'
    assert rows["train.lr"] == "0.01" and rows["mining.enabled"] == "false"
    assert SECRET not in page.page_source and SECRET not in page.execute_script(
        "return document.documentElement.textContent;"
    )


def _seen(page):
    """Everything of the page a user or its script can read: its markup and its text."""
    return page.page_source + page.execute_script("return document.documentElement.textContent;")


def test_a_sweep_over_secrets_shows_none_on_any_page(real_runs, board, page):
    """A sweep (its records) whose swept values and members' configs hold a secret in every form
    the masking rule knows, beside the real runs of the module's dashboard: the Runs page's
    group, a member's page (config and script line) and the sweep's compare page show each
    masked, and no trace of any."""
    members = make_secret_sweep(os.path.join(real_runs.root, "vault"))
    sweep = until(
        "the sweep listed",
        lambda: next(
            (
                g
                for g in json.loads(get(f"{board.base}/api/runs?token={board.token}")[1])["sweeps"]
                if g["name"].endswith("/vault") and all(m["id"] for m in g["members"])
            ),
            None,
        ),
    )
    _open(page, board, "/")
    cells = until(
        "the sweep's values",
        lambda: page.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0]))"
            ".map((r) => Array.from(r.cells).slice(2, 6).map((c) => c.textContent));",
            f"#sweep-{sweep['id']} tbody tr",
        ),
    )
    assert cells == [[MASK, MASK, MASK, f"https://{MASK}@ml.example"]] * 2, cells
    assert sorted(texts(page, f"#sweep-{sweep['id']} tbody tr td:last-child")) == sorted(members)
    assert PLANTED not in _seen(page)
    _open(page, board, f"/run/{sweep['members'][0]['id']}")
    rows = until(
        "the member's config",
        lambda: dict(
            page.execute_script(
                "return Array.from(document.querySelectorAll('#config tbody tr'))"
                ".map((r) => Array.from(r.cells).map((c) => c.textContent));"
            )
        ),
    )
    assert rows["task.params.dbs"] == f'[{{"name": "a", "password": "{MASK}"}}]'
    assert rows["trackers.mlflow.uri"] == f"https://{MASK}@ml.example"
    assert rows["train.max_tokens"] == "512"  # a count, not a secret
    script = page.find_element("id", "script").text
    assert script.startswith(f"script: t.py --api-key {MASK} -k {MASK} -k{MASK}"), script
    assert PLANTED not in _seen(page)
    _open(page, board, f"/compare?sweep={sweep['id']}")
    until(
        "both members on the compare page",
        lambda: len(texts(page, "#compare-runs tbody tr")) == 2,
    )
    assert PLANTED not in _seen(page)


def test_smoothing_the_log_scale_and_the_wall_time_axis_change_the_chart(real_runs, board, page):
    _ready(real_runs, board)
    member = real_runs.members()["0.003"]
    _open(page, board, f"/run/{_ids(board)[_member_names(real_runs)['0.003']]}")
    rows = rundir.read_jsonl(rundir.RunPaths(member).metrics)
    steps = sorted({r["step"] for r in rows if "train/loss" in r})
    loss = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    when = {r["step"]: r["time"] for r in rows if "time" in r}  # a step's last row's
    raw = until(
        "the loss chart",
        lambda: (d := _data(page, "chart-loss")) and len(d[0]["y"]) == len(steps) and d[0],
    )
    assert raw["x"] == steps and raw["y"] == [loss[s] for s in steps]
    page.execute_script(
        "const s = document.getElementById('smoothing'); s.value = '0.6';"
        "s.dispatchEvent(new Event('input'));"
    )
    expected, last = [], 0.0  # TensorBoard's debiased exponential moving average
    for i, s in enumerate(steps, 1):
        last = last * 0.6 + 0.4 * loss[s]
        expected.append(last / (1 - 0.6**i))
    smooth = until(
        "the smoothed loss",
        lambda: (d := _data(page, "chart-loss")) and d[0]["y"] != raw["y"] and d[0],
    )
    assert smooth["y"] == pytest.approx(expected, rel=1e-9)
    page.find_element("id", "logy").click()
    until("a log y axis", lambda: _layout(page, "chart-loss")["yaxis"].get("type") == "log")
    page.execute_script(
        "const s = document.getElementById('x-axis'); s.value = 'wall';"
        "s.dispatchEvent(new Event('change'));"
    )
    until("a date x axis", lambda: _layout(page, "chart-loss")["xaxis"].get("type") == "date")
    xs = page.execute_script(
        "return document.getElementById('chart-loss').data[0].x"
        ".map((d) => new Date(d).getTime() / 1000);"
    )
    assert xs == pytest.approx([when[s] for s in steps], abs=1e-3)
    # Kept for this browser: the next page opens with the same options.
    page.refresh()
    until("the options kept", lambda: _layout(page, "chart-loss")["xaxis"].get("type") == "date")
    assert page.find_element("id", "logy").is_selected()
    assert page.find_element("id", "smoothing").get_attribute("value") == "0.6"
    # The efficiency of the run's one rank (its heartbeats, logged at its log steps).
    assert until("the CPU chart", lambda: _data(page, "chart-cpu"))[-1]["name"] == "mean of 1"


def _downloads(page):
    """Record what the page hands the browser to save (URL.createObjectURL's blobs)."""
    page.execute_script(
        "window.saved = [];"
        "const make = URL.createObjectURL;"
        "URL.createObjectURL = (b) => { window.saved.push(b); return make(b); };"
        "HTMLAnchorElement.prototype.click = function () { window.savedAs = this.download; };"
    )


def _blob(page, i, how):
    return page.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"window.saved[{i}].{how}().then((v) => done(typeof v === 'string' ? v"
        " : Array.from(new Uint8Array(v).slice(0, 8))));"
    )


def test_the_csv_download_holds_the_plotted_points_and_the_png_is_a_png(real_runs, board, page):
    _ready(real_runs, board)
    _open(page, board, f"/run/{_ids(board)[_member_names(real_runs)['0.03']]}")
    plotted = until("the loss chart", lambda: (d := _data(page, "chart-loss")) and d[0])
    _downloads(page)
    page.execute_script("document.querySelector('#chart-loss .chart-tools .csv').click();")
    until("the CSV", lambda: page.execute_script("return window.saved.length;") == 1)
    rows = list(csv.DictReader(io.StringIO(_blob(page, 0, "text"))))
    assert page.execute_script("return window.savedAs;") == "loss.csv"
    assert [float(r["x"]) for r in rows] == plotted["x"]
    assert [float(r["y"]) for r in rows] == plotted["y"]
    assert {r["series"] for r in rows} == {"loss"} and [int(r["step"]) for r in rows] == plotted[
        "x"
    ]
    page.execute_script("document.querySelector('#chart-loss .chart-tools .png').click();")
    # Plotly makes an SVG on its way (a blob of its own): the one saved is the last.
    until("the PNG", lambda: page.execute_script("return window.savedAs;") == "loss.png")
    last = page.execute_script("return window.saved.length - 1;")
    assert _blob(page, last, "arrayBuffer") == [137, 80, 78, 71, 13, 10, 26, 10]  # PNG's magic


def test_a_marked_run_that_fails_raises_a_notification(real_runs, board, page):
    name = os.path.relpath(real_runs.failing, os.path.dirname(real_runs.root))
    run_id = until("the failing run listed", lambda: _ids(board).get(name))
    until(
        "the failing run training",
        lambda: (
            rundir.read_object(rundir.RunPaths(real_runs.failing).status)[0].get("state")
            == "running"
        ),
    )
    _open(page, board, "/")
    page.execute_script(
        "window.told = [];"
        "window.Notification = class { constructor(title, o) { window.told.push([title, o.body]); }"
        "  static requestPermission() { return Promise.resolve('granted'); } };"
        "window.Notification.permission = 'granted';"
    )
    until(
        "the run's row running",
        lambda: (
            page.find_element("css selector", f"#run-{run_id}").get_attribute("data-state")
            == "running"
        ),
    )
    _click(page, "the run's bell", f"#run-{run_id} button.bell")
    assert (
        page.find_element("css selector", f"#run-{run_id} button.bell").get_attribute(
            "aria-pressed"
        )
        == "true"
    )
    open(real_runs.fail_file, "w").close()
    told = until("a notification", lambda: page.execute_script("return window.told;"), timeout=180)
    (title, body), *_ = told
    assert title == f"{name} failed" and "failing on purpose" in body, told
    assert real_runs.procs[1].wait(timeout=120) != 0


def test_names_config_values_and_log_lines_are_text_not_html(real_runs, board, page):
    name = os.path.relpath(real_runs.failing, os.path.dirname(real_runs.root))
    run_id = until("the failing run listed", lambda: _ids(board).get(name))
    members = _ids(board)
    for path in (
        "/",
        f"/run/{run_id}",
        f"/compare?runs={run_id},{members[_member_names(real_runs)['0.001']]}",
    ):
        _open(page, board, path)
        until(
            f"{path}: the run's name on the page",
            lambda: HTML in page.execute_script("return document.body.textContent;"),
        )
        if path.startswith("/run/"):
            open(real_runs.fail_file, "w").close()  # a log line of HTML: the run's error
            until(
                "the error in the log",
                lambda: f"fail-now {HTML} appeared" in page.find_element("id", "log").text,
                timeout=180,
            )
            assert (
                until(
                    "the config",
                    lambda: dict(
                        page.execute_script(
                            "return Array.from(document.querySelectorAll('#config tbody tr'))"
                            ".map((r) => Array.from(r.cells).map((c) => c.textContent));"
                        )
                    ).get("run.name"),
                )
                == f"run {HTML}"
            )
        if path.startswith("/compare"):
            until(
                "the legend",
                lambda: any(HTML in t for t in texts(page, "#compare-runs tbody tr td:last-child")),
            )
        assert (
            page.execute_script("return document.querySelectorAll('img[src=\"x\"]').length;") == 0
        ), path
        assert page.execute_script("return window.xss === undefined;"), path


# Text that HTML or Plotly's pseudo-HTML (its labels take <a href>, <b>, <br>) would make into
# elements: a link out, bold, an image whose error runs script.
LINK = '<a href="https://evil.example/">a link</a>'
BOLD = "<b>bold</b><br>"


# In the xdist group of the module's other page tests (conftest._group), so the one browser and
# the real runs are started once, not again in a group of its own.
@pytest.mark.usefixtures("board")
def test_a_sweeps_hostile_values_names_and_tags_are_text_on_the_compare_page(page, tmp_path):
    """A sweep (its records only) whose swept values, member names and metric tag are HTML:
    its compare page plots them (a value that is no number is a category of the axis) and no
    element is made of them, in the tables or in Plotly's labels."""
    members = make_sweep(tmp_path / "runs" / "sw", {"m1": HTML, HTML: LINK, "m3": BOLD})
    for i, paths in enumerate(members.values()):
        for step in (11, 12):
            add_metrics(paths, step, **{f"eval/{LINK}{BOLD}": 0.1 * i + 0.01 * step})
    board = Dashboard([tmp_path / "runs"], str(tmp_path))
    try:
        sweep = until(
            "the sweep listed",
            lambda: json.loads(get(f"{board.base}/api/runs?token={board.token}")[1])["sweeps"],
        )[0]
        _open(page, board, f"/compare?sweep={sweep['id']}")
        until(
            "the members' values as text",
            lambda: all(
                v in page.execute_script("return document.body.textContent;")
                for v in (HTML, f"sw/{HTML}")
            ),
        )
        page.execute_script(
            "const s = document.getElementById('sweep-metric'); s.value = arguments[0];"
            "s.dispatchEvent(new Event('change'));",
            f"eval/{LINK}{BOLD}",
        )
        plotted = until(
            "the tag's final value of 3 members by train.lr",
            lambda: (d := _data(page, "chart-sweep-train_lr")) and len(d[0]["x"]) == 3 and d[0],
        )
        by_value = dict(zip(plotted["x"], plotted["y"]))
        assert sorted(by_value.values()) == pytest.approx([0.12, 0.22, 0.32], abs=1e-9)
        until("the parallel coordinates", lambda: (d := _data(page, "chart-parallel")) and d)
        made = page.execute_script(
            "const all = Array.from(document.querySelectorAll('*'));"
            "return {img: document.querySelectorAll('img[src=\"x\"]').length,"
            " links: all.filter((n) => ((n.getAttribute('href') || '')"
            "   + (n.getAttribute('xlink:href') || '')).includes('evil')).length,"
            " bold: Array.from(document.querySelectorAll('.chart tspan'))"
            "   .filter((n) => /bold/.test(n.getAttribute('style') || '')).length,"
            " b: document.querySelectorAll('b').length, xss: window.xss === undefined};"
        )
        assert made == {"img": 0, "links": 0, "bold": 0, "b": 0, "xss": True}, made
    finally:
        board.close()


def test_root_path_token_file_and_the_list_of_dashboards(real_runs, board, page, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("a-token-of-my-own-0123456789\n")
    os.chmod(token_file, 0o644)
    env = {**ENV, "XDG_STATE_HOME": board.state}
    refused = run_cli(
        "clusterflow.dashboard", real_runs.root, "--token-file", str(token_file), env=env
    )
    assert refused.returncode == 2 and "readable by others (mode 644)" in refused.stderr
    assert "a-token-of-my-own" not in refused.stderr + refused.stdout
    os.chmod(token_file, 0o600)
    prefixed = Dashboard(
        [real_runs.root],
        str(tmp_path),
        "--root-path",
        "/node/gpu1/8765/",
        "--token-file",
        str(token_file),
        env=env,
    )
    try:
        assert (
            prefixed.root == "/node/gpu1/8765" and prefixed.token == "a-token-of-my-own-0123456789"
        )
        listed = run_cli("clusterflow.dashboard", "--list", env=env)
        assert (
            listed.returncode == 0 and board.url in listed.stdout and prefixed.url in listed.stdout
        )
        assert (
            stat.S_IMODE(os.stat(os.path.join(board.state, "clusterflow", "dashboards")).st_mode)
            == 0o700
        )
        for base in (
            f"{prefixed.base}/node/gpu1/8765",
            prefixed.base,
        ):  # a proxy that strips it, or not
            code, said, _ = get(f"{base}/api/runs")
            assert code == 403, said
            code, body, _ = get(f"{base}/api/runs?token={prefixed.token}")
            assert code == 200 and json.loads(body)["runs"], body
        page.get(prefixed.url)
        until("the runs through the prefix", lambda: len(texts(page, "#runs tbody tr")) >= 1)
        links = page.execute_script(
            "return Array.from(document.querySelectorAll('a')).map((a) => a.getAttribute('href'));"
        )
        assert links and all(h.startswith("/node/gpu1/8765/") for h in links), links
        scripts = page.execute_script(
            "return Array.from(document.scripts).map((s) => s.getAttribute('src'));"
        )
        assert all(re.match(r"^/node/gpu1/8765/static/", s) for s in scripts), scripts
    finally:
        prefixed.close()
    listed = run_cli("clusterflow.dashboard", "--list", env=env)
    assert prefixed.url not in listed.stdout and board.url in listed.stdout  # gone with it
    assert len(os.listdir(os.path.join(board.state, "clusterflow", "dashboards"))) == 1
