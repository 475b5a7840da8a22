"""Job ids: the requeue target of an array task, a run's current job, --after dependencies, and
the job array submitit is handed for a sweep (parameters and the --dry-run script)."""

import os
import textwrap

import pytest

from clusterflow import rundir
from clusterflow.errors import UserError
from clusterflow.launch import stages
from clusterflow.rundir import submissions
from clusterflow.slurm import jobids, sbatch
from clusterflow.sweeps import sweep


@pytest.mark.parametrize(
    "env,target",
    [
        ({"SLURM_JOB_ID": "42"}, "42"),
        # an array task: always A_T, never the array id alone (which requeues every task,
        # Lightning #15022)
        ({"SLURM_JOB_ID": "45", "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "3"}, "42_3"),
        ({"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "7"}, "42_7"),
        ({"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "0"}, "42_0"),
        # the task id missing: its own job id still names it alone, unless that id is the array's
        ({"SLURM_JOB_ID": "45", "SLURM_ARRAY_JOB_ID": "42"}, "45"),
        ({"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "42"}, None),
        ({"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "x"}, None),
        ({"SLURM_JOB_ID": " 42 "}, "42"),
        ({"SLURM_JOB_ID": ""}, None),
        ({"SLURM_JOB_ID": "local"}, None),
        ({}, None),
    ],
)
def test_requeue_target(env, target):
    assert jobids.requeue_target(env) == target


def test_current_job_id_is_the_newest_slurm_record(tmp_path):
    d = str(tmp_path)
    assert submissions.current_job_id(rundir.RunPaths(d)) is None
    submissions.record_submission(rundir.RunPaths(d), "100_2", now=10.0)
    assert submissions.current_job_id(rundir.RunPaths(d)) == "100_2"  # pending: no attempt yet
    rundir.append_jsonl(
        rundir.RunPaths(d).attempts,
        {"attempt": 0, "job_id": "103", "started_at": 20.0, "source": "slurm"},
    )
    assert submissions.current_job_id(rundir.RunPaths(d)) == "103"  # the task's own id once it runs
    submissions.record_submission(rundir.RunPaths(d), "200", now=30.0)
    assert submissions.current_job_id(rundir.RunPaths(d)) == "200"  # a resubmission
    # a local run's job id is a process id: it must never reach scancel
    rundir.append_jsonl(
        rundir.RunPaths(d).attempts,
        {"attempt": 1, "job_id": "4242", "started_at": 40.0, "source": "submitit-local"},
    )
    assert submissions.current_job_id(rundir.RunPaths(d)) == "200"
    with pytest.raises(ValueError):
        submissions.record_submission(rundir.RunPaths(d), "local")


def test_after_dependency():
    assert (
        stages.after_dependency(
            [("s1", "running", "5"), ("s2", "pending", "6_1"), ("s3", "requeued", "5")]
        )
        == "afterok:5:6_1"
    )
    assert stages.after_dependency([("s1", "completed", "5")]) is None
    assert stages.after_dependency([("s1", None, "5")]) == "afterok:5"  # submitted, not started
    with pytest.raises(
        UserError,
        match=(
            "--after s1: that run is failed, so a job waiting for it to complete would never start"
        ),
    ):
        stages.after_dependency([("s1", "failed", "5")])
    with pytest.raises(UserError, match="--after s1: no Slurm job is known for that run"):
        stages.after_dependency([("s1", "running", None)])


@pytest.fixture
def members(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        textwrap.dedent(f"""
        run: {{dir: {tmp_path / "sw"}, name: lr-sweep}}
        cluster: {{nodes: 2, time_min: 30, partition: low}}
        train: {{epochs: 2, batch_size: 8}}
    """)
    )
    return sweep.expand(str(p), [], ["train.lr=0.1,0.2", "mining.k=5,10"])


def logs_folder(sweep_dir):
    return sbatch.job_folder(rundir.RunPaths(sweep_dir).slurm_logs)


def test_array_plan_holds_one_config_per_member_in_order(members):
    ms = members.members
    folder = logs_folder(members.paths.root)
    plan = sbatch.array_plan(folder, [m.config for m in ms], [m.name for m in ms], max_parallel=2)
    assert plan.names == [m.name for m in ms] and plan.max_num_timeout == 5 and plan.size == 4
    assert plan.parameters["array_parallelism"] == 2 and plan.parameters["nodes"] == 2
    assert plan.parameters["job_name"] == "lr-sweep"
    assert plan.folder == os.path.join(os.path.abspath(members.paths.root), "logs", "slurm", "%j")
    assert [c.run.dir for c in plan.configs] == [m.run_dir for m in ms]
    assert [(c.train.lr, c.mining.k) for c in plan.configs] == [
        (0.1, 5),
        (0.1, 10),
        (0.2, 5),
        (0.2, 10),
    ]
    # no more parallel tasks than members
    one = sbatch.array_plan(folder, [ms[0].config], [ms[0].name], 8)
    assert one.parameters["array_parallelism"] == 1
    with pytest.raises(UserError, match="--max-parallel 0: must be >= 1"):
        sbatch.array_plan(folder, [ms[0].config], [ms[0].name], 0)


def test_array_script_for_dry_run(members):
    ms = members.members
    folder = logs_folder(members.paths.root)
    plan = sbatch.array_plan(folder, [m.config for m in ms], [m.name for m in ms], max_parallel=3)
    script = sbatch.script(plan.folder, plan.parameters, python="python3", array_size=plan.size)
    for line in [
        "#SBATCH --array=0-3%3",
        "#SBATCH --requeue",
        "#SBATCH --nodes=2",
        "#SBATCH --partition=low",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --job-name=lr-sweep",
        "--kill-on-bad-exit=1",
    ]:
        assert line in script, line
    assert "%A_%a" in script and f"python3 -u -m submitit.core._submit {plan.folder}" in script
    one = sbatch.array_plan(plan.folder, [ms[0].config], [ms[0].name])
    # submitit submits a batch of one as a plain job
    assert "--array" not in sbatch.script(one.folder, one.parameters, array_size=one.size)


def test_members_with_different_resources_cannot_share_an_array(members, tmp_path):
    ms = members.members
    other = sweep.expand(
        str(tmp_path / "c.yaml"), ["cluster.time_min=60"], ["train.lr=0.1"]
    ).members[0]
    with pytest.raises(
        UserError, match="ask Slurm for different time; one job array has one set of resources"
    ):
        sbatch.array_plan(
            logs_folder(members.paths.root), [ms[0].config, other.config], [ms[0].name, "other"]
        )


def _probe(name):
    from clusterflow.slurm import jobids as j

    return name, j.requeue_target(os.environ), os.environ.get("SLURM_JOB_ID")


@pytest.mark.slurm
def test_a_real_array_runs_each_member_and_names_each_task_for_requeue(cluster, tmp_path):
    """The plan's parameters through submitit's batch() on the local cluster: one array, task i
    gets the i-th submission, and each task's requeue target is <array>_<i>."""
    import submitit

    p = tmp_path / "c.yaml"
    p.write_text(
        f"run: {{dir: {tmp_path / 'sw'}}}\ncluster: {{time_min: 5}}\ntrain: {{batch_size: 8}}\n"
    )
    ms = sweep.expand(str(p), ["cluster.tasks_per_node=1"], ["run.seed=1,2,3"]).members
    folder = logs_folder(os.path.dirname(ms[0].run_dir))
    plan = sbatch.array_plan(folder, [m.config for m in ms], [m.name for m in ms], max_parallel=2)
    ex = submitit.SlurmExecutor(folder=plan.folder, max_num_timeout=plan.max_num_timeout)
    params = dict(
        plan.parameters, setup=[f"export PYTHONPATH={os.path.dirname(os.path.abspath(__file__))}"]
    )
    ex.update_parameters(**params)
    with ex.batch():
        jobs = [ex.submit(_probe, name) for name in plan.names]
    array = jobs[0].job_id.split("_")[0]
    assert [j.job_id for j in jobs] == [f"{array}_{i}" for i in range(3)]
    results = [j.result() for j in jobs]
    assert [(r[0], r[1]) for r in results] == [
        (n, f"{array}_{i}") for i, n in enumerate(plan.names)
    ]
    # each task has its own SLURM_JOB_ID, and one of them is the array's own id: requeueing that
    # number would requeue the whole array
    assert len({r[2] for r in results}) == 3 and array in {r[2] for r in results}
