"""The dashboard without a browser: which runs it finds, the readers it follows files with, its
guard (token, paths), its one action, what its pages leave out, hostile run dirs, and the GPUs
with NVML replaced at its boundary. tests/test_dashboard_browser.py drives it in chromium."""

import json
import os
import socket
import time

import pytest
from conftest import DEEP_LISTS, billion_laughs
from dashboards import (
    PLANTED,
    add_metrics,
    get,
    make_run,
    make_secret_sweep,
    make_sweep,
    poll_until,
    raw_get,
    served,
    sse_events,
)

from clusterflow import rundir
from clusterflow.config.masking import MASK
from clusterflow.errors import UserError
from clusterflow.manage import logs, status
from clusterflow.rundir import records
from clusterflow.slurm import commands
from clusterflow.web import catalog as web_catalog
from clusterflow.web import discover, guard, server, views
from clusterflow.web.feeds import LogFeed, MetricFeed

# -- finding runs ---------------------------------------------------------------------------------


def test_runs_and_sweeps_are_found_below_the_paths_and_new_ones_while_it_runs(tmp_path):
    make_run(tmp_path / "runs" / "a")
    make_run(tmp_path / "runs" / "deep" / "er" / "b")
    make_sweep(tmp_path / "runs" / "sw", {"lr=0.1": 0.1, "lr=0.2": 0.2})
    os.makedirs(tmp_path / "runs" / ".hidden")
    make_run(tmp_path / "runs" / ".hidden" / "c")
    finder = discover.Finder([str(tmp_path / "runs")])
    found = finder.scan()
    names = {f.name: f.kind for f in found.values()}
    assert names == {
        "runs/a": "run",
        "runs/deep/er/b": "run",
        "runs/sw": "sweep",
        "runs/sw/lr=0.1": "run",
        "runs/sw/lr=0.2": "run",
    }
    members = [f for f in found.values() if f.sweep]
    assert {f.sweep for f in members} == {str(tmp_path / "runs" / "sw")}
    make_run(tmp_path / "runs" / "deep" / "new")
    assert "runs/deep/new" in {f.name for f in finder.scan().values()}


def test_nothing_outside_the_paths_is_taken(tmp_path):
    outside = make_run(tmp_path / "elsewhere" / "secret").root
    runs = tmp_path / "runs"
    make_run(runs / "a")
    os.symlink(outside, runs / "link-to-outside")
    sweep = runs / "sw"
    make_sweep(sweep, {"ok": 0.1})
    index = json.loads((sweep / "sweep.json").read_text())
    index["members"].append({"name": "../../elsewhere/secret", "values": {"train.lr": 1}})
    (sweep / "sweep.json").write_text(json.dumps(index))
    found = discover.Finder([str(runs)]).scan()
    roots = {f.root for f in found.values()}
    assert not any(r.startswith(str(tmp_path / "elsewhere")) for r in roots), roots
    # An index with a member that leads out of its sweep is damaged (no name clusterflow writes
    # holds a "/"): the sweep is listed, to say so on its row, and none of its members is taken.
    assert {f.name for f in found.values()} == {"runs/a", "runs/sw"}


