"""`clusterflow check` (launch/check.py, train/probe.py, checkpoint/compare.py) and the files a
script's arguments name (rundir/script_files.py).

In process: which words name files and the refusal of a resume once one changed (the rule every
launch and attempt goes through); the verdict over each kind of difference, on records built
here; the tensor-by-tensor comparison of two real checkpoints. As real processes (slow: each
check is three local launches): the check passes a step-style loop without real data (1 rank)
and the converted DDP script (2 ranks), and names a prefetch, an unregistered counter and a
config file edited while the runs go on (1 rank), each at the step where it first shows."""

import json
import os

import pytest
import torch
from conftest import REPO, run_cli

from clusterflow.checkpoint import compare
from clusterflow.errors import UserError
from clusterflow.job.script import by_hand
from clusterflow.launch import check
from clusterflow.rundir import saved_config, script_files
from clusterflow.storage.names import MODEL, TRAIN_STATE
from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH

OWNLOOP = os.path.join(REPO, "tests", "ownloop")
CASES = os.path.join(OWNLOOP, "check_cases.py")


# -- the files a script's arguments name ----------------------------------------------------------


def test_the_files_a_scripts_arguments_name_are_recorded_with_their_digests(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text("lr: 0.1\n")
    (tmp_path / "train.py").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / "big.bin").write_bytes(b"x" * 64)
    monkeypatch.setattr(script_files, "MAX_BYTES", 32)
    args = ["--config", "cfg.yaml", "--init=train.py", "data=data", "x=big.bin", "--lr", "0.1"]
    assert script_files.candidates(args) == ["cfg.yaml", "train.py", "data", "big.bin", "0.1"]
    got = script_files.named(args)
    assert sorted(got) == ["cfg.yaml", "train.py"], got  # no folder, nothing too large
    assert got["cfg.yaml"] == script_files.digest("cfg.yaml") and len(got["cfg.yaml"]) == 16
    cfg = saved_config.load_command(None, ["run.dir=r"], "train.py", args)
    assert cfg.script.files == got
    # A script started by hand records them too; script.files={} records none.
    assert by_hand(None, {}, ["train.py", *args]).script.files == got
    assert saved_config.load_command(None, ["script.files={}"], "train.py", args).script.files == {}


@pytest.fixture
def started(tmp_path, monkeypatch):
    """A script's run that started with cfg.yaml named in its arguments and committed a
    checkpoint: (its config, the run dir)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text("lr: 0.1\n")
    (tmp_path / "train.py").write_text("")
    d = str(tmp_path / "run")
    cfg = saved_config.load_command(None, [f"run.dir={d}"], "train.py", ["--config", "cfg.yaml"])
    saved_config.resolve(cfg)
    CheckpointStore(os.path.join(d, "checkpoints")).save(2, {"state.bin": b"..."})
    return cfg, d


def test_a_resume_after_the_file_changed_is_refused_naming_it_and_the_fix(started, tmp_path):
    cfg, d = started
    again = saved_config.load_command(None, [f"run.dir={d}"], "train.py", ["--config", "cfg.yaml"])
    assert saved_config.resolve(again)[1]  # unchanged: resumed
    (tmp_path / "cfg.yaml").write_text("lr: 0.2\n")
    for relaunch in (False, True):  # a new launch, and a requeue of the job on its saved config
        with pytest.raises(UserError) as e:
            saved_config.resolve(cfg, relaunch=relaunch)
        said = str(e.value)
        assert said.startswith("cfg.yaml, a file named in the script's arguments, changed"), said
        assert f"since run dir {d!r} started" in said and "put the file back" in said, said
        assert "run.dir=<new path>" in said and "\n" not in said
    (tmp_path / "cfg.yaml").unlink()
    with pytest.raises(UserError, match=r"cfg.yaml, a file named .* is gone \(looked in "):
        saved_config.resolve(cfg)
    (tmp_path / "cfg.yaml").write_text("lr: 0.1\n")  # put back: the run resumes
    assert saved_config.resolve(cfg)[1]


def test_a_file_the_run_created_since_it_started_is_no_change(started, tmp_path):
    _, d = started
    args = ["--config", "cfg.yaml", "--out", "out.json"]
    first = saved_config.load_command(None, [f"run.dir={d}-2"], "train.py", args)
    saved_config.resolve(first)
    CheckpointStore(os.path.join(d + "-2", "checkpoints")).save(2, {"state.bin": b"..."})
    (tmp_path / "out.json").write_text("{}")  # written by the run
    again = saved_config.load_command(None, [f"run.dir={d}-2"], "train.py", args)
    resolved, resumed = saved_config.resolve(again)
    assert resumed and resolved.script.files == first.script.files == {"cfg.yaml": ANY_DIGEST}


class _AnyDigest:
    def __eq__(self, other):
        return isinstance(other, str) and len(other) == script_files.DIGEST_CHARS


ANY_DIGEST = _AnyDigest()


# -- the verdict ----------------------------------------------------------------------------------


def test_the_plan_kills_between_two_checkpoints_and_costs_at_most_2_25_n():
    for n in range(check.MIN_STEPS, 40):
        p = check.plan(n)
        assert p.every < p.kill < min(2 * p.every, n), p  # a checkpoint before, none at the kill
        assert n + p.kill + (n - p.every) <= 2.25 * n, p
    assert check.plan(8) == check.Plan(8, 4, 6)


def _rows(losses, lrs=None, inputs=None):
    """One rank's records of steps 1..n."""
    return {
        s: {
            "loss": loss,
            "lr": [(lrs or {}).get(s, 0.1)],
            "inputs": (inputs or {}).get(s, f"batch{s}"),
        }
        for s, loss in enumerate(losses, 1)
    }


