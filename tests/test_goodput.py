"""The goodput ledger and the straggler watch: pure checks over written records, then two real
2-rank local runs shared by every assertion on them (one killed and resumed with no slow rank,
one with rank 1 made 1.5x slower per step)."""

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from clusterflow import rundir
from clusterflow.config.job_config import load
from clusterflow.errors import UserError
from clusterflow.observe import goodput
from clusterflow.observe.stragglers import StragglerWatch
from clusterflow.rundir import stragglers, timeline

WINDOW_S = 2.0
# The test tasks (tests/testtasks.py) on the path of every process a run starts.
ENV = {
    "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")])
}
TASK = (
    "task.target=testtasks:SlowRankKill",
    "checkpoint.async=false",
    "dist.heartbeat_s=0.5",
    f"observe.straggler_window_s={WINDOW_S}",
)


def _sums_to_wall(row):
    parts = row["seconds"]
    assert all(v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(row["wall_s"], rel=0.01, abs=1e-6)


# -- pure: the ledger over records written by hand --------------------------------------------


def _records(d, attempts, timelines):
    paths = rundir.RunPaths(str(d))
    os.makedirs(d, exist_ok=True)
    open(paths.config, "w").close()
    for a in attempts:
        rundir.append_jsonl(paths.attempts, a)
    for tl in timelines:
        timeline.write(paths, tl)
    return paths


def test_an_in_job_restart_is_its_own_attempt_with_no_queue_and_slurm_times_are_used(tmp_path):
    """Two attempts in one Slurm job and one Slurm run (a new srun step): the second starts when
    the first ended, its steps up to the first's last recorded step are recomputed."""
    job = {"job_id": "42", "source": "slurm", "restart_count": 0, "world_size": 4}
    paths = _records(
        tmp_path / "run",
        [{**job, "attempt": 0, "started_at": 1005.0}, {**job, "attempt": 1, "started_at": 1105}],
        [
            {
                "attempt": 0,
                "process_started_at": 1002.0,
                "restored_step": 0,
                "restore_s": 0.0,
                "first_step_at": 1010.0,
                "last_step": 50,
                "written_at": 1090.0,
                "seconds": {"train": 60.0, "eval": 5.0, "mining": 10.0, "checkpoint": 5.0},
                "commit": {
                    "step": 40,
                    "at": 1080.0,
                    "seconds": {"train": 50.0, "eval": 5.0, "mining": 10.0, "checkpoint": 4.0},
                },
            },
            {
                "attempt": 1,
                "process_started_at": 1100.0,
                "restored_step": 40,
                "restore_s": 3.0,
                "first_step_at": 1110.0,
                "last_step": 100,
                "written_at": 1170.0,
                "ended_at": 1170.0,
                "outcome": "completed",
                "seconds": {"train": 60.0},
            },
        ],
    )
    rundir.append_jsonl(paths.submissions, {"job_id": "42", "submitted_at": 900.0})
    runs = {"42": [{"restart": 0, "submit": 900, "start": 1000, "end": 1175, "source": "sacct"}]}
    book = goodput.ledger(paths, runs, running=False)
    first, second = book["attempts"]
    for row in (first, second):
        _sums_to_wall(row)
    assert first["seconds"]["queue_wait"] == 100  # submitted at 900, Slurm started it at 1000
    assert first["seconds"]["startup"] == 10  # to its first step at 1010
    # Killed after its last record (1090): no end of its own, the next attempt starts there.
    assert first["wall_s"] == 190 and first["seconds"]["other"] == 0
    assert first["seconds"]["eval"] == 5 and first["seconds"]["mining"] == 10
    # A checkpoint second after its last commit was work no attempt kept; steps 41-50 were
    # progress then, and are the next attempt's recomputed steps (counted once, there).
    assert first["seconds"]["lost"] == 1 and first["seconds"]["productive"] == 60
    assert second["seconds"]["queue_wait"] == 0
    assert second["sources"]["allocated"].startswith("previous attempt's end")
    assert second["seconds"]["restore"] == 3
    assert second["seconds"]["startup"] == 20 - 3  # 1090 -> 1110, less the restore
    assert second["steps"] == {"restored": 40, "last": 100, "recomputed": 10, "lost": 0}
    assert second["seconds"]["recomputed"] == pytest.approx(10)  # 10 of 60 steps of 60 s
    assert second["seconds"]["shutdown"] == 5  # 1170 -> Slurm's end 1175
    assert second["sources"]["ended"] == "sacct"
    total = book["total"]
    assert total["wall_s"] == 275  # from the submission to Slurm's end
    assert total["ratio"] == pytest.approx((first["seconds"]["productive"] + 50) / (275 - 100))


def test_clocks_that_disagree_never_make_a_negative_part(tmp_path):
    """A first step recorded before the process started and phases longer than the span: each
    instant is clamped between its neighbours and the phases scaled; the rest is explicit."""
    paths = _records(
        tmp_path / "run",
        [{"attempt": 0, "started_at": 100.0, "source": "local", "world_size": 1}],
        [
            {
                "attempt": 0,
                "process_started_at": 100.0,
                "first_step_at": 90.0,
                "last_step": 10,
                "written_at": 110.0,
                "ended_at": 110.0,
                "outcome": "completed",
                "seconds": {"train": 30.0, "eval": 10.0},
            }
        ],
    )
    (row,) = goodput.ledger(paths, running=False)["attempts"]
    _sums_to_wall(row)
    assert row["seconds"]["startup"] == 0
    assert row["seconds"]["productive"] + row["seconds"]["eval"] == pytest.approx(10)


def test_a_straggler_is_named_once_after_its_window_and_a_recovered_rank_starts_over(tmp_path):
    paths = rundir.RunPaths(str(tmp_path))

    def ranks(*busy):
        return [
            {"rank": r, "host": f"n{r}", "phase": "train", "silent": False, "busy_s": b}
            for r, b in enumerate(busy)
        ]

    watch = StragglerWatch(paths, attempt=3, ratio=1.2, window_s=10)
    assert watch.update(ranks(1.0, 1.0, 1.5), now=0) == []
    assert watch.update(ranks(1.0, 1.0, 1.1), now=5) == []  # recovered: the clock starts over
    assert watch.update(ranks(1.0, 1.0, 1.5), now=6) == []
    assert watch.update(ranks(1.0, 1.0, 1.5), now=15) == []  # 9 s: not yet
    mining = [{**r, "phase": "mining embed"} for r in ranks(1.0, 1.0, 1.0)]
    assert watch.update(mining, now=16) == []  # not training: no score, the clock runs on
    assert watch.update(ranks(1.0, 1.0, 1.5), now=16) == [2]
    assert watch.update(ranks(1.0, 1.0, 1.5), now=30) == []  # named once per attempt
    (named,) = stragglers.read(paths)
    assert named["rank"] == 2 and named["node"] == "n2" and named["ratio"] == 1.5
    assert named["attempt"] == 3 and named["time"] - named["since"] == 10
    assert stragglers.straggler_nodes(paths) == ["n2"]
    assert stragglers.straggler_nodes(paths, attempt=4) == []


def test_straggler_keys_are_checked(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {dir: x}\n")
    assert load(str(cfg)).observe.straggler_ratio == 1.2
    assert load(str(cfg)).cluster.exclude_stragglers is False
    with pytest.raises(UserError, match=r"observe.straggler_ratio = 1.0: must be 0 \(off\)"):
        load(str(cfg), ["observe.straggler_ratio=1.0"])
    with pytest.raises(UserError, match="observe.straggler_window_s = -1"):
        load(str(cfg), ["observe.straggler_window_s=-1"])


# -- the CLI's refusals -------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["missing", "not a run dir"])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, what):
    target = tmp_path / "nothing"
    if what == "not a run dir":
        target.mkdir()
    out = run_cli("clusterflow.goodput", str(target), "--json")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(target) in lines[0]
    assert ("does not exist" if what == "missing" else "no config.yaml") in lines[0]


# -- a real run, killed and resumed, no slow rank ------------------------------------------------


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """configs/tiny.yaml on 2 local ranks, 0.4 s per step, killed at step 12 (checkpoint at 8,
    the timeline's last record at step 11), then resumed to the end."""
    d = str(tmp_path_factory.mktemp("goodput") / "run")
    args = ("clusterflow.submit", "configs/tiny.yaml", f"run.dir={d}", *TASK)
    args += ("task.params.step_sleep=0.4", "--local")
    killed = run_cli(*args, env={**ENV, "CLUSTERFLOW_TEST_KILL_AT": "12"})
    assert killed.returncode != 0, killed.stdout + killed.stderr
    done = run_cli(*args, env=ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    out = run_cli("clusterflow.goodput", d, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return d, json.loads(out.stdout)


def test_every_attempt_of_a_killed_and_resumed_run_sums_to_its_wall_time(resumed):
    _, book = resumed
    first, second = book["attempts"]
    for row in book["attempts"]:
        _sums_to_wall(row)
    assert sum(book["total"]["seconds"].values()) == pytest.approx(book["total"]["wall_s"], 0.01)
    assert first["outcome"] is None and first["steps"]["last"] == 11
    assert second["outcome"] == "completed" and second["steps"]["restored"] == 8
    assert second["steps"]["recomputed"] == 3  # steps 9-11, trained by the killed attempt
    for k in ("restore", "recomputed", "productive", "mining", "startup"):
        assert second["seconds"][k] > 0, k
    assert first["seconds"]["productive"] > 0 and first["seconds"]["checkpoint_stall"] > 0
    assert second["ranks"] == 2 and 0 < book["total"]["ratio"] < 1
    assert book["total"]["gpu_seconds"]["productive"] == pytest.approx(
        2 * book["total"]["seconds"]["productive"]
    )


def test_nobody_is_named_when_no_rank_is_slow(resumed):
    d, book = resumed
    paths = rundir.RunPaths(d)
    # The watch had what it needs: busy times in the heartbeats, training longer than the window.
    beats = [json.load(open(paths.heartbeat_file(r))) for r in (0, 1)]
    assert all(b.get("busy_s") for b in beats), beats
    assert timeline.read_all(paths)[1]["seconds"]["train"] > WINDOW_S
    assert not os.path.exists(paths.stragglers)
    assert all(row["stragglers"] == [] for row in book["attempts"])


def test_status_tensorboard_and_the_table_show_the_ratio(resumed, tmp_path):
    d, book = resumed
    out = run_cli("clusterflow.status", d, "--json")
    status = json.loads(out.stdout)
    assert status["goodput"]["ratio"] == pytest.approx(book["total"]["ratio"], rel=1e-6)
    assert "goodput " in run_cli("clusterflow.status", d).stdout
    rows = [json.loads(line) for line in open(rundir.RunPaths(d).metrics)]
    ends = [r for r in rows if "goodput/ratio" in r]
    assert [r["attempt"] for r in ends] == [1] and 0 < ends[0]["goodput/ratio"] < 1
    png = tmp_path / "g.png"
    table = run_cli("clusterflow.cli", "goodput", d, "--plot", str(png))
    assert table.returncode == 0, table.stderr
    assert "recomputed steps" in table.stdout and "goodput" in table.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- a real run with rank 1 made 1.5x slower per step --------------------------------------------


@pytest.fixture(scope="module")
def straggling(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("straggler") / "run")
    out = run_cli(
        "clusterflow.submit",
        "configs/tiny.yaml",
        f"run.dir={d}",
        *TASK,
        "task.params.step_sleep=0.1",
        "task.params.slow_rank=1",
        "mining.enabled=false",
        "train.eval_every_epochs=0",
        "train.epochs=5",
        "--local",
        env=ENV,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return d


def test_a_rank_slowed_1_5x_is_named_with_its_node_in_the_log_status_and_ledger(straggling):
    d = straggling
    paths = rundir.RunPaths(d)
    host = socket.gethostname()
    (named,) = stragglers.read(paths)
    assert named["rank"] == 1 and named["node"] == host and named["attempt"] == 0
    assert named["ratio"] > 1.2 and named["time"] - named["since"] >= WINDOW_S
    assert stragglers.straggler_nodes(paths) == [host]
    log = open(paths.log_file(0, 0)).read()
    assert f"straggler: rank 1 on {host} at " in log
    ranks = run_cli("clusterflow.status", d, "--ranks").stdout
    assert f"straggler: rank 1 on {host}" in ranks
    table = run_cli("clusterflow.goodput", d).stdout
    assert f"straggler: attempt 0 rank 1 on {host}" in table


def test_plot_without_matplotlib_is_refused_in_one_line(resumed, tmp_path):
    d, _ = resumed
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from clusterflow.manage.goodput import main; sys.exit(main(sys.argv[1:]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, d, "--plot", str(tmp_path / "g.png")],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "error: --plot needs matplotlib, which is not installed; pip install 'clusterflow[plot]'"
    )
    assert not (tmp_path / "g.png").exists()


def test_a_sweep_dir_gives_one_ledger_per_member_that_started(tmp_path, capsys):
    from clusterflow.manage.goodput import main

    sweep = tmp_path / "sweep"
    members = [{"name": "lr-0.1"}, {"name": "lr-0.2"}]
    os.makedirs(sweep)
    (sweep / "sweep.json").write_text(json.dumps({"version": 1, "members": members, "keys": []}))
    _records(
        sweep / "lr-0.1",
        [{"attempt": 0, "started_at": 10.0, "source": "local", "world_size": 2}],
        [
            {
                "attempt": 0,
                "process_started_at": 9.0,
                "first_step_at": 12.0,
                "last_step": 4,
                "written_at": 20.0,
                "ended_at": 20.0,
                "outcome": "completed",
                "seconds": {"train": 8},
            }
        ],
    )
    assert main([str(sweep), "--json"]) == 0
    (book,) = json.loads(capsys.readouterr().out)  # lr-0.2 has not started: no config.yaml
    assert book["run_dir"].endswith("lr-0.1") and book["total"]["ratio"] == pytest.approx(8 / 11)