def test_a_path_that_is_missing_or_a_file_is_refused_in_one_line(tmp_path, cli):
    out = cli("clusterflow.dashboard", str(tmp_path / "nope"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "does not exist; pass a run dir, a sweep dir or a folder" in out.stderr
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        discover.check_paths([str(tmp_path / "f")])


def test_a_token_file_that_is_a_fifo_is_refused_before_it_is_opened(tmp_path, cli):
    """Opened for reading, a FIFO waits for a writer: the command would hang before printing
    anything. It says what the file is, in one line, at once."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)
    os.symlink(fifo, tmp_path / "link")  # the token file a link leads to: the same
    for given in (fifo, tmp_path / "link"):
        out = cli("clusterflow.dashboard", str(tmp_path), "--token-file", str(given), timeout=120)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr == (
            f"error: --token-file {str(given)!r} is a FIFO (named pipe), not a regular file; give "
            "a file holding the token\n"
        )


@pytest.mark.parametrize("given", ["/a/%2e%2e/b", "%2E%2e/", "/node/%252e%252E", "/a%2f..%2fb"])
def test_a_root_path_that_steps_up_when_decoded_is_refused(given):
    with pytest.raises(UserError) as refused:
        server.root_path(given)
    said = str(refused.value)
    assert said.startswith(f"--root-path {given!r} holds the segment ") and "\n" not in said
    assert "percent-decoded), which steps out of the path" in said, said
    assert server.root_path("/node/gpu1/8765/") == "/node/gpu1/8765"


# -- the readers that follow files ----------------------------------------------------------------


def test_json_lines_are_followed_from_an_offset_through_cuts_garbage_and_replacement(tmp_path):
    target = str(tmp_path / "m.jsonl")
    follow = records.JsonLinesFollower(target, chunk_bytes=64)
    assert follow.read() == ([], False)  # not there yet
    with open(target, "wb") as f:
        f.write(b'{"step": 1}\n{"step": 2')
    assert follow.read() == ([{"step": 1}], False)  # the cut line waits for its newline
    with open(target, "ab") as f:
        f.write(b"}\n\xff\xfe garbage\n[1, 2]\n" + b"[" * 100_000 + b"\n" + b'{"step": 3}\n')
    got = []
    while True:
        got += follow.read()[0]
        if not follow.behind:
            break
    assert got == [{"step": 2}, {"step": 3}]
    assert follow.damaged == 3  # garbage bytes, a list, a line nested too deep
    with open(str(tmp_path / "new"), "wb") as f:
        f.write(b'{"step": 9}\n')
    os.replace(str(tmp_path / "new"), target)
    assert follow.read() == ([{"step": 9}], True)


def test_a_line_over_the_limit_is_skipped_without_being_held(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1000)
    target = str(tmp_path / "m.jsonl")
    with open(target, "wb") as f:
        f.write(b'{"step": 1}\n{"x": "' + b"a" * 5000 + b'"}\n{"step": 2}\n')
    assert records.read_jsonl(target) == [{"step": 1}, {"step": 2}]
    follow = records.JsonLinesFollower(target, chunk_bytes=300)
    got = []
    for _ in range(100):
        got += follow.read()[0]
        assert len(follow.partial) <= 1000
    assert got == [{"step": 1}, {"step": 2}] and follow.damaged == 1


def test_a_2_gb_log_costs_a_seek_not_its_size(tmp_path):
    paths = make_run(tmp_path / "run")
    log = paths.log_file(0, 0)
    with open(log, "wb") as f:
        f.truncate(2 * 2**30)  # sparse: 2 GB without writing them
        f.seek(0, os.SEEK_END)
        f.write(b"partial line\nthe last line\n")
    tail = logs.Tail(log)
    text = tail.read(limit=64 * 1024)
    assert text == "the last line\n"  # from the first line that starts within the limit
    assert tail.skipped >= 2 * 2**30 - 64 * 1024
    with open(log, "ab") as f:
        f.write("épreuve ✓\n".encode())
    assert tail.read(limit=64 * 1024) == "épreuve ✓\n"
    feed = LogFeed(paths, 0, keep_bytes=4096)
    assert feed.update()
    shown = "".join(feed.since(-1, 0).items)
    assert shown.startswith("==> ") and shown.endswith("épreuve ✓\n") and len(shown) < 8192


def test_metrics_follow_the_purge_rule_and_stay_within_their_bounds(tmp_path):
    paths = make_run(tmp_path / "run", step=0)
    feed = MetricFeed(paths, max_steps=100, max_tags=3)
    for s in range(1, 11):
        add_metrics(paths, s, **{"train/loss": float(s)})
    feed.update()
    first = feed.since(-1, 0)
    assert first.reset and [s for s, _, _ in first.items] == list(range(1, 11))
    # A new attempt logs again from step 6: what came after 5 is dropped, as TensorBoard does.
    rundir.append_jsonl(paths.metrics, {"step": 6, "attempt": 1, "purge_step": 6})
    add_metrics(paths, 6, **{"train/loss": 60.0, "a": 1, "b": 2, "c": 3})
    feed.update()
    again = feed.since(first.generation, first.version)
    values = {s: v for s, v, _ in again.items}
    assert again.reset and values[6] == {"train/loss": 60.0, "a": 1.0, "b": 2.0}
    assert feed.dropped_tags == 1 and sorted(feed.table) == [1, 2, 3, 4, 5, 6]
    assert values == {s: v for s, v in feed.table.items()}
    # The same rule as the user's reader.
    from clusterflow.observe import scalar_log

    assert {s: v["train/loss"] for s, v in scalar_log.read(paths).items()} == {
        **{s: float(s) for s in range(1, 6)},
        6: 60.0,
    }
    add_metrics(paths, 7, **{"train/loss": float("nan")})
    feed.update()
    tail = feed.since(again.generation, again.version)
    assert not tail.reset and tail.items == [[7, {"train/loss": None}, None]]  # no time given
    rundir.append_jsonl(paths.metrics, {"step": 8, "attempt": 1, "time": 1234.5, "a": 1.0})
    feed.update()
    assert feed.since(tail.generation, tail.version).items == [[8, {"a": 1.0}, 1234.5]]
    for s in range(8, 400):
        add_metrics(paths, s, **{"train/loss": float(s)})
    feed.update()
    assert len(feed.table) <= 100 and max(feed.table) == 399


def test_an_attempts_purge_at_a_step_without_values_adds_no_step(tmp_path):
    """An own loop's metrics.jsonl: each attempt starts with its purge marker at a step it logs
    nothing at (its first values come at train.log_every_steps); a stream is sent the steps
    with values only, before and after the next attempt's purge."""
    paths = make_run(tmp_path / "run", step=0)
    rundir.append_jsonl(paths.metrics, {"step": 0, "attempt": 0, "purge_step": 0})
    for s in (5, 10):
        add_metrics(paths, s, **{"train/loss": 1.0 / s})
    feed = MetricFeed(paths)
    feed.update()
    first = feed.since(-1, 0)
    assert first.items == [[5, {"train/loss": 0.2}, None], [10, {"train/loss": 0.1}, None]]
    rundir.append_jsonl(paths.metrics, {"step": 7, "attempt": 1, "purge_step": 7})
    feed.update()
    again = feed.since(first.generation, first.version)
    assert again.reset and again.items == [[5, {"train/loss": 0.2}, None]]
    rundir.append_jsonl(paths.metrics, {"step": 12, "attempt": 1, "purge_step": 12})  # nothing
    add_metrics(paths, 12, **{"train/loss": 0.05})
    feed.update()
    last = feed.since(again.generation, again.version)
    assert not last.reset and last.items == [[12, {"train/loss": 0.05}, None]]


def test_read_metrics_passes_over_rows_that_are_no_metrics_rows(tmp_path):
    from clusterflow.observe.metrics import read_metrics

    paths = make_run(tmp_path / "run", step=2)
    with open(paths.metrics, "a") as f:
        f.write('{"step": "abc", "train/loss": 1}\n{"attempt": 1}\n{"purge_step": "x"}\n')
        f.write('{"step": true, "a": 1}\n{"step": 3, "train/loss": "high", "ok": 1}\n')
    assert read_metrics(paths.root) == {
        1: {"train/loss": 1.0, "train/lr": 0.1},
        2: {"train/loss": 0.5, "train/lr": 0.1},
        3: {"ok": 1.0},
    }


# -- status's readers on hostile records ----------------------------------------------------------


def test_a_record_too_large_to_be_one_is_named_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 10_000)
    paths = make_run(tmp_path / "run")
    with open(paths.status, "w") as f:
        f.write('{"state": "running", "pad": "' + "x" * 20_000 + '"}')
    with open(paths.attempts, "a") as f:
        f.write("x" * 20_000 + "\n")
    s = status.collect(paths)
    said = " ".join(s["damaged_records"])
    assert "status.json is 0 MiB, more than a record holds" in said
    assert "attempts.jsonl is 0 MiB, more than a record holds" in said


# -- the server: the guard ------------------------------------------------------------------------


@pytest.fixture
def two_runs(tmp_path):
    make_run(tmp_path / "runs" / "a")
    make_run(tmp_path / "runs" / "b", state="completed")
    return tmp_path / "runs"


def test_all_data_needs_the_token_and_paths_outside_are_404(two_runs, tmp_path):
    """Every request for data needs the token (header or ?token=); the pages are shells that
    hold no data, need none, and set no cookie (a cookie reaches every port of the host); every
    response carries the security headers; a Host that is not this machine's name is refused."""
    (tmp_path / "secret.txt").write_text("not for you")
    make_sweep(two_runs / "sw", {"lr=0.1": 0.1, "lr=0.2": 0.2})
    with served([two_runs]) as s:
        assert poll_until(s.catalog, lambda: len(s.catalog.runs) == 4 and s.catalog.sweeps)
        # Every route of the app is one this test asks for below: a new one must join it.
        routes = {(r.path, tuple(sorted(r.methods))) for r in s.app.app.app.routes}
        assert routes == {
            *((p, ("GET", "HEAD")) for p in ("/", "/run/{run_id}", "/compare", "/static/{name}")),
            *((p, ("GET", "HEAD")) for p in ("/api/runs", "/api/run/{run_id}", "/api/compare")),
            ("/api/stream", ("GET", "HEAD")),
            ("/api/cancel", ("POST",)),
        }, routes
        run_id = next(r.id for r in s.catalog.runs.values() if r.name == "runs/a")
        sweep_id = next(iter(s.catalog.sweeps))
        both = ",".join(s.catalog.runs)
        data = (
            "/api/runs",
            f"/api/run/{run_id}",
            "/api/stream",
            f"/api/stream?run={run_id}",
            f"/api/compare?runs={both}",
            f"/api/compare?sweep={sweep_id}",
            f"/api/stream?compare={both}",
            f"/api/stream?sweep={sweep_id}",
            "/api/cancel",  # a GET: refused for its token before its method
        )
        for path in data:
            code, body, _ = get(s.url + path)
            assert code == 403 and "needs its token" in body, path
            code, _, _ = get(s.url + path + ("&" if "?" in path else "?") + "token=wrong")
            assert code == 403, path
        code, body, headers = get(f"{s.url}/api/runs", headers={"x-clusterflow-token": s.token})
        assert code == 200 and "runs/a" in body
        code, body, _ = get(f"{s.url}/api/runs?token={s.token}")
        assert code == 200 and "runs/a" in body
        for path in (
            "/",
            f"/run/{run_id}",
            f"/compare?runs={both}",
            f"/compare?sweep={sweep_id}",
            "/static/dashboard.js",
            "/static/charts.js",
            "/static/compare.js",
            f"/?token={s.token}",
        ):
            code, body, headers = get(s.url + path)
            assert code == 200 and "runs/a" not in body and s.token not in body, path
            assert "set-cookie" not in headers, path
            assert (
                headers["referrer-policy"] == "no-referrer" and headers["x-frame-options"] == "DENY"
            )
            assert "script-src 'self'" in headers["content-security-policy"], path
            assert "frame-ancestors 'none'" in headers["content-security-policy"], path
        code, _, headers = get(s.url + "/api/runs")
        assert code == 403 and headers["referrer-policy"] == "no-referrer"
        token = f"token={s.token}"
        for path in (
            f"/static/../../secret.txt?{token}",
            f"/static/..%2F..%2Fsecret.txt?{token}",
            f"/static/%2e%2e/pyproject.toml?{token}",
            f"/run/..?{token}",
            f"/run/../../etc/passwd?{token}",
            "/run/not-a-run-id",
            f"/api/run/{'..%2F' * 8}etc%2Fpasswd?{token}",
            f"/api/stream?run=../a&{token}",
            f"/api/stream?sweep=..%2F..&{token}",
            f"/api/stream?sweep={run_id}&{token}",  # a run's id is no sweep's
            f"/api/stream?sweep={'0' * 12}&{token}",
            f"/{tmp_path}/secret.txt?{token}",
        ):
            code, body = raw_get(s.port, path)
            assert code == 404 and "not for you" not in body, (path, code)
        # A compare page names runs by id only: paths, .. and unknown ids are no run of it.
        for given in (f"../secret.txt,{tmp_path}", f"{'..%2F' * 6}etc,{'0' * 12}", "x" * 5000):
            code, body = raw_get(s.port, f"/api/compare?runs={given}&{token}")
            assert code == 200 and json.loads(body)["runs"] == [], given
        code, body = raw_get(s.port, f"/api/compare?runs={both},../x,{both}&{token}")
        assert sorted(r["id"] for r in json.loads(body)["runs"]) == sorted(s.catalog.runs)
        for given in ("..%2F..%2Fsw", str(tmp_path), run_id, "0" * 12):  # no sweep of it
            code, body = raw_get(s.port, f"/api/compare?sweep={given}&{token}")
            assert code == 200 and json.loads(body)["runs"] == [], given
        # DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends its name.
        for host in ("evil.example", "evil.example:80", f"rebind.attacker.test:{s.port}"):
            for path in ("/", f"/api/runs?{token}"):
                code, body = raw_get(s.port, path, host=host)
                assert code == 400 and "does not answer to the name" in body, (host, path)
                assert "runs/a" not in body
        for host in (f"localhost:{s.port}", "127.0.0.1", f"[::1]:{s.port}", "LOCALHOST."):
            code, body = raw_get(s.port, f"/api/runs?{token}", host=host)
            assert code == 200 and "runs/a" in body, host


def test_the_names_a_dashboard_answers_to_follow_its_host():
    """--host NAME adds NAME; --host 0.0.0.0 adds this machine's names; an IP address is never
    a rebinding (no DNS name in it), so any is taken."""
    local = guard.Hosts("127.0.0.1")
    assert local.allows("localhost:8765") and local.allows("10.1.2.3:8765")
    assert not local.allows(socket.gethostname() + ":8765") or socket.gethostname() == "localhost"
    assert not local.allows("login1.example.org")
    named = guard.Hosts("login1.example.org")
    assert named.allows("login1.example.org:8765") and named.allows("Login1.Example.Org.")
    everywhere = guard.Hosts("0.0.0.0")
    assert everywhere.allows(socket.gethostname()) and everywhere.allows(socket.getfqdn())
    assert not everywhere.allows("evil.example")


def test_cancel_is_a_post_with_the_header_token_and_the_name_typed_back(two_runs):
    with served([two_runs]) as s:
        assert poll_until(s.catalog, lambda: len(s.catalog.runs) == 2)
        run = next(r for r in s.catalog.runs.values() if r.name == "runs/a")
        body = json.dumps({"run": run.id, "confirm": "runs/a"}).encode()
        json_type = {"content-type": "application/json"}
        code, said, _ = get(f"{s.url}/api/cancel?token={s.token}", json_type, body, "POST")
        assert code == 403 and "header" in said  # the query's token is not enough
        header = {**json_type, "x-clusterflow-token": s.token}
        code, _, _ = get(f"{s.url}/api/cancel", header, method="GET")
        assert code == 405
        wrong = json.dumps({"run": run.id, "confirm": "a"}).encode()
        code, said, _ = get(f"{s.url}/api/cancel", header, wrong, "POST")
        assert code == 400 and "confirm with the name 'runs/a'" in said
        assert not os.path.exists(run.paths.cancelled)
        code, said, _ = get(f"{s.url}/api/cancel", header, body, "POST")
        assert code == 200, said
        assert "marked cancelled" in json.loads(said)["lines"][0]
        assert os.path.exists(run.paths.cancelled)


def test_no_environment_or_credentials_on_any_page_and_the_config_masked(tmp_path, monkeypatch):
    """The config is shown (a run's page, the compare page's legend), every secret in it
    masked: by its key, in a URI, in cluster.setup, in a script's arguments; a sweep's values
    (its group on the Runs page, its compare page) and its members' names hold none; nothing of
    the environment. Every page, answer and stream (the Runs page's, a run's, a compare page's,
    a sweep's)."""
    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-0123456789")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "mlflow-pass-9876")
    secrets = ("wandb-key", "mlflow-pass", "hunter2", "hunter3", "alice", "WANDB", PLANTED)
    for name, lr in (("a", 0.1), ("b", 0.3)):
        paths = make_run(tmp_path / "runs" / name)
        text = (
            open(paths.config)
            .read()
            .replace("cluster: {}", f"cluster: {{setup: ['export HF_TOKEN={PLANTED}-hf']}}")
        )
        with open(paths.config, "w") as f:
            f.write(
                text
                + "trackers: {mlflow: {tracking_uri: 'https://alice:hunter2-secret@ml.example'},"
                f" wandb: {{project: p, api_key_hint: hunter3-secret-{name}}}}}\n"
                f"script: {{path: t.py, args: [--token, {PLANTED}-arg, --lr, '{lr}']}}\n"
            )
    members = make_secret_sweep(tmp_path / "runs" / "vault")
    with served([tmp_path / "runs"]) as s:
        assert poll_until(
            s.catalog,
            lambda: len(s.catalog.runs) == 4 and all(r.status for r in s.catalog.runs.values()),
        )
        ids = sorted(i for i, r in s.catalog.runs.items() if not r.found.sweep)
        run_id = ids[0]
        member = next(r.id for r in s.catalog.runs.values() if r.found.sweep)
        (sweep_id,) = s.catalog.sweeps
        bodies = [
            get(f"{s.url}{p}{'&' if '?' in p else '?'}token={s.token}")[1]
            for p in (
                "/",
                f"/run/{run_id}",
                "/api/runs",
                f"/api/run/{run_id}",
                f"/api/compare?runs={','.join(ids)}",
                f"/api/run/{member}",
                f"/api/compare?sweep={sweep_id}",
                f"/compare?sweep={sweep_id}",
            )
        ]
        events = sse_events(
            f"{s.url}/api/stream?run={run_id}&token={s.token}",
            lambda ev: {"summary", "metrics"} <= {e for e, _ in ev},
        )
        shown = json.loads(bodies[3])
        compared = sse_events(
            f"{s.url}/api/stream?compare={','.join(ids)}&token={s.token}",
            lambda ev: {"compare", "metrics"} <= {e for e, _ in ev},
        )
        streams = [
            sse_events(f"{s.url}/api/stream?{q}&token={s.token}", lambda ev, e=e: e in dict(ev))
            for q, e in (
                ("", "runs"),
                (f"run={member}", "summary"),
                (f"sweep={sweep_id}", "compare"),
            )
        ]
        bodies += [json.dumps(events), json.dumps(compared), *map(json.dumps, streams)]
    for text in bodies:
        for secret in secrets:
            assert secret not in text
    config = dict(shown["config"])
    assert config["trackers.mlflow.tracking_uri"] == f"https://{MASK}@ml.example"
    assert config["trackers.wandb.api_key_hint"] == MASK and config["trackers.wandb.project"] == "p"
    assert config["cluster.setup"] == f'["export HF_TOKEN={MASK}"]'
    assert shown["script"]["args"][:2] == ["--token", MASK]
    compare = json.loads(bodies[4])["runs"]
    legend = next(r["legend"] for r in compare if r["name"] == "runs/a")  # differing keys
    assert legend == {
        "trackers.wandb.api_key_hint": MASK,
        "script.args": f'["--token", "{MASK}", "--lr", "0.1"]',
    }
    # The sweep: its values masked on the Runs page and the compare page, its members' config
    # and arguments masked in every form, a count shown.
    (group,) = json.loads(bodies[2])["sweeps"]
    assert sorted(m["member"] for m in group["members"]) == sorted(members)
    assert all(
        m["values"]
        == {
            "arg:--api-key": MASK,
            "arg:-k": MASK,
            "trackers.wandb.api_key": MASK,
            "trackers.mlflow.uri": f"https://{MASK}@ml.example",
        }
        for m in group["members"]
    )
    swept = json.loads(bodies[6])["sweep"]["values"]
    assert {v for by_run in swept.values() for v in by_run.values()} == {
        MASK,
        f"https://{MASK}@ml.example",
    }
    detail = json.loads(bodies[5])
    rows = dict(detail["config"])
    assert rows["task.params.dbs"] == f'[{{"name": "a", "password": "{MASK}"}}]'
    assert rows["task.params.service"] == f'{{"user": "u", "password": "{MASK}"}}'
    assert rows["task.params.credentials.user"] == MASK and rows["train.max_tokens"] == "512"
    assert rows["cluster.setup"] == json.dumps(
        [
            f"export DB_PASS={MASK}",
            f"export SVC_PWD={MASK}",
            f"curl -H 'Authorization: {MASK}' https://x",
        ],
        ensure_ascii=False,
    )
    assert detail["script"]["args"] == [
        "--api-key",
        MASK,
        "-k",
        MASK,
        f"-k{MASK}",
        f"--token={MASK}",
        "--auth",
        MASK,
        f"DB_PASS={MASK}",
        f'{{"password": "{MASK}"}}',
        "--max-tokens",
        "512",
    ]


# -- live: a new record reaches a stream ----------------------------------------------------------


def test_a_new_record_reaches_an_open_stream(two_runs):
    with served([two_runs]) as s:
        assert poll_until(s.catalog, lambda: len(s.catalog.runs) == 2)
        run = next(r for r in s.catalog.runs.values() if r.name == "runs/a")
        # The server's own poll thread does the reading; the test only writes and listens.
        url = f"{s.url}/api/stream?run={run.id}&rank=0&token={s.token}"

        def has_metrics(events):
            return any(e == "metrics" for e, _ in events)

        events = sse_events(url, has_metrics)
        steps = [st for e, d in events if e == "metrics" for st, *_ in d["items"]]
        assert max(steps) == 10
        with open(run.paths.log_file(0, 0), "a") as f:
            f.write("hello from rank 0\n")

        def got_more(events):
            metric_steps = [st for e, d in events if e == "metrics" for st, *_ in d["items"]]
            text = "".join(t for e, d in events if e == "log" for t in d["items"])
            if metric_steps and max(metric_steps) < 11:
                add_metrics(run.paths, 11, **{"train/loss": 0.01})
            return 11 in metric_steps and "hello from rank 0" in text

        sse_events(url, got_more)


def _until(predicate, timeout=30.0):
    """Wait (without polling: the server's own thread does) until ``predicate()`` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_compare_page_follows_its_runs_metrics_and_lets_go_when_closed(two_runs):
    """A compare page gets its runs' new metrics pushed as a run's own page does, yet its runs
    are not watched runs (no goodput ledger, records at the Runs page's pace: 8 compared runs
    cost the server what 8 rows do, plus their metrics); closing it leaves no follower and no
    watcher, and a run's own page still watches its run."""
    with served([two_runs]) as s:
        assert poll_until(
            s.catalog,
            lambda: len(s.catalog.runs) == 2 and all(r.status for r in s.catalog.runs.values()),
        )
        runs = {r.name: r for r in s.catalog.runs.values()}
        a, b = runs["runs/a"], runs["runs/b"]
        url = f"{s.url}/api/stream?compare={a.id},{b.id}&token={s.token}"
        seen = []

        def grew(events):
            steps = {d["run"]: [st for st, *_ in d["items"]] for e, d in events if e == "metrics"}
            if a.id in steps and max(steps[a.id]) < 11:
                # Both runs' metrics came; while the page is open, a new step of one.
                seen.append((a.followers, b.followers, a.watchers, b.watchers))
                add_metrics(a.paths, 11, **{"train/loss": 0.01})
            ours = [d["items"] for e, d in events if e == "metrics" and d["run"] == a.id]
            return b.id in steps and 11 in [st for items in ours for st, *_ in items]

        sse_events(url, grew)
        assert seen[0] == (1, 1, 0, 0), seen
        assert a.ledger is None and b.ledger is None  # followed, never collected as watched
        assert _until(lambda: a.followers == b.followers == 0), (a.followers, b.followers)
        assert a.watchers == b.watchers == 0
        # A run's own page, beside a compare page of the same run that closes: still watched.
        compared = f"{s.url}/api/stream?compare={a.id}&token={s.token}"
        own = f"{s.url}/api/stream?run={a.id}&rank=0&token={s.token}"

        def both_open(events):
            if not any(e == "summary" for e, _ in events):
                return False
            sse_events(compared, lambda ev: any(e == "metrics" for e, _ in ev))
            return _until(lambda: a.followers == 0 and a.watchers == 1 and a.ledger is not None)

        sse_events(own, both_open)
        assert _until(lambda: a.watchers == 0 and a.followers == 0)


# -- hostile run dirs -----------------------------------------------------------------------------


def test_a_hostile_run_dir_never_stops_the_server_nor_the_other_runs(tmp_path):
    runs = tmp_path / "runs"
    good = make_run(runs / "good")
    bad = make_run(runs / "bad")
    with open(bad.status, "wb") as f:
        f.write(os.urandom(4096))
    with open(bad.attempts, "wb") as f:
        f.write(b'{"attempt": 0, "started_at": 1.7e9, "world_size": 2}\n{"attempt": 1, "sta')
    with open(bad.heartbeat_file(0), "w") as f:
        f.write("[" * 50_000)
    with open(bad.heartbeat_file(1), "w") as f:
        json.dump({"rank": "one", "time": "soon", "step": -1}, f)
    with open(bad.metrics, "ab") as f:
        f.write(b'{"step": "abc", "x": 1}\n{"step": 3, "y": "NaN", "z": true}\n\x00\x01\x02\n')
        f.write(b'{"step": 4, "x": ' + b"9" * 100_000 + b"}\n")
    with open(bad.log_file(0, 0), "wb") as f:
        f.truncate(2 * 2**30)
    os.makedirs(bad.timelines, exist_ok=True)
    with open(bad.timeline_file(0), "w") as f:
        f.write('{"attempt": 0, "seconds": {"train": "lots"}, "first_step_at": -5}')
    os.symlink("/etc/passwd", bad.log_file(1, 0))
    with open(bad.config, "a") as f:
        f.write("train: [this, is, not, a, mapping\n")
    # FIFOs where records, metrics and logs should be: opened for reading, each would wait for
    # a writer forever (and the poll thread with it); and a record that is a link out.
    fifos = make_run(runs / "fifos")
    for target in (
        fifos.attempts,
        fifos.heartbeat_file(1),
        fifos.sample_ledger,
        fifos.metrics,
        fifos.log_file(0, 0),
        fifos.timeline_file(0),
    ):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.exists(target):
            os.remove(target)
        os.mkfifo(target)
    elsewhere = make_run(tmp_path / "elsewhere", state="failed", error="not this run's")
    os.remove(fifos.status)
    os.symlink(elsewhere.status, fifos.status)
    # config.yaml as clusterflow never writes it: a billion laughs (expanded wherever it is
    # walked: the run's page, its config rows) and lists nested past any stack.
    said = {
        "laughs": "it holds a YAML anchor or alias ('lol0', line 1)",
        "deep": "it nests deeper than 100 levels",
    }
    for name, config in (("laughs", billion_laughs()), ("deep", DEEP_LISTS)):
        with open(make_run(runs / name).config, "w") as f:
            f.write(config)
    with served([runs]) as s:
        # all found and read once (a poll reads for at most its budget: on a loaded machine the
        # hostile run can take one poll's whole budget)
        assert poll_until(
            s.catalog,
            lambda: (
                len(s.catalog.runs) == 5
                and all(r.status is not None or r.problem for r in s.catalog.runs.values())
            ),
        )
        ids = {r.name: r.id for r in s.catalog.runs.values()}
        code, body, _ = get(f"{s.url}/api/runs?token={s.token}")
        assert code == 200
        rows = {r["name"]: r for r in json.loads(body)["runs"]}
        assert rows["runs/good"]["state"] == "running"
        for name, why in said.items():
            assert rows[f"runs/{name}"]["state"] == "running", rows[f"runs/{name}"]
            code, body, _ = get(f"{s.url}/api/run/{ids[f'runs/{name}']}?token={s.token}")
            shown = json.loads(body)
            assert code == 200 and shown["config"] == [], shown["config"][:3]
            (line,) = [d for d in shown["damaged_records"] if "config.yaml" in d]
            assert line.startswith(f"config.yaml is damaged ({why}"), line
        code, body, _ = get(f"{s.url}/api/run/{ids['runs/bad']}?token={s.token}")
        bad = json.loads(body)
        assert code == 200 and (bad["problem"] or bad["damaged_records"]), bad
        code, body, _ = get(f"{s.url}/run/{ids['runs/bad']}?token={s.token}")
        assert code == 200
        for rank in (0, 1):
            url = f"{s.url}/api/stream?run={ids['runs/bad']}&rank={rank}&token={s.token}"
            events = sse_events(url, lambda ev: {"summary", "metrics", "log"} <= {e for e, _ in ev})
            text = "".join(t for e, d in events if e == "log" for t in d["items"])
            assert "root:" not in text  # /etc/passwd through the link is never read
            assert len(text) < 128 * 1024
        code, body, _ = get(f"{s.url}/api/run/{ids['runs/fifos']}?token={s.token}")
        shown = json.loads(body)
        assert "not this run's" not in body and shown["state"] != "failed", shown
        assert "status.json is a symbolic link (to " in " ".join(shown["damaged_records"])
        fifo = "attempts.jsonl is a FIFO (named pipe), not a regular file"
        assert fifo in shown["damaged_records"]
        url = f"{s.url}/api/stream?run={ids['runs/fifos']}&rank=0&token={s.token}"
        events = sse_events(url, lambda ev: {"summary", "metrics", "log"} <= {e for e, _ in ev})
        text = "".join(t for e, d in events if e == "log" for t in d["items"])
        assert "rank0.attempt0.log is a FIFO (named pipe), not a regular file: not shown" in text
        # The compare page over all five: their names and the good run's metrics.
        every = ",".join(ids.values())
        code, body, _ = get(f"{s.url}/api/compare?runs={every}&token={s.token}")
        assert code == 200 and len(json.loads(body)["runs"]) == 5, body
        url = f"{s.url}/api/stream?compare={every}&token={s.token}"
        events = sse_events(
            url, lambda ev: any(d.get("run") == ids["runs/good"] for e, d in ev if e == "metrics")
        )
        assert "root:" not in json.dumps(events) and "not this run's" not in json.dumps(events)
        # The good run still goes on: the poll thread never waited on a FIFO.
        add_metrics(good, 11, **{"train/loss": 0.01})
        url = f"{s.url}/api/stream?run={ids['runs/good']}&token={s.token}"
        sse_events(
            url,
            lambda ev: any(st == 11 for e, d in ev if e == "metrics" for st, *_ in d["items"]),
        )


HTML = '<img src=x onerror="window.xss=1">'


def test_a_hostile_sweep_dir_never_stops_the_runs_page_nor_a_compare_page(tmp_path):
    """A sweep.json of garbage, a link, a FIFO, or of members that are none (a string, no name,
    a name that leads out of the sweep, values that are a list) is named on its sweep's row and
    its compare page is empty; the Runs page, its stream and a good sweep's compare page go on;
    a member named with HTML, its value HTML, is sent as the text it is (the browser tests show
    such text as text)."""
    runs = tmp_path / "runs"
    make_sweep(runs / "good", {"lr=0.1": 0.1, "lr=0.2": 0.2})
    make_sweep(runs / "html", {"m": 0.1, HTML: HTML})
    elsewhere = make_run(tmp_path / "elsewhere", state="failed", error="not this sweep's")
    for name, member in (
        ("string", "just a string"),
        ("nameless", {"values": {}}),
        ("out", {"name": os.path.relpath(elsewhere.root, runs / "out"), "values": {}}),
        ("listed", {"name": "m", "values": [1, 2]}),
    ):
        make_sweep(runs / name, {"m": 0.1})
        index = json.loads((runs / name / "sweep.json").read_text())
        index["members"].append(member)
        (runs / name / "sweep.json").write_text(json.dumps(index))
    make_sweep(runs / "garbage", {"m": 0.1})
    (runs / "garbage" / "sweep.json").write_bytes(os.urandom(4096))
    make_sweep(runs / "link", {"m": 0.1})
    os.remove(runs / "link" / "sweep.json")
    os.symlink(runs / "good" / "sweep.json", runs / "link" / "sweep.json")
    make_sweep(runs / "fifo", {"m": 0.1})  # never opened (a read would wait for a writer)
    os.remove(runs / "fifo" / "sweep.json")
    os.mkfifo(runs / "fifo" / "sweep.json")
    damaged = ("string", "nameless", "out", "listed", "garbage", "link")
    with served([runs]) as s:
        assert poll_until(
            s.catalog,
            lambda: (
                len(s.catalog.sweeps) == 8
                and all(w.index is not None or w.problem for w in s.catalog.sweeps.values())
                and all(r.status for r in s.catalog.runs.values())
            ),
        )
        token = f"token={s.token}"
        code, body, _ = get(f"{s.url}/api/runs?{token}")
        assert code == 200, body
        assert "not this sweep's" not in body
        groups = {g["name"]: g for g in json.loads(body)["sweeps"]}
        for name in damaged:
            assert groups[f"runs/{name}"]["problem"] and not groups[f"runs/{name}"]["members"]
        assert "is damaged: a member is" in groups["runs/string"]["problem"]
        assert "is a symbolic link" in groups["runs/link"]["problem"]
        assert len(groups["runs/good"]["members"]) == 2
        assert {r["name"] for r in json.loads(body)["runs"]} >= {"runs/fifo/m", "runs/good/lr=0.1"}
        events = sse_events(f"{s.url}/api/stream?{token}", lambda ev: ev[0][0] == "runs")
        assert len(events[0][1]["sweeps"]) == 8
        ids = {w.name: w.id for w in s.catalog.sweeps.values()}
        for name in damaged:
            code, body, _ = get(f"{s.url}/api/compare?sweep={ids[f'runs/{name}']}&{token}")
            assert code == 200 and json.loads(body)["runs"] == [], (name, body)
            url = f"{s.url}/api/stream?sweep={ids[f'runs/{name}']}&{token}"
            (event,) = sse_events(url, lambda ev: ev[0][0] == "compare")
            assert event[1]["runs"] == [] and "not this sweep's" not in json.dumps(event)
        url = f"{s.url}/api/stream?sweep={ids['runs/html']}&{token}"
        events = sse_events(url, lambda ev: len({d["run"] for e, d in ev if e == "metrics"}) == 2)
        shown = events[0][1]
        assert {r["name"] for r in shown["runs"]} == {"runs/html/m", f"runs/html/{HTML}"}
        assert HTML in shown["sweep"]["values"]["train.lr"].values()
        url = f"{s.url}/api/stream?sweep={ids['runs/good']}&{token}"
        sse_events(url, lambda ev: len({d["run"] for e, d in ev if e == "metrics"}) == 2)


# -- the Runs page's data -------------------------------------------------------------------------


def test_sweeps_are_grouped_with_their_members(tmp_path):
    make_sweep(tmp_path / "runs" / "sw", {"lr=0.1": 0.1, "lr=0.2": 0.2})
    index = json.loads((tmp_path / "runs" / "sw" / "sweep.json").read_text())
    index["members"].append({"name": "lr=0.3", "values": {"train.lr": 0.3}, "overrides": []})
    (tmp_path / "runs" / "sw" / "sweep.json").write_text(json.dumps(index))
    cat = web_catalog.Catalog([str(tmp_path / "runs")], lambda: None)
    assert poll_until(cat, lambda: all(r.status for r in cat.runs.values()) and cat.runs)
    page = views.runs_page(cat)
    (sweep,) = page["sweeps"]
    assert sweep["keys"] == ["train.lr"]
    members = {m["member"]: m for m in sweep["members"]}
    assert members["lr=0.1"]["state"] == "completed" and members["lr=0.1"]["id"]
    assert members["lr=0.3"]["state"] == "not submitted" and members["lr=0.3"]["id"] is None
    assert members["lr=0.2"]["values"] == {"train.lr": "0.2"}
    assert all(r["sweep"] == sweep["id"] for r in page["runs"])


def test_a_folder_with_no_runs_says_what_was_searched(tmp_path):
    """The Runs page of a folder with no run: the paths and how many folders were searched (the
    browser test reads the sentence the page makes of them), once the first search is done."""
    os.makedirs(tmp_path / "empty" / "a" / "b")
    cat = web_catalog.Catalog([str(tmp_path / "empty")], lambda: None)
    before = views.runs_page(cat)
    assert before["searched"] == 0 and before["runs"] == []  # not searched yet: "looking"
    cat.poll()
    page = views.runs_page(cat)
    assert page["paths"] == [str(tmp_path / "empty")] and page["searched"] == 3
    assert cat.version == 1  # the streams send the page again: it now says nothing was found


def test_squeue_is_asked_once_for_every_run_not_once_per_run(tmp_path, monkeypatch):
    """Even when each round collects one run (a loaded node, many runs), the first ask waits
    for every run's job."""
    monkeypatch.setattr(web_catalog, "BUDGET_S", 0.0)
    asked = []

    def ask(ids):
        asked.append(sorted(ids))
        return {j: commands.QueuedJob("RUNNING", "None", 3600, 60, 3540, 1.0, 1, "n1") for j in ids}

    for i in range(5):
        paths = make_run(tmp_path / "runs" / f"r{i}")
        rundir.append_jsonl(paths.submissions, {"job_id": str(700 + i), "submitted_at": 1.0})
    cat = web_catalog.Catalog([str(tmp_path / "runs")], lambda: None, web_catalog.QueueCache(ask))
    assert poll_until(cat, lambda: len(cat.runs) == 5 and all(r.status for r in cat.runs.values()))
    assert poll_until(cat, lambda: all(r.status["alive"] for r in cat.runs.values()))
    assert asked and all(len(a) == 5 for a in asked) and len(asked) <= 2, asked
    job = next(iter(cat.runs.values())).status["job"]  # the job panel's, from the same call
    assert (job["state"], job["left_s"], job["nodes"]) == ("RUNNING", 3540, "n1")


# -- GPUs, with NVML replaced at its boundary -----------------------------------------------------


def gpu(index, used, procs=(), util=0, total=81559):
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total_mb": total,
        "memory_used_mb": used,
        "util_pct": util,
        "temp_c": 40,
        "processes": [{"pid": p, "name": n, "used_mb": mb} for p, n, mb in procs],
    }


