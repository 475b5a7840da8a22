"""The run dir is where the run lives: a moved or copied one resumes in its new place, bitwise
exact, and leaves the old one untouched; one job per run dir (a renewed lease)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import launch
import pytest
from conftest import REPO, run_cli, weights_equal

# Synchronous saves: a kill in step 10 then always finds step 8 committed, never still being
# written.
TASK = ["task.target=testtasks:KillAtEnv", "checkpoint.async=false"]
KILL10 = {
    "CLUSTERFLOW_TEST_KILL_AT": "10"
}  # every rank SIGKILLs itself during step 10: steps 4, 6, 8 committed


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    monkeypatch.delenv("CLUSTERFLOW_TEST_KILL_AT", raising=False)


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def tree(root):
    """Every file under root with its sha256: to show that a run dir was not touched."""
    out = {}
    for base, _, names in os.walk(root):
        for n in names:
            p = os.path.join(base, n)
            out[os.path.relpath(p, root)] = sha(p)
    return out


def attempts(run_dir):
    return len(open(os.path.join(run_dir, "attempts.jsonl")).read().splitlines())


def status(run_dir):
    return json.load(open(os.path.join(run_dir, "status.json")))


def steps(run_dir, sub="checkpoints"):
    return sorted(
        int(n[5:]) for n in os.listdir(os.path.join(run_dir, sub)) if n.startswith("step-")
    )


@pytest.fixture(scope="module")
def reference(tiny_two_rank_run):
    """An uninterrupted 2-rank run of tiny.yaml: its model.pt's sha256."""
    return sha(os.path.join(tiny_two_rank_run, "model.pt"))


def killed_at_step_10(run_dir, extra=()):
    """A 2-rank torchrun-style run of tiny.yaml killed (SIGKILL, every rank) during step 10."""
    os.environ.update(KILL10)
    try:
        codes = launch.run(2, "configs/tiny.yaml", [f"run.dir={run_dir}", *TASK, *extra], run_dir)
    finally:
        del os.environ["CLUSTERFLOW_TEST_KILL_AT"]
    assert codes == [-9, -9] or -9 in codes, codes


def test_moved_run_dir_resumes_in_its_new_place(tmp_path, reference):
    a, b = str(tmp_path / "runA"), str(tmp_path / "runB")
    killed_at_step_10(
        a, ["checkpoint.dir=ckpts"]
    )  # a relative checkpoint.dir lives inside the run dir
    assert steps(a, "ckpts") == [4, 6, 8]
    shutil.move(a, b)
    over = [f"run.dir={b}", *TASK, "checkpoint.dir=ckpts"]
    assert launch.run(2, "configs/tiny.yaml", over, os.path.join(str(tmp_path), "launch-logs")) == [
        0,
        0,
    ]
    assert not os.path.exists(a)  # never recreated
    assert sha(os.path.join(b, "model.pt")) == reference
    assert attempts(b) == 2 and status(b)["state"] == "completed"
    assert (
        "resumed from " + os.path.join(b, "ckpts", "step-8")
        in open(os.path.join(b, "logs", "rank0.attempt1.log")).read()
    )
    saved = open(os.path.join(b, "config.yaml")).read()
    manifest = json.load(open(os.path.join(b, "ckpts", "step-18", "manifest.json")))
    assert str(tmp_path) not in saved and str(tmp_path) not in json.dumps(
        manifest["config"]
    )  # no copy of its own path


def test_copied_run_dir_resumes_from_its_own_checkpoints_with_submit(tmp_path, reference):
    a, c = str(tmp_path / "runA"), str(tmp_path / "copy")
    killed_at_step_10(a)
    shutil.copytree(a, c)
    before = tree(a)
    # The copy's own config.yaml as the config file: the run lives where that file lies; a
    # longer time limit is a resource, taken on resume and named as the one difference.
    out = run_cli(
        "clusterflow.submit",
        os.path.join(c, "config.yaml"),
        "cluster.time_min=30",
        "--local",
        env={"PYTHONPATH": os.path.join(REPO, "tests")},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        f"run dir {c} exists with the same config but for resources: cluster.time_min 10 -> 30: "
        "resuming from its newest checkpoint"
    ) in out.stdout.splitlines(), out.stdout
    assert tree(a) == before  # the original is untouched
    assert sha(os.path.join(c, "model.pt")) == reference
    assert attempts(c) == 2 and attempts(a) == 1


def test_a_requeued_job_never_recreates_a_run_dir_moved_away(tmp_path):
    from types import SimpleNamespace

    from clusterflow import rundir
    from clusterflow.rundir import lease

    gone = str(tmp_path / "moved-away")
    env = SimpleNamespace(job_id="77", attempt=1, source="slurm")
    with pytest.raises(lease.RunDirBusy, match="is gone, but this is attempt 1 of job 77"):
        lease.hold(rundir.RunPaths(gone), env, 30, {"SLURM_JOB_ID": "77"})
    assert not os.path.exists(gone)


