"""The sweep index (RUN_DIR/sweep.json), resubmission plans, and sweep status rows."""

import json
import os
import re
import textwrap
import time

import pytest
from conftest import write_status_record

from clusterflow import rundir
from clusterflow.errors import UserError
from clusterflow.manage import status, sweep_status
from clusterflow.sweeps import index as sweep_index
from clusterflow.sweeps import sweep


@pytest.fixture
def conf(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        textwrap.dedent(f"""
        run: {{dir: {tmp_path / "sw"}}}
        train: {{epochs: 2, batch_size: 8}}
    """)
    )
    return str(p)


def expand(conf, *overrides, axes=("train.lr=0.1,0.2", "mining.k=5,10")):
    return sweep.expand(conf, list(overrides), list(axes))


def test_index_round_trip_is_atomic_and_relative(conf, tmp_path):
    sw = expand(conf)
    assert sweep_index.read_index(sw.paths) is None and not sweep_index.is_sweep_dir(sw.paths)
    index, changes = sweep_index.merge(None, sw)
    assert changes == [] and [m["name"] for m in index["members"]] == [m.name for m in sw.members]
    index = sweep_index.record_submission(
        index, "123", {m.name: f"123_{i}" for i, m in enumerate(sw.members)}, now=5.0
    )
    with sweep_index.locked(sw.paths):
        sweep_index.write_index(sw.paths, index)
    assert sweep_index.is_sweep_dir(sw.paths) and sweep_index.read_index(sw.paths) == json.loads(
        json.dumps(index)
    )
    assert not [n for n in os.listdir(sw.paths.root) if n.startswith(".tmp-")]
    assert sweep_index.member_job_id(index, sw.members[2].name) == "123_2"
    # run dirs are stored by name only: a moved sweep dir still finds its members
    moved = str(tmp_path / "moved")
    os.rename(sw.paths.root, moved)
    there = rundir.RunPaths(moved)
    dirs = sweep_index.member_dirs(there, sweep_index.read_index(there))
    assert [d.root for d in dirs.values()] == [os.path.join(moved, m.name) for m in sw.members]


def test_a_damaged_index_or_a_single_run_dir_is_refused(conf, tmp_path):
    sw = expand(conf)
    os.makedirs(sw.paths.root)
    with open(sw.paths.sweep_index, "w") as f:
        f.write('{"version": 1, "memb')
    with pytest.raises(UserError, match="sweep.json cannot be read"):
        sweep_index.read_index(sw.paths)
    with open(sw.paths.sweep_index, "w") as f:
        json.dump({"version": 99, "members": []}, f)
    with pytest.raises(UserError, match="not a clusterflow sweep index of version 1"):
        sweep_index.read_index(sw.paths)
    # Members every reader takes a name (a folder of the sweep) and values from: anything else
    # is named, never a traceback of a reader that indexed it.
    for members, keys, said in (
        (["a string"], [], 'a member is "a string"'),
        ([{"name": "../../elsewhere", "values": {}}], [], "a member is"),
        ([{"name": "m", "values": [1]}], [], "a member is"),
        ([{"name": "m", "values": {}}], "train.lr", 'its keys are "train.lr"'),
    ):
        with open(sw.paths.sweep_index, "w") as f:
            json.dump({"version": 1, "keys": keys, "members": members}, f)
        with pytest.raises(UserError, match=f"sweep.json is damaged: {re.escape(said)}"):
            sweep_index.read_index(sw.paths)
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.yaml").write_text("{}")
    with pytest.raises(UserError, match="holds a single run"):
        sweep_index.read_index(rundir.RunPaths(str(single)))


def test_an_index_too_large_to_be_one_or_a_link_is_refused_unread(conf, tmp_path, cli):
    """sweep.json of 100 MB (sparse: nothing to write) is refused by its size before a byte of
    it is read, by the sweep's commands and the dashboard alike; a link is refused too."""
    sw = expand(conf)
    os.makedirs(sw.paths.root)
    with open(sw.paths.sweep_index, "wb") as f:
        f.truncate(100 * 2**20)
    with pytest.raises(UserError, match=r"sweep.json is 100 MiB, more than the 16 MiB it may hold"):
        sweep_index.read_index(sw.paths)
    out = cli("clusterflow.status", sw.paths.root)
    assert out.returncode == 2 and "is 100 MiB, more than the 16 MiB" in out.stderr, out.stderr
    os.remove(sw.paths.sweep_index)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"version": 1, "members": []}))
    os.symlink(other, sw.paths.sweep_index)
    with pytest.raises(UserError, match=r"sweep.json is a symbolic link \(to .*other.json\)"):
        sweep_index.read_index(sw.paths)


def test_resubmitting_the_same_sweep_merges_and_reports_resource_changes(conf):
    first, _ = sweep_index.merge(None, expand(conf, "cluster.time_min=60"))
    again = expand(conf, "cluster.time_min=240")
    index, changes = sweep_index.merge(first, again)
    assert [str(c) for c in changes] == ["cluster.time_min 60 -> 240"]
    assert index["members"] == first["members"] and index["base"]["cluster"]["time_min"] == 240
    # more values for the same keys add members after the known ones
    more = expand(conf, "cluster.time_min=240", axes=("train.lr=0.1,0.2,0.3", "mining.k=5,10"))
    index, _ = sweep_index.merge(index, more)
    assert [m["name"] for m in index["members"][:4]] == [m["name"] for m in first["members"]]
    assert len(index["members"]) == 6 and {
        m["values"]["train.lr"] for m in index["members"][4:]
    } == {0.3}


