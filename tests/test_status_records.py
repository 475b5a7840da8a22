"""Status tells the truth from what is committed: a completed run reads `completed` whatever its
records say, and records that are lost, damaged or wrong-typed are named, never a traceback."""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time

import clihelp
import pytest
from conftest import DEEP_LISTS, REPO, billion_laughs

from clusterflow.cancel import main as cancel_main
from clusterflow.launch import stages
from clusterflow.logs import main as logs_main
from clusterflow.observe.metrics import read_metrics
from clusterflow.rundir import lease, states
from clusterflow.rundir.states import STATES
from clusterflow.status import main as status_main
from clusterflow.submit import main as submit_main


@pytest.fixture
def completed_run(tiny_one_process_model):
    """One real one-process run of configs/tiny.yaml to its end, made once for the session (the
    run of conftest's tiny_one_process_model); tests damage copies."""
    return os.path.dirname(tiny_one_process_model)


@pytest.fixture
def completed(completed_run, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(completed_run, d)
    return d


def status(run_dir, *flags):
    """`clusterflow status RUN_DIR FLAGS` in this process (tests/clihelp.call, as python -m runs
    it; test_fuzz_cli checks the harness against real processes): its stdout."""
    code, out, err = clihelp.call(status_main, [run_dir, *flags])
    assert code == 0 and "Traceback" not in err, out + err
    return out


def damage_status(run_dir, how):
    target = os.path.join(run_dir, "status.json")
    os.remove(target)
    if how == "directory":
        os.mkdir(target)
        return
    with open(target, "w") as f:
        f.write({"empty": "", "JSON list": "[1, 2, 3]\n"}[how])


@pytest.mark.parametrize("how", ["empty", "directory", "JSON list"])
def test_a_completed_run_reads_completed_whatever_status_json_holds(completed, how, monkeypatch):
    damage_status(completed, how)
    s = json.loads(status(completed, "--json"))
    assert s["state"] == "completed" and s["error"] is None and s["alive"] is None, s
    # Progress from the newest committed checkpoint: tiny.yaml is 3 epochs of 6 steps.
    assert (s["epoch"], s["global_step"], s["step_in_epoch"]) == (3, 18, 0)
    assert s["latest_checkpoint"].endswith("step-18") and s["damaged_records"]
    assert "state        completed" in status(completed)
    # --after accepts it: a completed earlier stage needs no dependency, --local included.
    assert stages.dependency([completed], local=True) is None
    monkeypatch.chdir(REPO)
    args = ["configs/tiny.yaml", f"run.dir={completed}-next", "--after", completed]
    code, out, err = clihelp.call(submit_main, [*args, "--local", "--dry-run"])
    assert code == 0 and "--after" not in err, out + err


def test_progress_after_a_kill_comes_from_the_newest_committed_checkpoint(completed):
    # Killed after step 18 was committed but before model.pt and the next status.json write:
    # the record still says step 1, the run's processes are gone.
    os.remove(os.path.join(completed, "model.pt"))
    with open(os.path.join(completed, "status.json"), "w") as f:
        json.dump({"state": "running", "epoch": 0, "global_step": 1, "step_in_epoch": 1}, f)
    s = json.loads(status(completed, "--json"))
    assert s["state"] == "failed" and s["alive"] is False, s
    assert (s["epoch"], s["global_step"], s["step_in_epoch"]) == (3, 18, 0)
    assert s["liveness"].endswith("; last step 18"), s["liveness"]


def running(run_dir):
    """Turn a copy of the completed run into one that runs: no model.pt, status.json and
    attempts.jsonl of an attempt whose process is this test's own (alive, with its real start)."""
    os.remove(os.path.join(run_dir, "model.pt"))
    host, pid = socket.gethostname(), os.getpid()
    attempt = {
        "attempt": 0,
        "started_at": time.time(),
        "job_id": "local",
        "source": "single",
        "host": host,
        "hosts": [host],
        "world_size": 1,
        "procs": [[host, pid, lease.process_start(pid)]],
    }
    with open(os.path.join(run_dir, "attempts.jsonl"), "w") as f:
        f.write(json.dumps(attempt) + "\n")
    write_json(
        os.path.join(run_dir, "status.json"),
        {"state": "running", "epoch": 2, "global_step": 14, "step_in_epoch": 2, "job_id": "local"},
    )
    beat = {"rank": 0, "host": host, "pid": pid, "time": time.time(), "step": 14, "phase": "train"}
    write_json(os.path.join(run_dir, "heartbeats", "rank0.json"), beat)
    return run_dir


def write_json(target, value):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))


