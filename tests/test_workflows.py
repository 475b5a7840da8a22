"""Issue 15 without Slurm: sweeps (dry run, validation, --local, resubmission), stages with
--after --local, resuming with other resources (2 ranks -> 1, real gloo processes), and a cancelled
run that is never requeued. The Slurm side is in test_slurm_workflows.py."""

import json
import os
from types import SimpleNamespace

import launch
import pytest
from clihelp import call
from conftest import REPO

from clusterflow import config, rundir
from clusterflow.distributed.env import DistEnv
from clusterflow.errors import UserError
from clusterflow.job.requeue import after_stop
from clusterflow.launch import submit
from clusterflow.rundir import cancel_marker, saved_config
from clusterflow.status import main as status_main

TESTS_ENV = {"PYTHONPATH": os.path.join(REPO, "tests")}


@pytest.fixture
def here(monkeypatch):
    """`python -m clusterflow.submit|status ARGS` in this process (tests/clihelp.call, as python
    -m runs it; test_fuzz_cli checks the harness against real processes), for what ends before a
    job starts: dry runs, refusals, resubmissions with nothing to run, status. Returns what
    ``cli`` returns: returncode, stdout, stderr."""
    monkeypatch.chdir(REPO)
    mains = {"clusterflow.submit": submit.main, "clusterflow.status": status_main}

    def run(module, *args):
        code, out, err = call(mains[module], list(args))
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


SMALL = ["train.epochs=1", "cluster.tasks_per_node=1"]
AXES = ["--sweep", "train.lr=0.001,0.003", "--sweep", "mining.k=3,5"]