# -- one job per run dir ---------------------------------------------------------------------------


def lease_record(run_dir):
    from clusterflow import rundir
    from clusterflow.rundir import lease

    return lease.current(rundir.RunPaths(run_dir))[1]


def wait_for(fn, timeout=180):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if fn():
            return True
        time.sleep(0.1)
    return False


def start_submit(run_dir, *extra, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    e.update(env or {})
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            f"run.dir={run_dir}",
            *extra,
            "--local",
        ],
        cwd=REPO,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_second_job_on_a_held_run_dir_is_refused_and_the_first_completes(tmp_path, reference):
    d = str(tmp_path / "run")
    gate = tmp_path / "gate"  # the first job trains until the checks below are done
    gate.write_text("")
    slow = ["task.target=testtasks:Gated", f"task.params.gate={gate}"]
    first = start_submit(d, *slow)
    assert wait_for(
        lambda: (
            (lease_record(d) or {}).get("pid") and os.path.exists(os.path.join(d, "status.json"))
        )
    )
    holder = lease_record(d)
    config_before = sha(os.path.join(d, "config.yaml"))
    second = run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", *slow, "--local")
    assert second.returncode == 2, second.stdout + second.stderr
    assert (
        f"is held by submitit-local job {holder['job_id']} (pid {holder['pid']} on" in second.stderr
    )
    assert "Traceback" not in second.stderr
    # Past submit (torchrun-style, straight into the job): refused on every rank at job start.
    assert launch.run(2, "configs/tiny.yaml", [f"run.dir={d}", *slow], str(tmp_path / "other")) == [
        2,
        2,
    ]
    assert sha(os.path.join(d, "config.yaml")) == config_before and attempts(d) == 1
    gate.unlink()
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out + err
    assert status(d)["state"] == "completed" and sha(os.path.join(d, "model.pt")) == reference
    assert lease_record(d) is None  # released at the end


def test_a_killed_holder_is_taken_over_with_a_warning(tmp_path, reference):
    d = str(tmp_path / "run")
    first = start_submit(
        d, *TASK, env=KILL10
    )  # every rank is SIGKILLed during step 10: the lease stays behind
    first.communicate(timeout=600)
    dead = lease_record(d)
    assert dead and not os.path.exists(f"/proc/{dead['pid']}")
    out = run_cli("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", *TASK, "--local")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"was held by submitit-local job {dead['job_id']} (pid {dead['pid']} on" in out.stderr
    assert f"its process {dead['pid']} on" in out.stderr and "is gone; taking it over" in out.stderr
    assert sha(os.path.join(d, "model.pt")) == reference


def plant(run_dir, host, age_s, renew_s=1, slurm_job=""):
    """A lease record of a holder on another machine, last renewed ``age_s`` ago by the storage's
    clock."""
    from clusterflow import rundir
    from clusterflow.rundir import lease

    os.makedirs(rundir.RunPaths(run_dir).lease, exist_ok=True)
    rec = {
        "token": "t" * 32,
        "job_id": slurm_job or "elsewhere",
        "slurm_job": slurm_job,
        "source": "slurm" if slurm_job else "torchrun",
        "host": host,
        "pid": 4242,
        "pid_start": "1",
        "attempt": 0,
        "started_at": time.time() - 3600,
        "renewed_at": 0,
        "renewals": 9,
        "renew_s": renew_s,
    }
    path = os.path.join(rundir.RunPaths(run_dir).lease, "gen-3.json")
    with open(path, "w") as f:
        json.dump(rec, f)
    t = lease.storage_now(rundir.RunPaths(run_dir)) - age_s
    os.utime(path, (t, t))


def test_stale_and_fresh_leases_of_another_host(tmp_path):
    from clusterflow import rundir
    from clusterflow.rundir import lease

    me = lease.identity()
    d = str(tmp_path / "run")
    plant(d, "node-elsewhere", age_s=1, renew_s=30)
    with pytest.raises(
        lease.RunDirBusy,
        match=r"held by torchrun job elsewhere \(pid 4242 on node-elsewhere.*renewed 1 s ago",
    ):
        lease.check(rundir.RunPaths(d), me)
    plant(d, "node-elsewhere", age_s=200, renew_s=30)
    assert "its lease was not renewed for 200 s (more than 120 s); taking it over" in lease.check(
        rundir.RunPaths(d), me
    )


