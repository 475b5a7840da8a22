"""Helpers of the dashboard tests: run dirs made from records, a dashboard served in a thread of
the test (with NVML replaced at its boundary) or as the command a user types, plain HTTP
requests, and a headless Debian chromium driven by Selenium."""

import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from conftest import REPO

from clusterflow import rundir
from clusterflow.web import catalog as web_catalog
from clusterflow.web import server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# How long one command of the browser's driver may take to answer (Selenium's own bound: 120 s).
COMMAND_TIMEOUT_S = 400


def make_run(run_dir, state="running", world=2, step=10, epochs=3, attempts=1, **status):
    """A run dir as a job leaves it: config.yaml, status.json, attempts.jsonl, heartbeats and a
    few metrics rows (records only, as another version or a hand could have written them)."""
    paths = rundir.RunPaths(str(run_dir))
    os.makedirs(paths.heartbeats, exist_ok=True)
    os.makedirs(paths.logs, exist_ok=True)
    with open(paths.config, "w") as f:
        f.write(f"run: {{dir: {run_dir}}}\ntrain: {{epochs: {epochs}}}\ncluster: {{}}\n")
    now = time.time()
    with open(paths.status, "w") as f:
        json.dump(
            {
                "state": state,
                "epoch": 1,
                "global_step": step,
                "step_in_epoch": step % 6,
                "steps_per_epoch": 6,
                "world_size": world,
                "updated_at": now,
                "last_loss": 0.5,
                **status,
            },
            f,
        )
    for a in range(attempts):
        rundir.append_jsonl(
            paths.attempts,
            {
                "attempt": a,
                "started_at": now - 100 + a,
                "job_id": str(4000 + a),
                "source": "local",
                "world_size": world,
                "hosts": ["node1"],
            },
        )
    for r in range(world):
        with open(paths.heartbeat_file(r), "w") as f:
            json.dump(
                {
                    "rank": r,
                    "host": "node1",
                    "pid": 10_000 + r,
                    "time": now,
                    "step": step,
                    "phase": "train",
                    "progress_at": now,
                    "step_time_s": 0.1,
                    "busy_s": 0.08,
                    "heartbeat_s": 10.0,
                },
                f,
            )
    for s in range(1, step + 1):
        add_metrics(paths, s, **{"train/loss": 1.0 / s, "train/lr": 0.1})
    return paths


def add_metrics(paths, step, **values):
    rundir.append_jsonl(paths.metrics, {"step": step, "attempt": 0, **values})


def make_sweep(sweep_dir, members):
    """A sweep dir: sweep.json over train.lr, and a run dir per member name in ``members``
    (``{name: lr}``); returns the members' RunPaths."""
    os.makedirs(sweep_dir, exist_ok=True)
    index = {
        "version": 1,
        "keys": ["train.lr"],
        "base": {},
        "members": [
            {"name": n, "values": {"train.lr": lr}, "overrides": [f"train.lr={lr}"]}
            for n, lr in members.items()
        ],
        "submissions": [],
    }
    with open(os.path.join(sweep_dir, "sweep.json"), "w") as f:
        json.dump(index, f)
    return {n: make_run(os.path.join(sweep_dir, n), state="completed") for n in members}


# Every secret make_secret_sweep plants holds this, in each of its parts (a URL's password with
# / and @ too), so any trace of one on a page, an answer or a stream is found by it.
PLANTED = "s3cr3t"