def test_another_sweep_into_the_same_dir_is_refused(conf):
    first, _ = sweep_index.merge(None, expand(conf))
    with pytest.raises(
        UserError, match="holds a sweep over train.lr, mining.k; this one sweeps train.lr, run.seed"
    ):
        sweep_index.merge(first, expand(conf, axes=("train.lr=0.1,0.2", "run.seed=1,2")))
    with pytest.raises(
        UserError,
        match=r"another config \(train.epochs 2 -> 3\); to resume it, submit the same config",
    ):
        sweep_index.merge(first, expand(conf, "train.epochs=3"))


def test_lock_refuses_a_second_submission_at_once(tmp_path):
    with (
        sweep_index.locked(rundir.RunPaths(str(tmp_path))),
        pytest.raises(UserError, match="another submission of the sweep"),
        sweep_index.locked(rundir.RunPaths(str(tmp_path))),
    ):
        pass
    with sweep_index.locked(rundir.RunPaths(str(tmp_path))):  # released
        pass


def test_plan_skips_completed_active_and_cancelled_and_resumes_the_rest():
    names = ["a", "b", "c", "d", "e", "f", "g"]
    states = {
        "a": "completed",
        "b": "running",
        "c": "requeued",
        "d": "failed",
        "e": "stopped",
        "f": "cancelled",
    }
    p = sweep_index.plan(names, states)
    assert p.new == ["g"] and p.resume == ["d", "e"] and p.to_submit == ["d", "e", "g"]
    assert p.skip == {
        "a": "completed",
        "b": "still running",
        "c": "still requeued",
        "f": "cancelled (delete its cancelled.json to resume it)",
    }
    assert sweep_index.plan(names, {n: "completed" for n in names}).to_submit == []


def _member_run(run_dir, **st):
    os.makedirs(run_dir, exist_ok=True)
    paths = rundir.RunPaths(run_dir)
    with open(paths.config, "w") as f:
        f.write("run: {dir: x}\n")
    if st:
        write_status_record(run_dir, updated_at=time.time(), **st)
        rundir.record_attempt(paths, job_id=st.get("job_id"), source="slurm")


def test_status_rows_of_a_sweep(conf, fake_slurm):
    sw = expand(conf)
    index, _ = sweep_index.merge(None, sw)
    index = sweep_index.record_submission(
        index, "77", {m.name: f"77_{i}" for i, m in enumerate(sw.members[:3])}
    )
    sweep_index.write_index(sw.paths, index)
    m0, m1, m2, _ = (m.run_dir for m in sw.members)
    _member_run(
        m0,
        state="completed",
        epoch=2,
        global_step=40,
        last_loss=0.25,
        job_id="78",
        mining=[
            {
                "epoch": 1,
                "num_clusters": 3,
                "num_singletons": 0,
                "largest_cluster": 5,
                "nmi": 0.5,
                "ari": 0.4,
            },
            {
                "epoch": 2,
                "num_clusters": 3,
                "num_singletons": 0,
                "largest_cluster": 5,
                "nmi": 0.9,
                "ari": 0.8,
            },
        ],
    )
    _member_run(m1, state="failed", epoch=1, global_step=7, job_id="79", error="rank 1: boom")
    _member_run(m2)  # submitted, not started
    # Slurm has forgotten the made-up jobs: the test's own answer, never the live queue's (whose
    # real jobs can hold these ids)
    fake_slurm.forgot_every_job()
    rows = sweep_status.collect(sw.paths, status.collect)
    assert [r["state"] for r in rows] == ["completed", "failed", "pending", "not submitted"]
    r = rows[0]
    assert (
        r["train.lr"],
        r["mining.k"],
        r["epoch"],
        r["global_step"],
        r["last_loss"],
        r["nmi"],
        r["ari"],
        r["job_id"],
    ) == (0.1, 5, 2, 40, 0.25, 0.9, 0.8, "78")
    assert r["run_dir"] == m0 and rows[2]["job_id"] == "77_2" and rows[3]["job_id"] is None
    assert rows[1]["error"] == "rank 1: boom" and rows[1]["nmi"] is None
    json.dumps(rows)  # the --json list
    table = sweep_status.render(rows, sweep_status.keys_of(sw.paths)).splitlines()
    assert table[0].split() == [
        "lr",
        "k",
        "state",
        "epoch",
        "step",
        "loss",
        "nmi",
        "ari",
        "job",
        "run",
        "dir",
    ]
    assert table[1].split()[:9] == [
        "0.1",
        "5",
        "completed",
        "2",
        "40",
        "0.2500",
        "0.900",
        "0.800",
        "78",
    ]
    assert table[4].split()[:9] == ["0.2", "10", "not", "submitted", "-", "-", "-", "-", "-"]
    assert table[-1] == "4 member(s), 1 completed"
    with pytest.raises(UserError, match="not a sweep dir"):
        sweep_status.collect(rundir.RunPaths(m0), status.collect)