def _evidence(resumed, killed=None, files=None, final=(), refused="", reference=None):
    reference = reference or {0: _rows([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])}
    p = check.plan(8)
    return check.Evidence(
        p,
        1,
        reference,
        killed or {0: {s: r for s, r in reference[0].items() if s <= p.kill}},
        {0: {s: r for s, r in resumed.items() if s > 4}},
        4,
        files or [{"cfg.yaml": "a"}] * 4,
        list(final),
        10,
        refused,
    )


def test_the_verdict_names_the_first_step_that_differs_and_its_cause():
    same = _rows([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    exact, line = check.verdict(_evidence(same))
    assert exact and line.startswith("exact: 8 steps on 1 rank(s), killed at step 6"), line
    assert "resumed from the checkpoint of step 4" in line and "(10 tensors" in line

    # nanoGPT's prefetch: after the resume each step trains the batch of the step after it.
    shifted = _rows(
        [1.0, 0.9, 0.8, 0.7, 0.55, 0.45, 0.35, 0.25],
        inputs={5: "batch6", 6: "batch7", 7: "batch8", 8: "batch9"},
    )
    exact, line = check.verdict(_evidence(shifted))
    assert not exact and line.startswith("not exact: step 5 (the resume restored step 4"), line
    assert "the batch the uninterrupted run trained at step 6" in line, line
    assert "(a prefetch)" in line and "draw each step's batch after the previous run.step" in line
    # Dropout drew between two batches: no batch is shifted, but the uninterrupted run's
    # forward took variables the script held, new, at the step before.
    carried = {0: _rows([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])}
    carried[0][5]["carried"] = ["x", "y"]
    resumed = _rows([1.0, 0.9, 0.8, 0.7, 0.61, 0.5, 0.4, 0.3], inputs={5: "other"})
    line = check.verdict(_evidence(resumed, reference=carried))[1]
    assert "step 5 trained x, y, which the script drew during step 4, before its run.step" in line
    assert "(a prefetch)" in line, line

    # The batches started over (a position or generator of the script's own went back).
    other = _rows([1.0, 0.9, 0.8, 0.7, 0.2, 0.5, 0.4, 0.3], inputs={5: "batch1"})
    line = check.verdict(_evidence(other))[1]
    assert line.startswith("not exact: step 5") and "the one of step 1" in line, line
    assert "started over" in line and "(an unregistered counter)" in line, line
    other = _rows([1.0, 0.9, 0.8, 0.7, 0.2, 0.5, 0.4, 0.3], inputs={5: "elsewhere"})
    line = check.verdict(_evidence(other))[1]
    assert "a random generator of its own, or a file read live" in line, line

    # The schedule's counter went back: another learning rate on the same batch.
    lr = _rows([1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.45, 0.35], lrs={5: 0.5})
    line = check.verdict(_evidence(lr))[1]
    assert line.startswith("not exact: step 5") and "the learning rate is 0.5 after" in line
    assert "0.1 in the uninterrupted run" in line and "(an unregistered counter)" in line, line

    # Another loss on the same batch and learning rate: a state the step reads is not saved.
    loss = _rows([1.0, 0.9, 0.8, 0.7, 0.6, 0.51, 0.4, 0.3])
    line = check.verdict(_evidence(loss))[1]
    assert line.startswith("not exact: step 6") and "(a state not registered" in line, line

    # Two runs differ before any kill: nondeterminism, whatever the resume did after.
    killed = {0: _rows([1.0, 0.9, 0.81, 0.7, 0.6, 0.5])}
    line = check.verdict(_evidence(shifted, killed=killed))[1]
    assert line.startswith("not exact: step 3: two runs differ before any kill"), line
    assert "not deterministic" in line and "nondeterministic kernel" in line

    # A file named in the arguments changed while the runs went on: named first.
    files = [{"cfg.yaml": "a"}, {"cfg.yaml": "b"}, {"cfg.yaml": "b"}, {"cfg.yaml": "b"}]
    line = check.verdict(_evidence(same, killed=killed, files=files, refused="cfg.yaml ..."))[1]
    assert line.startswith("not exact: step 3: cfg.yaml (digest a -> b), named in the"), line
    assert "a file read live" in line and "its resume was refused" in line

    line = check.verdict(_evidence({}, refused="checkpoint.dir changed ..."))[1]
    assert line == (
        "not exact: step 5 (the first after the checkpoint of step 4): the resume was refused: "
        "checkpoint.dir changed ..."
    )

    # Every step alike, the saved state not: a state no checkpoint holds fed a registered one.
    exact, line = check.verdict(_evidence(same, final=["counters['seen'] (3 vs 5)"]))
    assert not exact and line.startswith("not exact: step 8 (the final state): counters"), line


# -- the final state, tensor by tensor ------------------------------------------------------------


def _checkpoint(root, step, weight, momentum, rng, counters, resumed_at=8, seconds=0.5):
    """A checkpoint as the checkpointer writes one; ``resumed_at``: where a second attempt took
    over the epoch's samples (16: none did), ``seconds``: what its mining round took."""
    ranges = [
        {"start": 0, "end": resumed_at, "attempt": 0, "world_size": 1, "batch_size": 4},
        {"start": resumed_at, "end": 16, "attempt": 1, "world_size": 1, "batch_size": 4},
    ]
    model = {"fc.weight": weight, "fc.bias": torch.zeros(2)}
    state = {
        "optimizer": {"state": {0: {"momentum_buffer": momentum}}, "param_groups": [{"lr": 0.1}]},
        "counters": counters,
        "train": {
            "global_step": step,
            "ledger": [{"epoch": 0, "ranges": [r for r in ranges if r["start"] < r["end"]]}],
            "mining_history": [{"epoch": 1, "num_clusters": 3, "seconds": seconds}],
        },
        "rng": [{"torch": rng}],
        "world_size": 1,
        "checkpoint": {"id": os.path.basename(root), "step": step},
    }
    CheckpointStore(root, codec=TORCH).save(step, {MODEL: model, TRAIN_STATE: state})


def test_two_checkpoints_compare_tensor_by_tensor_by_the_names_the_script_gave(tmp_path):
    w, m, r = torch.randn(2, 3), torch.randn(2, 3), torch.arange(5, dtype=torch.uint8)
    a, b, c = (str(tmp_path / name) for name in "abc")
    _checkpoint(a, 8, w, m, r, {"seen": 3})
    # Another id, one attempt's range of the ledger where a has two, another mining time: the
    # same state.
    _checkpoint(b, 8, w.clone(), m.clone(), r.clone(), {"seen": 3}, resumed_at=16, seconds=2.0)
    assert compare.differences(a, b, 8) == (4, [])
    w2, r2 = w.clone(), r.clone()
    w2[1, 2] += 0.25
    r2[0] = 9
    _checkpoint(c, 8, w2, m, r2, {"seen": 5})
    n, found = compare.differences(a, c, 8)
    assert n == 4
    assert found == [
        "model['fc.weight'] (max |difference| 0.25)",
        "counters['seen'] (3 vs 5)",
        "rng of rank 0['torch'] (1 of 5 values differ)",
    ], found
    assert check.by_state(found + ["model['fc.bias'] (max |difference| 1)"]).startswith(
        "model (2 entries, e.g. model['fc.weight'] (max |difference| 0.25)); counters (1 entry, "
    )


# -- real runs ------------------------------------------------------------------------------------


def run_check(tmp_path, *words, script=CASES):
    out = run_cli(
        "clusterflow.check",
        "--script",
        script,
        f"run.dir={tmp_path / 'runs' / 'x'}",
        *words,
        cwd=str(tmp_path),
        timeout=900,
    )
    lines = out.stdout.strip().splitlines()
    verdict = next((line for line in lines if line.startswith(("exact", "not exact:"))), "")
    return out, verdict


@pytest.mark.slow
def test_a_loop_without_real_data_and_its_config_file_resumes_exactly(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"lr": 0.01}))
    out, verdict = run_check(tmp_path, "--", "--config", "cfg.json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert verdict.startswith("exact: 8 steps on 1 rank(s), killed at step 6"), out.stdout
    assert "resumed from the checkpoint of step 4" in verdict
    assert os.listdir(tmp_path / "runs") == []  # an exact check leaves nothing behind


@pytest.mark.slow
def test_a_prefetch_is_named_at_the_first_step_after_the_resume(tmp_path):
    out, verdict = run_check(tmp_path, "--", "--prefetch")
    assert out.returncode == check.EXIT_NOT_EXACT, out.stdout + out.stderr
    assert verdict.startswith("not exact: step 5 (the resume restored step 4"), out.stdout
    # Dropout draws between two batches: the forward took x, held at the previous run.step.
    assert "step 5 trained x, which the script drew during step 4" in verdict, verdict
    assert "(a prefetch)" in verdict
    # The final state: the weights trained on another batch at step 5.
    assert "the final state differs in: model (" in out.stdout, out.stdout
    kept = out.stdout.split("the check's runs: ")[1].split()[0]
    assert os.path.isdir(os.path.join(kept, "uninterrupted", "checkpoints", "step-8")), kept


@pytest.mark.slow
def test_an_unregistered_counter_is_named_by_the_learning_rate_it_sets(tmp_path):
    out, verdict = run_check(tmp_path, "--", "--unregistered-counter")
    assert out.returncode == check.EXIT_NOT_EXACT, out.stdout + out.stderr
    assert verdict.startswith("not exact: step 5 (the resume restored step 4"), out.stdout
    assert "the learning rate is 0.05 after the resume" in verdict, verdict
    assert "(an unregistered counter)" in verdict


@pytest.mark.slow
def test_a_config_file_edited_while_the_runs_go_on_is_named(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"lr": 0.01}))
    out, verdict = run_check(tmp_path, "--", "--config", "cfg.json", "--rewrite-config-at", "2")
    assert out.returncode == check.EXIT_NOT_EXACT, out.stdout + out.stderr
    # The killed run started on the file the uninterrupted one rewrote at its step 2.
    assert verdict.startswith("not exact: step 1: cfg.json (digest "), out.stdout
    assert "named in the script's arguments, changed while the check ran" in verdict
    assert "its resume was refused" in verdict and "a file read live" in verdict


@pytest.mark.slow
def test_the_converted_ddp_script_resumes_exactly_on_two_ranks(tmp_path):
    converted = os.path.join(OWNLOOP, "converted_ddp.py")
    out, verdict = run_check(
        tmp_path,
        "cluster.tasks_per_node=2",
        "mining.enabled=false",
        "--",
        "--epochs",
        "3",
        script=converted,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # 6 steps an epoch: killed at the first epoch's last step, before its end's checkpoint.
    assert verdict.startswith("exact: 8 steps on 2 rank(s), killed at step 6"), out.stdout
    assert "resumed from the checkpoint of step 4" in verdict
