"""Experiment trackers against the real thing: an `mlflow server` with a SQL store started here,
and W&B in offline mode. A run killed mid-epoch and resumed is one tracker run whose history holds
each step once, with the values of metrics.jsonl."""

import glob
import http.server
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import launch
import pytest
import yaml
from clihelp import call
from conftest import REPO, run_cli
from mlflow.tracking import MlflowClient

from clusterflow.config.job_config import load
from clusterflow.distributed import free_port
from clusterflow.distributed.env import DistEnv
from clusterflow.errors import UserError
from clusterflow.job.run import _check_trackers
from clusterflow.launch import submit
from clusterflow.manage.status import collect, render
from clusterflow.observe.metrics import read_metrics
from clusterflow.observe.trackers import mlflow_run
from clusterflow.rundir.paths import RunPaths

STEPS = 18  # tiny.yaml: 3 epochs of 6 steps


def refused(monkeypatch, run_dir, *extra):
    """(exit status, stdout, stderr) of ``submit_local(run_dir, *extra)`` run in this process
    (tests/clihelp.call, as ``python -m`` would run it): for refusals at submit, which end before
    anything starts."""
    monkeypatch.chdir(REPO)
    args = ["configs/tiny.yaml", "--local", f"run.dir={run_dir}", "task.target=testtasks:Signals"]
    return call(
        submit.main, [*args, f"task.params.run_dir={run_dir}", "task.params.signals=", *extra]
    )


def submit_local(run_dir, *extra, signals="", env=None):
    """``clusterflow submit --local`` of tiny.yaml with the Signals test task (kills itself at
    the loss calls ``signals`` names)."""
    return run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        "--local",
        f"run.dir={run_dir}",
        "task.target=testtasks:Signals",
        f"task.params.run_dir={run_dir}",
        f"task.params.signals={signals}",
        *extra,
        env={"PYTHONPATH": os.path.join(REPO, "tests"), **(env or {})},
    )