def test_every_gpu_with_its_memory_and_the_run_that_holds_it(tmp_path):
    paths = make_run(tmp_path / "runs" / "train-a", world=2)
    host = socket.gethostname()
    for r in range(2):
        rec = json.loads(open(paths.heartbeat_file(r)).read())
        rec.update(host=host, pid=5000 + r, gpu_index=r, time=time.time())
        with open(paths.heartbeat_file(r), "w") as f:
            json.dump(rec, f)
    snapshot = [
        gpu(0, 30000, [(5000, "python", 29000)], util=97),
        gpu(1, 31000, [(5001, "python", 30000)], util=95),
        gpu(2, 12000, [(777, "jupyter", 11800)], util=3),
        gpu(3, 300),
    ]
    cat = web_catalog.Catalog([str(tmp_path / "runs")], lambda: snapshot)
    assert poll_until(cat, lambda: cat.gpus and all(r.status for r in cat.runs.values()))
    shown = {g["index"]: g for g in views.gpus(cat)}
    assert [p["run"] for p in shown[0]["processes"]] == ["runs/train-a"]
    assert shown[1]["processes"][0]["rank"] == 1
    assert shown[2]["processes"][0]["run"] is None and not shown[2]["free"]
    assert shown[3]["free"] and shown[3]["why"].startswith("free: no process")
    assert shown[0]["memory_used_mb"] == 30000 and shown[0]["util_pct"] == 97
    assert web_catalog.Catalog([str(tmp_path / "runs")], lambda: None).gpus is None