def test_sweep_dry_run_lists_members_and_prints_one_array_script(here, tmp_path):
    d = tmp_path / "sw"
    out = here(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *SMALL,
        *AXES,
        "--max-parallel",
        "2",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    assert "4 member(s) over train.lr, mining.k" in out.stdout and out.stdout.count(" new\n") == 4
    assert "#SBATCH --array=0-3%2" in out.stdout and "k=3,lr=0.001-" in out.stdout
    assert not d.exists()  # a dry run writes nothing


def test_an_invalid_member_submits_nothing(here, tmp_path):
    d = tmp_path / "sw"
    out = here(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *SMALL,
        "--sweep",
        "mining.k=5,0",
        "--local",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (
        "1 of 2 sweep members are invalid (nothing was submitted)" in out.stderr
        and "member mining.k=0: mining.k = 0: must be >= 1" in out.stderr
    )
    assert not d.exists()
    out = here("clusterflow.submit", "configs/tiny.yaml", *SMALL, "--max-parallel", "2", "--local")
    assert out.returncode == 2 and "--max-parallel" in out.stderr and "needs --sweep" in out.stderr


def test_local_sweep_runs_members_in_turn_and_a_resubmission_skips_completed_ones(
    cli, here, tmp_path
):
    d = tmp_path / "sw"
    args = (
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *SMALL,
        "--sweep",
        "train.lr=0.001,0.003",
        "--local",
    )
    out = cli(*args)
    assert out.returncode == 0, out.stderr
    rows = json.loads(here("clusterflow.status", str(d), "--json").stdout)
    assert [r["train.lr"] for r in rows] == [0.001, 0.003] and {r["state"] for r in rows} == {
        "completed"
    }
    assert all(os.path.isfile(os.path.join(r["run_dir"], "model.pt")) for r in rows)
    table = here("clusterflow.status", str(d)).stdout
    assert "2 member(s), 2 completed" in table and "lr" in table.splitlines()[0]
    again = here(*args)
    assert (
        again.returncode == 0
        and again.stdout.count("skip (completed)") == 2
        and "nothing to submit" in again.stdout
    )
    # the same sweep with another time limit is the same sweep (a resource), still nothing to run
    longer = here(*args, "cluster.time_min=30")
    assert longer.returncode == 0 and "nothing to submit" in longer.stdout
    assert "cluster.time_min 10 -> 30" in longer.stderr
    other = here(*args[:-1], "train.epochs=2", "--local")
    assert (
        other.returncode == 2
        and "holds a sweep with another config (train.epochs 1 -> 2)" in other.stderr
    )


def test_stage_two_after_stage_one_locally(cli, here, tmp_path):
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    small = [
        "cluster.tasks_per_node=1",
        "train.epochs=1",
        "task.params.identities=24",
        "task.params.samples_per_identity=8",
    ]
    early = here(
        "clusterflow.submit",
        "configs/two_stage_2_classifier.yaml",
        f"run.dir={s2}",
        f"task.init_from={s1}",
        *small,
        "--after",
        str(s1),
        "--local",
    )
    assert early.returncode == 2 and "--after" in early.stderr and "no such run dir" in early.stderr
    one = cli(
        "clusterflow.submit",
        "configs/two_stage_1_contrastive.yaml",
        f"run.dir={s1}",
        *small,
        "mining.enabled=false",
        "--local",
    )
    assert one.returncode == 0, one.stderr
    two = cli(
        "clusterflow.submit",
        "configs/two_stage_2_classifier.yaml",
        f"run.dir={s2}",
        f"task.init_from={s1}",
        *small,
        "--after",
        str(s1),
        "--local",
    )
    assert two.returncode == 0, two.stderr
    assert f"from {s1}/model.pt" in open(rundir.RunPaths(str(s2)).log_file(0, 0)).read()


def test_resources_may_change_on_resume_result_keys_may_not(tmp_path, capsys):
    d = str(tmp_path / "r")
    cfg = config.load("configs/tiny.yaml", [f"run.dir={d}"])
    saved_config.write_config(cfg)
    (tmp_path / "r" / "checkpoints" / "step-4").mkdir(parents=True)  # something to resume
    (tmp_path / "r" / "checkpoints" / "step-4" / "manifest.json").write_text("{}")
    longer = config.load(
        "configs/tiny.yaml", [f"run.dir={d}", "cluster.time_min=30", "cluster.partition=high"]
    )
    got, resumed = saved_config.resolve(longer)
    changed = 'cluster.partition "" -> "high"; cluster.time_min 10 -> 30'
    assert got.cluster.time_min == 30
    assert resumed == f"the same config but for resources: {changed}"  # submit's line says so
    assert f"resumes with changed resources: {changed}" in capsys.readouterr().err
    assert saved_config.resolve(longer)[1] == "the same config"  # config.yaml says it now
    assert saved_config.read(d).cluster.time_min == 30  # config.yaml says what it runs with now
    with pytest.raises(UserError, match=r"different config \(train.lr 0.003 -> 0.1\)"):
        saved_config.resolve(config.load("configs/tiny.yaml", [f"run.dir={d}", "train.lr=0.1"]))
    with pytest.raises(UserError, match=r"derived.world_size 2 -> 1 \(train.lr_scaling scales"):
        config.check_resume(
            config.load(None, ["train.lr_scaling=linear", "cluster.tasks_per_node=2"]).to_dict(),
            config.load(None, ["train.lr_scaling=linear", "cluster.tasks_per_node=1"]).to_dict(),
            "x",
        )


def test_a_run_stopped_on_two_ranks_resumes_on_one(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    over = [
        f"run.dir={d}",
        "task.target=testtasks:Signals",
        f"task.params.run_dir={d}",
        "task.params.signals=0:8:TERM",
    ]
    launch.run(2, "configs/tiny.yaml", [*over, "cluster.tasks_per_node=2"], d)
    st = rundir.read_json(rundir.RunPaths(d).status)
    assert st["state"] != "completed" and 0 < st["global_step"] < 18 and st["world_size"] == 2
    stopped_at = st["global_step"]
    assert launch.run(1, "configs/tiny.yaml", [*over, "cluster.tasks_per_node=1"], d) == [0]
    st = rundir.read_json(rundir.RunPaths(d).status)
    assert st["state"] == "completed" and st["global_step"] == 18 and st["world_size"] == 1
    text = "".join(
        open(os.path.join(d, n)).read()
        for n in sorted(os.listdir(d))
        if n.startswith("launch-rank0")
    )
    assert (
        "resumes with changed resources: cluster.tasks_per_node 2 -> 1 (resumes, not bitwise"
        in text
    )
    assert (
        f"resumed from {d}/checkpoints/step-{stopped_at}"
        in open(rundir.RunPaths(d).log_file(0, 1)).read()
    )


def test_a_cancelled_run_is_never_requeued(tmp_path, fake_slurm):
    """The job's own requeue (time limit, SIGTERM) checks the marker first: no scontrol requeue runs
    (here it would fail on the unknown job id and record "stopped")."""
    fake_slurm.answer("scontrol", stdout="JobId=99999 JobState=RUNNING BatchFlag=1\n")
    paths = rundir.RunPaths(str(tmp_path))
    cancel_marker.mark(rundir.RunPaths(str(tmp_path)), "99999")
    environ = {
        "SLURM_JOB_ID": "99999",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NODELIST": "n1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS_PER_NODE": "1",
    }
    env = DistEnv(source="slurm", job_id="99999")
    assert after_stop(paths, "timeout", env, environ, limit=5) == "timeout"
    assert rundir.read_json(paths.status)["state"] == "cancelled"
    assert not os.path.exists(paths.stops) or "requeue" not in open(paths.stops).read()
    assert not [c for c in fake_slurm.calls() if "requeue" in c], fake_slurm.calls()