def test_a_stale_lease_is_taken_over_by_a_real_run(tmp_path, tiny_one_process_model):
    d = str(tmp_path / "run")
    plant(d, "node-elsewhere", age_s=500, renew_s=30)
    out = run_cli(
        "clusterflow.run", "configs/tiny.yaml", f"run.dir={d}", "cluster.tasks_per_node=1"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(
        r"was held by torchrun job elsewhere \(pid 4242 on node-elsewhere.*its lease was not "
        r"renewed for 5\d\d s \(more than 120 s\); taking it over",
        out.stderr,
    )
    assert weights_equal(os.path.join(d, "model.pt"), tiny_one_process_model)


def test_slurm_holders_are_judged_by_squeue_and_a_requeue_takes_its_own_lease():
    from clusterflow.rundir import lease

    rec = {"token": "x", "slurm_job": "123", "host": "node2", "pid": 5, "renew_s": 30}
    me = {"token": "y", "slurm_job": "", "host": "login1", "pid": 9}
    assert lease.judge(rec, 0, me, lambda j: "RUNNING|None") == (True, "Slurm job 123 is RUNNING")
    assert lease.judge(rec, 0, me, lambda j: "PENDING|BeginTime")[
        0
    ]  # requeued and waiting: it comes back
    assert lease.judge(rec, 0, me, lambda j: "") == (False, "Slurm job 123 is no longer queued")
    assert (
        lease.judge(rec, 10, me, lambda j: None)[0]
        and not lease.judge(rec, 121, me, lambda j: None)[0]
    )  # squeue silent
    assert lease.judge(rec, 0, {**me, "slurm_job": "123"}, lambda j: "RUNNING|None") == (
        False,
        "it is an earlier attempt of this same Slurm job",
    )


def _take(run_dir, go, results, hold_s):
    from clusterflow import rundir
    from clusterflow.rundir import lease

    go.wait()
    try:
        lease.acquire(
            rundir.RunPaths(run_dir), lease.identity(renew_s=30), on_lost=lambda why: None
        )
        results.put("won")
        time.sleep(hold_s)  # alive while the others judge it
    except lease.RunDirBusy as exc:
        results.put(str(exc))


def test_of_many_takers_at_once_exactly_one_wins(tmp_path):
    import multiprocessing as mp

    d = str(tmp_path / "run")
    plant(d, "node-elsewhere", age_s=500)
    ctx = mp.get_context("fork")
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_take, args=(d, go, results, 5)) for _ in range(8)]
    for p in procs:
        p.start()
    go.set()
    answers = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert answers.count("won") == 1, answers
    assert all(
        "is held by" in a and "its process" in a and "is alive on this host" in a
        for a in answers
        if a != "won"
    )
    from clusterflow import rundir

    assert [n for n in os.listdir(rundir.RunPaths(d).lease) if n.startswith("gen-")] == [
        "gen-4.json"
    ]


def test_a_holder_that_was_taken_over_finds_out_at_its_next_renewal(tmp_path):
    from clusterflow import rundir
    from clusterflow.rundir import lease

    d = str(tmp_path / "run")
    lost = []
    held = lease.acquire(rundir.RunPaths(d), lease.identity(renew_s=1), on_lost=lost.append)
    os.link(
        os.path.join(rundir.RunPaths(d).lease, f"gen-{held.gen}.json"),
        os.path.join(rundir.RunPaths(d).lease, f"gen-{held.gen + 1}.json"),
    )
    with open(os.path.join(rundir.RunPaths(d).lease, f"gen-{held.gen + 1}.json.new"), "w") as f:
        json.dump({**held.rec, "token": "someone-else", "pid": 1, "host": "node9"}, f)
    os.replace(
        os.path.join(rundir.RunPaths(d).lease, f"gen-{held.gen + 1}.json.new"),
        os.path.join(rundir.RunPaths(d).lease, f"gen-{held.gen + 1}.json"),
    )
    assert wait_for(lambda: lost, timeout=10)
    assert "lost run dir" in lost[0] and "pid 1 on node9" in lost[0]
    lease.release(rundir.RunPaths(d))
    assert os.path.exists(
        os.path.join(rundir.RunPaths(d).lease, f"gen-{held.gen + 1}.json")
    )  # never removes the new holder's


@pytest.mark.slow
def test_a_completed_task_run_given_more_epochs_trains_them_then_says_it_is_done(
    tiny_two_rank_run, tmp_path
):
    """A completed run submitted again with train.epochs raised trains the new epochs (submit
    rewrites config.yaml before the job starts: the job still sees what the run completed with),
    and the same command once more trains nothing, saying so."""
    d = str(tmp_path / "run")
    shutil.copytree(tiny_two_rank_run, d, symlinks=True)
    more = ("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", "train.epochs=4", "--local")
    out = run_cli(*more)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "completed at step 18 and trains on: train.epochs 3 -> 4" in out.stderr, out.stderr
    status = json.load(open(os.path.join(d, "status.json")))
    assert (status["state"], status["global_step"], status["epoch"]) == ("completed", 24, 4)
    again = run_cli(*more)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"run dir {d} already completed at step 24: nothing to train" in again.stdout