@pytest.mark.slurm
def test_one_squeue_call_answers_as_one_per_job(cluster):
    """On the local cluster: held jobs (one a two-task array), a cancelled one and an id Slurm
    never had; queue_states answers each as queue_state does, in one squeue call."""
    import subprocess

    from clusterflow.slurm import commands

    def sbatch(*extra):
        out = subprocess.run(
            ["sbatch", "--hold", "--parsable", "-o", "/dev/null", *extra, "--wrap", "sleep 600"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    held, array, gone = sbatch(), sbatch("--array=0-1"), sbatch()
    try:
        subprocess.run(["scancel", gone], check=False, capture_output=True, timeout=30)
        ids = [held, f"{array}_0", f"{array}_1", gone, "999999991", "not-a-job"]
        deadline = time.time() + 30
        while commands.queue_state(gone) and time.time() < deadline:
            time.sleep(0.5)  # a cancelled job leaves the queue within moments
        batched = commands.queue_states(ids)
        assert batched == {j: commands.queue_state(j) for j in ids if j != "not-a-job"}
        assert batched[held].startswith("PENDING|") and batched[f"{array}_1"].startswith("PENDING")
        assert batched[gone] == "" and batched["999999991"] == ""
        assert commands.queue_states(["999999991", "999999992"]) == {
            "999999991": "",
            "999999992": "",
        }
    finally:
        subprocess.run(["scancel", held, array], check=False, capture_output=True, timeout=30)