def edit_json(target, **fields):
    with open(target) as f:
        rec = json.load(f)
    rec.update(fields)
    write_json(target, rec)


DEEP = "[" * 100_000 + "]" * 100_000

# (what the issue wrote, how to do it to a run dir, the file and field the warning names)
WRONG_TYPED = {
    'heartbeat "time": "x"': (
        lambda d: edit_json(os.path.join(d, "heartbeats", "rank0.json"), time="x"),
        'heartbeats/rank0.json: time is "x"',
    ),
    'attempts.jsonl "started_at": "now"': (
        lambda d: write_json(
            os.path.join(d, "attempts.jsonl"),
            open(os.path.join(d, "attempts.jsonl")).read().replace('"started_at": ', '"x": ')
            + json.dumps({"attempt": 1, "started_at": "now", "job_id": "local"})
            + "\n",
        ),
        'attempts.jsonl line 2: started_at is "now"',
    ),
    'submissions.jsonl "submitted_at": "x"': (
        lambda d: write_json(
            os.path.join(d, "submissions.jsonl"),
            json.dumps({"job_id": "local-1", "submitted_at": "x"}) + "\n",
        ),
        'submissions.jsonl line 1: submitted_at is "x"',
    ),
    "code/current.json without version": (
        lambda d: write_json(os.path.join(d, "code", "current.json"), {"module": "testtasks"}),
        "code/current.json: no valid version",
    ),
    'status.json "global_step": "abc"': (
        lambda d: edit_json(os.path.join(d, "status.json"), global_step="abc"),
        'status.json: global_step is "abc"',
    ),
    "status.json nested 100k deep": (
        lambda d: write_json(os.path.join(d, "status.json"), DEEP),
        "status.json is not readable JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPED))
@pytest.mark.parametrize("kind", ["running", "completed"])
def test_a_wrong_typed_record_is_a_named_warning_not_a_traceback(completed, case, kind):
    d = running(completed) if kind == "running" else completed
    damage, named = WRONG_TYPED[case]
    damage(d)
    s = json.loads(status(d, "--json"))
    assert s["state"] == ("running" if kind == "running" else "completed"), s
    assert any(w.startswith(named) for w in s["damaged_records"]), s["damaged_records"]
    text = status(d)
    assert f"warning      {named}" in text, text
    status(d, "--ranks")


# -- fuzz: random and wrong-typed JSON in every record ---------------------------------------------

STRINGS = ["", "x", "now", "abc", "running", "completed", "local", "12345", "ü∂\u2028", "-1"]


def random_value(rng, depth=0):
    kind = rng.choice(["null", "bool", "int", "big", "float", "odd float", "str", "list", "dict"])
    if depth > 3 and kind in ("list", "dict"):
        kind = "str"
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        keys = ["rank", "time", "state", "epoch", "x", "curve", "thresholds", "error"]
        return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return {
        "null": None,
        "bool": rng.random() < 0.5,
        "int": rng.randint(-3, 30),
        "big": rng.choice([10**30, -(10**30), 2**63]),
        "float": rng.uniform(-1e3, 1e12),
        "odd float": rng.choice([float("nan"), float("inf"), -float("inf"), 1e308]),
        "str": rng.choice(STRINGS),
    }[kind]


def templates(host, pid, start, now):
    """A valid record of each kind, the fuzz's starting point for wrong-typed fields."""
    round_ = {
        "epoch": 1,
        "num_clusters": 3,
        "num_singletons": 1,
        "largest_cluster": 5,
        "threshold": 0.5,
        "threshold_rule": "fixed",
        "seconds": {"total": 0.1},
        "curve": {"thresholds": [0.6, 0.5], "num_clusters": [4, 3], "largest_cluster": [4, 5]},
    }
    return {
        "status.json": {
            "state": "running",
            "epoch": 1,
            "global_step": 7,
            "step_in_epoch": 1,
            "steps_per_epoch": 6,
            "job_id": "local",
            "world_size": 1,
            "hosts": [host],
            "last_loss": 4.5,
            "updated_at": now,
            "eval": {"eval/view_cos": 0.9},
            "mining": [round_],
            "phase": "train",
        },
        "attempts.jsonl": {
            "attempt": 0,
            "started_at": now,
            "job_id": "local",
            "source": "single",
            "host": host,
            "hosts": [host],
            "world_size": 1,
            "procs": [[host, pid, start]],
        },
        "submissions.jsonl": {"job_id": "12345", "submitted_at": now},
        "heartbeats/rank0.json": {"rank": 0, "host": host, "pid": pid, "time": now, "step": 7},
        "heartbeats/rank1.json": {"rank": 1, "host": host, "time": now, "step_time_s": 0.1},
        "errors/rank0.json": {"rank": 0, "host": host, "error": "boom", "time": now},
        "errors/first.attempt0.json": {
            "rank": 0,
            "host": host,
            "error": "stalled",
            "kind": "stall",
            "time": now,
            "step": 3,
        },
        "errors/first.attempt1.json": {"rank": 1, "host": host, "error": "boom", "kind": "error"},
        "code/current.json": {"module": "testtasks", "version": "v1", "git": {"commit": "abc"}},
        "lease/gen-1.json": {
            "host": host,
            "pid": pid,
            "pid_start": start,
            "job_id": "local",
            "source": "single",
            "started_at": now,
            "renew_s": 30,
        },
        "cancelled.json": {"cancelled_at": now, "job_id": None, "by": "me@" + host},
    }


def wrong_typed(rng, template):
    rec = dict(template)
    for key in rng.sample(sorted(rec), rng.randint(1, min(3, len(rec)))):
        rec[key] = random_value(rng)
    if rng.random() < 0.3:
        rec.pop(rng.choice(sorted(rec)), None)
    return rec


def one_record(rng, template):
    """The text of one damaged record (a JSON line for .jsonl files), or None for no file."""
    how = rng.choice(["absent", "valid", "wrong-typed", "wrong-typed", "random", "deep", "junk"])
    if how == "absent":
        return None
    if how == "deep":
        return DEEP
    if how == "junk":
        return rng.choice(["", "{", "\x00\xff garbage", '{"a": 1}{"b": 2}', "nul\n"])
    value = {"valid": template, "random": random_value(rng)}.get(how)
    return json.dumps(wrong_typed(rng, template) if value is None else value)


def fuzz_records(rng, run_dir, recs):
    for name, template in recs.items():
        target = os.path.join(run_dir, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.remove(target)
        if rng.random() < 0.05:
            os.makedirs(target)  # a folder where the record should be
            continue
        if name.endswith(".jsonl"):
            lines = [one_record(rng, template) for _ in range(rng.randint(0, 4))]
            text = "".join(line + "\n" for line in lines if line is not None)
        else:
            text = one_record(rng, template)
            if text is None:
                continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)


def commands(run_dir, tmp_path):
    """Every command a user points at a run dir, as (name, main, argv)."""
    after = [
        "configs/tiny.yaml",
        f"run.dir={tmp_path}/next",
        "--after",
        run_dir,
        "--local",
        "--dry-run",
    ]
    return [
        ("status", status_main, [run_dir]),
        ("status --json", status_main, [run_dir, "--json"]),
        ("status --ranks", status_main, [run_dir, "--ranks"]),
        ("logs", logs_main, [run_dir]),
        ("--after", submit_main, after),
        ("cancel", cancel_main, [run_dir]),
    ]


@pytest.mark.parametrize("kind", ["running", "completed"])
def test_fuzzed_records_never_give_a_traceback(completed, kind, tmp_path, monkeypatch):
    # No Slurm command can run: a fuzzed job id must never reach squeue or scancel.
    empty = tmp_path / "no-slurm-here"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.chdir(REPO)
    d = running(completed) if kind == "running" else completed
    host, pid = socket.gethostname(), os.getpid()
    recs = templates(host, pid, lease.process_start(pid), time.time())
    rng = random.Random(23 if kind == "running" else 24)
    for case in range(20):
        fuzz_records(rng, d, recs)
        for name, main, argv in commands(d, tmp_path):
            code, out, err = clihelp.call(main, argv)
            assert "Traceback" not in err and code in (0, 2), (case, name, code, out, err)
            if name == "status --json" and kind == "completed":
                assert json.loads(out)["state"] == "completed", (case, out)
            if name == "--after" and kind == "completed":
                assert "warning" not in err, (case, err)


# The status cadence as if every log step after the first came within a second of it (a fast
# run, a sweep member): only the first ask is due.
ONE_STATUS_WRITE = """
import runpy, sys
import clusterflow.observe.reporter as reporter

class Once:
    def __init__(self, seconds):
        self.asked = 0

    def due(self):
        self.asked += 1
        return self.asked == 1

reporter.Every = Once
sys.argv = ["clusterflow.run", *sys.argv[1:]]
runpy.run_module("clusterflow.run", run_name="__main__")
"""


def test_status_holds_the_last_logged_loss_when_the_cadence_skipped_its_write(tmp_path):
    d = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    out = subprocess.run(
        [sys.executable, "-c", ONE_STATUS_WRITE, "configs/tiny.yaml", f"run.dir={d}"]
        + ["cluster.tasks_per_node=1"],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_metrics(d)
    last = max(step for step, v in rows.items() if "train/loss" in v)
    with open(os.path.join(d, "status.json")) as f:
        s = json.load(f)
    assert last == 18 and s["global_step"] == 18
    assert s["last_loss"] == rows[last]["train/loss"], (s["last_loss"], rows[last])
    assert json.loads(status(d, "--json"))["last_loss"] == rows[last]["train/loss"]


def _state_rows(text, cell):
    rows = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 2 and cell(parts[0]) in STATES:
            rows[cell(parts[0])] = parts[1].replace("``", "`")
    return rows


def test_the_state_table_of_the_docs_is_the_one_of_states_py():
    with open(os.path.join(REPO, "docs", "status.md")) as f:
        docs = _state_rows(f.read(), lambda c: c.strip("`"))
    code = _state_rows(states.__doc__, lambda c: c)
    assert sorted(code) == sorted(STATES) and docs == code, (docs, code)


def _ledger_epoch(epoch, trained, samples=192):
    ranges = [{"start": 0, "end": trained, "attempt": 0, "world_size": 2, "batch_size": 32}]
    return {"epoch": epoch, "samples": samples, "ranges": ranges}


@pytest.mark.parametrize(
    "trained, said",
    [
        # Three epochs: each on its own line, as no summary of one epoch says more than it.
        (
            [192, 192, 64],
            [
                "epoch 1: 192 of 192 trained: [0, 192) attempt 0 on 2 rank(s)",
                "epoch 2: 192 of 192 trained: [0, 192) attempt 0 on 2 rank(s)",
                "epoch 3: 64 of 192 trained: [0, 64) attempt 0 on 2 rank(s)",
            ],
        ),
        # Five: the first three summed up by their own numbers, the last two in full.
        (
            [192, 100, 192, 192, 192],
            [
                "epochs 1-3: 2 of 3 trained in full (--json lists every range)",
                "epoch 4: 192 of 192 trained: [0, 192) attempt 0 on 2 rank(s)",
                "epoch 5: 192 of 192 trained: [0, 192) attempt 0 on 2 rank(s)",
            ],
        ),
    ],
)
def test_the_sample_ledger_lines_name_each_epoch_once(tmp_path, capsys, trained, said):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("run: {dir: x}\n")
    ledger = {"format": 1, "global_step": 18, "epochs": []}
    ledger["epochs"] = [_ledger_epoch(e, n) for e, n in enumerate(trained)]
    (d / "sample_ledger.json").write_text(json.dumps(ledger))
    assert status_main([str(d)]) == 0
    shown = [
        line.split(None, 1)[1]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("samples ")
    ]
    assert shown == said


# -- no record read through a link, none that blocks ---------------------------------------------

MARK = "OUTSIDE-THE-RUN-DIR"


def outside_records(now):
    """Records as another run (another user's, a file anywhere) holds them, each naming MARK where
    status, goodput, logs and the dashboard would show it: a run dir whose records were links to
    them would show MARK."""
    return {
        "status.json": {"state": "failed", "error": MARK, "hosts": [MARK], "last_loss": 1.0},
        "attempts.jsonl": [
            {"attempt": 0, "started_at": now - 99, "job_id": MARK, "hosts": [MARK], "world_size": 1}
        ],
        "submissions.jsonl": [{"job_id": MARK, "submitted_at": now}],
        "stops.jsonl": [{"reason": "node_failure", "node": MARK, "excluded": True}],
        "sample_ledger.json": {
            "epochs": [{"epoch": 0, "samples": 1, "digest": MARK, "ranges": []}]
        },
        "timeline/attempt0.json": {"attempt": 0, "outcome": MARK},
        "errors/rank0.json": {"rank": 0, "host": MARK, "error": MARK, "time": now},
        "errors/first.attempt0.json": {"rank": 0, "host": MARK, "error": MARK},
        "code/current.json": {"module": MARK, "version": "v1"},
        "heartbeats/rank0.json": {"rank": 0, "host": MARK, "time": now},
        "metrics.jsonl": [{"step": 1, MARK: 1.0}],
        "logs/rank0.attempt0.log": MARK + "\n",
        "config.yaml": f"script: {{path: {MARK}.py}}\n",
    }


def write_record(path, value):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        if isinstance(value, str):
            f.write(value)
        elif isinstance(value, list):
            f.write("".join(json.dumps(v) + "\n" for v in value))
        else:
            json.dump(value, f)


def everything_read(run_dir):
    """What `status`, `goodput`, `logs` and the dashboard read of a run, as one text."""
    import io

    from clusterflow.manage import logs
    from clusterflow.manage import status as run_status
    from clusterflow.observe import goodput, scalar_log
    from clusterflow.rundir import RunPaths, first_error

    paths = RunPaths(run_dir)
    shown = io.StringIO()
    logs.show(paths, 0, shown)
    return json.dumps(
        [
            run_status.collect(paths, lambda job: None),
            goodput.ledger(paths),
            first_error.read(paths, 0),
            scalar_log.read(paths),
            lease.current(paths)[1],
            shown.getvalue(),
        ],
        default=str,
    )


def test_a_record_that_is_a_link_is_named_and_never_read(completed, tmp_path):
    """Every record status, goodput, logs and the dashboard read, made a link to another file
    (and the heartbeats folder a link to another folder): none of the other files' contents is
    shown, and each link is named among the damaged records."""
    outside = tmp_path / "elsewhere"
    attempts = os.path.join(completed, "attempts.jsonl")
    shutil.copy(attempts, tmp_path / "attempts.jsonl")
    for name, value in outside_records(time.time()).items():
        write_record(str(outside / name), value)
        target = os.path.join(completed, name)
        if name.startswith("heartbeats/"):
            shutil.rmtree(os.path.dirname(target))
            os.symlink(outside / "heartbeats", os.path.dirname(target))
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.lexists(target):
            os.remove(target)
        os.symlink(outside / name, target)
    (outside / "gen-1.json").write_text(json.dumps({"host": MARK, "pid": 1}))
    os.symlink(outside / "gen-1.json", os.path.join(completed, "lease", "gen-1.json"))
    assert MARK not in everything_read(completed)
    s = json.loads(status(completed, "--json"))
    assert MARK not in json.dumps(s)
    damaged = "\n".join(s["damaged_records"])
    for name in ("status.json", "attempts.jsonl", "sample_ledger.json", "code/current.json"):
        assert f"{name} is a symbolic link (to {outside / name}), not a file of" in damaged, name
    assert "config.yaml is damaged (is a symbolic link" in damaged
    # The heartbeats are read for the ranks of the last attempt: with attempts.jsonl back.
    os.remove(attempts)
    shutil.copy(tmp_path / "attempts.jsonl", attempts)
    assert MARK not in everything_read(completed)
    s = json.loads(status(completed, "--json"))
    assert MARK not in json.dumps(s)
    assert any(
        d.startswith("heartbeats/rank0.json is reached through a symbolic link")
        for d in s["damaged_records"]
    ), s["damaged_records"]
    log = json.dumps(everything_read(completed))
    assert os.path.join(completed, "logs", "rank0.attempt0.log") + " is a symbolic link" in log


def test_a_fifo_in_place_of_any_record_never_blocks_a_reader(completed):
    """A FIFO opened for reading waits for a writer: in place of any record (or of the
    heartbeats folder, or of a checkpoint's manifest) it must not stall status, goodput, logs or
    the dashboard, which read them all (everything_read); each is tried alone."""
    names = [*outside_records(time.time()), "heartbeats", "checkpoints/step-18/manifest.json"]
    names += ["lease/gen-1.json", "trackers.json", "restarts.jsonl", "stragglers.jsonl"]
    blocked = []
    for name in names:
        target = os.path.join(completed, name)
        aside = target + ".aside"
        if os.path.lexists(target):
            os.rename(target, aside)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.mkfifo(target)
        try:
            if not answers(lambda: everything_read(completed), timeout=60):
                blocked.append(name)
        finally:
            release(target)
            os.remove(target)
            if os.path.lexists(aside):
                os.rename(aside, target)
    assert not blocked, f"a FIFO in place of these blocked a reader: {blocked}"
    os.mkfifo(os.path.join(completed, "status.json.fifo"))
    os.replace(os.path.join(completed, "status.json.fifo"), os.path.join(completed, "status.json"))
    s = json.loads(status(completed, "--json"))  # the command itself answers
    assert s["state"] == "completed"
    assert "status.json is a FIFO (named pipe), not a regular file" in s["damaged_records"]


@pytest.mark.parametrize(
    "config, said",
    [
        (billion_laughs(), "it holds a YAML anchor or alias ('lol0', line 1)"),
        (DEEP_LISTS, "it nests deeper than 100 levels"),
    ],
    ids=["aliases", "nesting"],
)
def test_a_config_yaml_clusterflow_never_writes_is_one_damaged_line(
    completed, capsys, config, said
):
    """A billion laughs would expand wherever the config is walked, 30,000 nested lists exhaust
    the stack of a reader that recurses: either is named as damaged in one line (in-process:
    what the command prints), and the run's state still comes from what is committed."""
    with open(os.path.join(completed, "config.yaml"), "w") as f:
        f.write(config)
    assert status_main([completed]) == 0
    out = capsys.readouterr().out
    assert "state        completed" in out, out
    (line,) = [x for x in out.splitlines() if "config.yaml" in x]
    assert line.startswith(f"warning      config.yaml is damaged ({said}"), line
    assert status_main([completed, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["state"] == "completed" and s["script"] is None, s
    assert any(said in d for d in s["damaged_records"]), s["damaged_records"]


def answers(call, timeout):
    """Whether ``call()`` returned within ``timeout`` seconds (a thread of its own: a reader
    blocked on a FIFO stays blocked until :func:`release`)."""
    import threading

    done = []
    thread = threading.Thread(target=lambda: done.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(done)


def release(fifo):
    """Let a reader blocked on ``fifo`` go: a writer opens it and closes it at once."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody reads it