def make_secret_sweep(sweep_dir):
    """A sweep dir (records only) over a script's ``--api-key``, ``-k``, a tracker's key and a URL
    with a password, its members named as ``submit --sweep`` names them, each member's config
    holding a secret in every form the masking rule knows (a flag's value starting with -, a
    flag and its value in one word, ``-k``, ``--auth``, ``DB_PASS=``, ``*_PWD=``, an
    Authorization header, JSON text, a mapping inside a list, ``credentials``) and a
    ``max_tokens`` that is no secret; returns the members' RunPaths by name."""
    from clusterflow.sweeps import sweep

    keys = ["arg:--api-key", "arg:-k", "trackers.wandb.api_key", "trackers.mlflow.uri"]
    members = {}
    for i in (1, 2):
        values = {
            "arg:--api-key": f"-{PLANTED}-api{i}",
            "arg:-k": f"{PLANTED}-k{i}",
            "trackers.wandb.api_key": f"{PLANTED}-wandb{i}",
            "trackers.mlflow.uri": f"https://u{PLANTED}:{PLANTED}/{i}@{PLANTED}@ml.example",
        }
        members[sweep.member_name(values, "f" * 64)] = values
    os.makedirs(sweep_dir, exist_ok=True)
    with open(os.path.join(sweep_dir, "sweep.json"), "w") as f:
        index = {
            "version": 1,
            "keys": keys,
            "base": {},
            "members": [
                {"name": n, "values": v, "overrides": [f"{k}={v[k]}" for k in keys]}
                for n, v in members.items()
            ],
            "submissions": [],
        }
        json.dump(index, f)
    out = {}
    for name, values in members.items():
        paths = make_run(os.path.join(sweep_dir, name), state="completed")
        config = {
            "run": {"dir": paths.root},
            "train": {"epochs": 3, "max_tokens": 512},
            "cluster": {
                "setup": [
                    f"export DB_PASS={PLANTED}-env",
                    f"export SVC_PWD={PLANTED}-pwd",
                    f"curl -H 'Authorization: Bearer {PLANTED}-bearer' https://x",
                ]
            },
            "trackers": {
                "wandb": {"api_key": values["trackers.wandb.api_key"], "project": "p"},
                "mlflow": {"uri": values["trackers.mlflow.uri"]},
            },
            "task": {
                "params": {
                    "dbs": [{"name": "a", "password": f"{PLANTED}-list"}],
                    "service": json.dumps({"user": "u", "password": f"{PLANTED}-json"}),
                    "credentials": {"user": "u", "secret": f"{PLANTED}-cred"},
                }
            },
            "script": {
                "path": "t.py",
                "args": [
                    "--api-key",
                    values["arg:--api-key"],
                    "-k",
                    values["arg:-k"],
                    f"-k{PLANTED}-joined",
                    f"--token={PLANTED}-eq",
                    "--auth",
                    f"{PLANTED}-auth",
                    f"DB_PASS={PLANTED}-arg",
                    json.dumps({"password": f"{PLANTED}-argjson"}),
                    "--max-tokens",
                    "512",
                ],
            },
        }
        with open(paths.config, "w") as f:
            json.dump(config, f)  # JSON is YAML
        out[name] = paths
    return out


def poll_until(catalog, predicate, timeout=30.0):
    """Poll a catalog (as its thread would) until ``predicate()`` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        catalog.poll()
        if predicate():
            return True
        time.sleep(0.05)
    return False


class Served:
    """A dashboard app served by uvicorn in a thread of this process (``url``, ``token``)."""

    def __init__(self, paths, snapshot=lambda: None):
        import uvicorn

        self.catalog = web_catalog.Catalog([str(p) for p in paths], snapshot)
        self.token = "test-token-" + os.urandom(6).hex()
        sock = server._bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app, self.dashboard = server.build_app(self.catalog, self.token)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=1
            )
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def close(self):
        self.dashboard.stop_streams()  # no signal reaches a server in a thread
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def served(paths, snapshot=lambda: None):
    s = Served(paths, snapshot)
    try:
        yield s
    finally:
        s.close()


def get(url, headers=None, data=None, method=None):
    """(status, body text, headers by their names in lower case) of one request; never raises
    for an HTTP status."""
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode("utf-8", "replace"), _lower(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace"), _lower(e.headers)


def _lower(headers):
    return {k.lower(): v for k, v in headers.items()}


def raw_get(port, path, host=None):
    """A GET with the path sent exactly as given (a browser or urllib would resolve ``..``), and
    ``host`` as its Host header (by default 127.0.0.1:PORT)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host or f"127.0.0.1:{port}")
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def sse_events(url, wanted, timeout=30.0):
    """The first events of a server-sent stream until ``wanted(events)`` holds:
    [(event, data), ...]."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    events, name, data = [], None, []
    deadline = time.monotonic() + timeout
    try:
        conn.request("GET", parsed.path + "?" + parsed.query)
        r = conn.getresponse()
        assert r.status == 200, r.status
        while time.monotonic() < deadline:
            line = r.fp.readline().decode("utf-8").rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and name is not None:
                events.append((name, json.loads("\n".join(data))))
                name, data = None, []
                if wanted(events):
                    return events
    finally:
        conn.close()
    raise AssertionError(f"the stream did not deliver in {timeout} s: {[e for e, _ in events]}")


class Dashboard:
    """``python -m clusterflow.dashboard PATHS`` as a user starts it; ``url`` is what it
    printed."""

    def __init__(self, paths, log_dir, *args, env=None):
        self.log = open(os.path.join(log_dir, "dashboard.err"), "a")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clusterflow.dashboard", *map(str, paths), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.line = self.proc.stdout.readline().strip()
        assert self.line.startswith("clusterflow dashboard: http://127.0.0.1:"), self.line
        self.url = self.line.split(": ", 1)[1]
        parsed = urllib.parse.urlsplit(self.url)
        self.port = parsed.port
        self.root = parsed.path.rstrip("/")  # --root-path
        self.base = f"http://127.0.0.1:{self.port}"
        self.token = urllib.parse.parse_qs(parsed.query)["token"][0]

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def browser(width=1400, height=1000):
    """Debian's chromium, headless, through Debian's chromedriver (Selenium never downloads a
    browser or a driver here)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="cf-chromium-")
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    # An answer may take minutes where four test workers share two cores with a browser that
    # draws live charts.
    driver.command_executor.client_config.timeout = COMMAND_TIMEOUT_S
    driver.profile_dir = profile
    return driver


def close_browser(driver):
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)


def have_browser():
    return os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