def start_server(where, port, host="127.0.0.1"):
    """A real MLflow tracking server with a SQLite backend store, listening on ``host``; returns
    it once it answers."""
    uri = f"http://{host}:{port}"
    log = open(where / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server"]
        + ["--backend-store-uri", f"sqlite:///{where}/mlflow.db"]
        + ["--default-artifact-root", str(where / "artifacts")]
        + ["--host", host, "--port", str(port), "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # No job runner: its worker processes (each importing MLflow) serve nothing a test uses.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return server
        except OSError:
            if server.poll() is not None:
                pytest.fail("mlflow server did not start: " + open(where / "server.log").read())
            time.sleep(0.5)


def stop_server(server):
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=60)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    port = free_port()
    server = start_server(tmp_path_factory.mktemp("mlflow"), port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(server)


def flat_config(run_dir):
    """The saved config as ``section.key`` -> text, mappings (task.params) one level deeper."""
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    out = {}
    for section, values in cfg.items():
        for key, value in values.items():
            if isinstance(value, dict) and value:
                out.update({f"{section}.{key}.{k}": str(v) for k, v in value.items()})
            else:
                out[f"{section}.{key}"] = str(value)
    return out


def committed_steps(run_dir):
    folder = os.path.join(run_dir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return [int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()]


def held_steps(client, experiment, key="train/loss"):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return [m.step for r in runs for m in client.get_metric_history(r.info.run_id, key)]


def one_finished_run_with_each_step_once(client, experiment, run_dir):
    """The experiment's one run, after checking it: FINISHED, the config as parameters, and
    train/loss at each step once, in order, with metrics.jsonl's values."""
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"
    # config.yaml keeps run.dir as "." (a run dir may move); the parameter says where it ran
    assert run.data.params == {**flat_config(run_dir), "run.dir": run_dir}
    history = client.get_metric_history(run.info.run_id, "train/loss")
    steps = [m.step for m in history]
    assert steps == list(range(1, STEPS + 1)), steps
    written = read_metrics(run_dir)
    assert {m.step: m.value for m in history} == {s: written[s]["train/loss"] for s in steps}
    return run


def test_a_killed_and_resumed_run_is_one_mlflow_run_with_each_step_once(mlflow_server, tmp_path):
    """Held in step 10 until MLflow has steps 1-9, then SIGKILLed (mid-epoch; the newest
    checkpoint is step 8) and submitted again: the resumed attempt computes step 9 again and
    must not send it twice."""
    d, kill = str(tmp_path / "run"), str(tmp_path / "kill-now")
    client = MlflowClient(mlflow_server)
    command = [sys.executable, "-m", "clusterflow.submit", "configs/tiny.yaml", "--local"] + [
        f"run.dir={d}",
        "task.target=testtasks:KillWhenFileAppears",
        f"task.params.run_dir={d}",
        f"task.params.kill_file={kill}",
        "task.params.at=10",
        "checkpoint.async=false",  # step 8 is committed before step 9 starts
        f"trackers.mlflow.uri={mlflow_server}",
        "trackers.mlflow.experiment=killed",
    ]
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    while max(held_steps(client, "killed"), default=0) < 9:
        assert job.poll() is None, job.stdout.read()
        time.sleep(0.2)
    open(kill, "w").close()
    out, _ = job.communicate(timeout=600)
    assert job.returncode != 0, out
    assert max(committed_steps(d)) == 8 < max(held_steps(client, "killed")) == 9
    os.unlink(kill)
    again = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {d}/checkpoints/step-8:" in open(f"{d}/logs/rank0.attempt1.log").read()

    client = MlflowClient(mlflow_server)
    run = one_finished_run_with_each_step_once(client, "killed", d)
    written = read_metrics(d)
    # every other scalar once per step as well, mining rounds and eval included
    for key in ("train/lr", "eval/view_cos", "mining/num_clusters", "mining/threshold"):
        points = client.get_metric_history(run.info.run_id, key)
        at = [m.step for m in points]
        assert at == sorted(set(at)), (key, at)
        assert {m.step: m.value for m in points} == {s: written[s][key] for s in at}, key
        assert at == [s for s in sorted(written) if key in written[s]], key
    assert run.data.tags["clusterflow.checkpoint"].startswith(f"step-{STEPS} ")
    shown = collect(RunPaths(d))
    assert shown["trackers"] == {"mlflow": STEPS} and "received no step" not in render(shown)


@pytest.mark.parametrize(
    "uri, why",
    [
        ("garbage://x", "scheme 'garbage' is not one MLflow tracks to"),
        ("htp://127.0.0.1:5000", "scheme 'htp'"),
        ("http://", "names no host"),
        ("sqlite:/mlflow.db", "a SQLite URI is sqlite:///"),
    ],
)
def test_an_mlflow_uri_mlflow_cannot_open_is_refused_at_submit(tmp_path, monkeypatch, uri, why):
    d = str(tmp_path / "run")
    code, out, err = refused(monkeypatch, d, f"trackers.mlflow.uri={uri}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, out + err
    assert lines[0].startswith(f"error: trackers.mlflow.uri = {uri!r}: {why}"), lines
    assert not os.path.exists(d)


class _NotMlflow(http.server.BaseHTTPRequestHandler):
    """A server that passes the health check and answers every MLflow call with an error: the
    wrong service on the port, or a proxy in front of a dead one."""

    def do_GET(self):
        self.send_response(200 if self.path.endswith("/health") else 500)
        self.end_headers()
        self.wfile.write(b"OK")

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_status_warns_about_a_tracker_that_never_received_a_step(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    d = str(tmp_path / "run")
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        out = submit_local(d, "cluster.tasks_per_node=1", f"trackers.mlflow.uri={uri}")
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stdout + out.stderr
    shown = collect(RunPaths(d))
    assert shown["trackers"] == {"mlflow": None}
    warning = [line for line in render(shown).splitlines() if "received no step" in line]
    assert warning == [
        (
            f"warning      tracker mlflow received no step of the {STEPS} trained: python -m "
            f"clusterflow.logs {d} | grep 'tracker mlflow' says why (metrics.jsonl holds every "
            "point; the next launch sends them once the tracker answers)"
        )
    ]


def test_a_missing_tracker_server_is_refused_at_submit(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    dead = f"http://127.0.0.1:{free_port()}"
    code, out, err = refused(monkeypatch, d, f"trackers.mlflow.uri={dead}")
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and dead in lines[0] and "no tracking server" in lines[0], lines
    assert not os.path.exists(d)


@pytest.mark.parametrize("name, key", [("mlflow", "uri=sqlite:///x.db"), ("wandb", "project=p")])
def test_a_tracker_whose_package_is_missing_is_refused_at_submit(tmp_path, monkeypatch, name, key):
    """The package hidden the way Python documents it: ``sys.modules[name] = None``."""
    d = str(tmp_path / "run")
    monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.chdir(REPO)
    code, out, err = call(
        submit.main, ["configs/tiny.yaml", "--local", f"run.dir={d}", f"trackers.{name}.{key}"]
    )
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"clusterflow[{name}]" in lines[0], lines
    assert not os.path.exists(d)


def test_wandb_online_without_an_api_key_is_refused_at_submit(tmp_path, monkeypatch):
    """No WANDB_API_KEY and no netrc entry: exit 2 with one line; either one lets it through."""
    home, d = tmp_path / "home", str(tmp_path / "run")
    home.mkdir()
    for k in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(REPO)

    def dry_run(**extra):
        with monkeypatch.context() as m:
            for k, v in extra.items():
                m.setenv(k, v)
            args = ["configs/tiny.yaml", "--dry-run", f"run.dir={d}", "trackers.wandb.project=p"]
            return call(submit.main, args)

    code, out, err = dry_run()
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no W&B API key is set for api.wandb.ai" in lines[0], lines
    assert f"no entry in {home}/.netrc" in lines[0] and "wandb login" in lines[0], lines
    assert dry_run(WANDB_API_KEY="k" * 40)[0] == 0
    netrc = home / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert dry_run()[0] == 0
    # another W&B server (WANDB_BASE_URL) needs its own entry
    code, _, err = dry_run(WANDB_BASE_URL="https://wandb.example.org")
    assert code == 2 and "for wandb.example.org" in err, err
    assert not os.path.exists(d)


@pytest.mark.slow
def test_a_tracker_server_that_dies_mid_run_costs_a_warning_not_the_run(tmp_path):
    port = free_port()
    server = start_server(tmp_path, port)
    d = str(tmp_path / "run")
    # One rank by tests/launch.py: the tracker runs inside the rank, whatever started it.
    overrides = [f"run.dir={d}", "cluster.tasks_per_node=1", "task.target=testtasks:Slow"]
    overrides += [f"trackers.mlflow.uri=http://127.0.0.1:{port}"]
    env = {"PYTHONPATH": os.path.join(REPO, "tests")}
    (job,) = launch.start(1, "configs/tiny.yaml", overrides, str(tmp_path / "logs"), env=env)
    try:
        while not read_metrics(d) if os.path.exists(f"{d}/metrics.jsonl") else True:
            assert job.poll() is None, glob.glob(f"{tmp_path}/logs/*")
            time.sleep(0.2)
    finally:
        stop_server(server)  # the server goes down in mid-run
    assert launch.wait([job]) == [0], open(os.path.join(d, "logs", "rank0.attempt0.log")).read()
    assert os.path.exists(os.path.join(d, "model.pt"))
    log = open(os.path.join(d, "logs", "rank0.attempt0.log")).read()
    assert "tracker mlflow failed" in log and "training goes on" in log, log[-3000:]


def wandb_records(path):
    """The records of a W&B transaction log (``run-ID.wandb``): a 7-byte header, then LevelDB
    log blocks of 32 KiB whose records are protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = open(path, "rb").read(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and size == 0:  # the zero padding at the end of a block
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def wandb_history(path, key):
    """``[(step, value)]`` of ``key`` in one attempt's transaction log."""
    out = []
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            if key in items:
                out.append((r.history.step.num, json.loads(items[key])))
    return out


@pytest.mark.slow
def test_wandb_offline_keeps_one_run_id_across_attempts(tmp_path):
    """SIGKILLed in step 10 once W&B has opened its offline run (a first import of wandb can take
    longer than ten steps), then resubmitted: both attempts' offline folders carry the run id
    that trackers.json names, and, under W&B's rule that a run's steps only increase (a point at
    a step it already has is dropped), the history holds every step once, with metrics.jsonl's
    values."""
    d, kill = str(tmp_path / "run"), str(tmp_path / "kill-now")
    command = [sys.executable, "-m", "clusterflow.submit", "configs/tiny.yaml", "--local"] + [
        f"run.dir={d}",
        "cluster.tasks_per_node=1",
        "task.target=testtasks:KillWhenFileAppears",
        f"task.params.run_dir={d}",
        f"task.params.kill_file={kill}",
        "task.params.at=10",
        "trackers.wandb.project=clusterflow-test",
        "trackers.wandb.mode=offline",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(REPO, "tests"),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
    }
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    logs = os.path.join(d, "wandb", "wandb", "offline-run-*", "run-*.wandb")
    while not glob.glob(logs):
        assert job.poll() is None, job.stdout.read()
        time.sleep(0.2)
    open(kill, "w").close()
    out, _ = job.communicate(timeout=600)
    assert job.returncode != 0, out
    second = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stdout + second.stderr
    run_id = json.load(open(os.path.join(d, "trackers.json")))["wandb"]["run_id"]
    folders = sorted(glob.glob(os.path.join(d, "wandb", "wandb", "offline-run-*")))
    assert len(folders) == 2, folders
    history, last = {}, 0
    for folder in folders:
        assert folder.endswith(f"-{run_id}"), folder
        points = wandb_history(os.path.join(folder, f"run-{run_id}.wandb"), "train/loss")
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), steps
        history.update({s: v for s, v in points if s > last})
        last = max(steps, default=last)
    written = read_metrics(d)
    assert sorted(history) == list(range(1, STEPS + 1)), sorted(history)
    assert history == pytest.approx({s: written[s]["train/loss"] for s in history}, rel=1e-6)


def test_a_tracker_down_at_a_requeue_costs_a_warning_not_the_attempt(tmp_path, capsys):
    """The server answered at submit; it is down when Slurm restarts the job: a fresh start is
    refused with one line, a requeued attempt (SLURM_RESTART_COUNT > 0) trains on."""
    uri = f"http://127.0.0.1:{free_port()}"
    cfg = load(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [f"run.dir={tmp_path / 'run'}", f"trackers.mlflow.uri={uri}"],
    )
    with pytest.raises(UserError, match="no tracking server answers there"):
        _check_trackers(cfg, DistEnv(attempt=0))
    _check_trackers(cfg, DistEnv(attempt=1))
    said = capsys.readouterr().err
    assert "no tracking server answers there" in said and "requeued attempt trains on" in said


def test_an_mlflow_send_retried_after_a_partial_failure_repeats_identical_points(monkeypatch):
    """The second request of a send fails (the server going down): the retry sends the same
    points with the same timestamps, which MLflow's store keeps once, not each step twice."""

    class Client:
        def __init__(self):
            self.batches, self.fail_once = [], True

        def log_batch(self, run_id, metrics):
            if len(self.batches) == 1 and self.fail_once:
                self.fail_once = False
                raise ConnectionError("server went away")
            self.batches.append([(m.key, m.value, m.timestamp, m.step) for m in metrics])

    monkeypatch.setattr(mlflow_run, "_BATCH", 2)
    backend = mlflow_run.MlflowBackend({"uri": "http://x"}, "run")
    backend._client, backend.run_id = Client(), "r"
    rows = [(1, {"a": 1.0, "b": 2.0}), (2, {"a": 3.0, "b": 4.0})]
    with pytest.raises(ConnectionError):
        backend.log(rows)
    time.sleep(0.01)  # a later clock: a fresh timestamp would differ
    backend.log(rows)
    first, retried = backend._client.batches[0], backend._client.batches[1:]
    assert [p for batch in retried for p in batch][:2] == first  # identical: dropped as duplicates
    assert backend._stamps == {}  # delivered: nothing kept
