"""Every way a checkpoint can fail to load is 'damaged': skipped with a warning naming the folder
and the reason, and the previous one is used; a skipped one leaves the model and states
untouched."""

import hashlib
import json
import logging
import os
import re
import shutil

import clihelp
import pytest
import torch

from clusterflow import config as cfgmod
from clusterflow import rundir
from clusterflow.checkpoint import identity
from clusterflow.checkpoint.checkpointer import STEP, Checkpointer
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.errors import RunFailed
from clusterflow.manage.status import main as status_main
from clusterflow.observe.context import JobContext
from clusterflow.storage import manifest
from clusterflow.storage.tensors import serialize


def make(run_dir, out=4):
    torch.manual_seed(0)
    cfg = cfgmod.load(
        None, [f"run.dir={run_dir}", "checkpoint.every_steps=1", "checkpoint.keep_last=5"]
    )
    model = torch.nn.Linear(3, out)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = TrainState()
    return (
        Checkpointer(
            JobContext(cfg, rundir.RunPaths(cfg.run.dir)),
            model,
            {"optimizer": opt},
            state,
            steps_per_epoch=100,
        ),
        model,
        opt,
        state,
    )


def train_to(ck, model, opt, state, step):
    while state.global_step < step:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        state.step_done()
    ck.save(STEP)
    ck.finish()  # a background save is committed before the test looks at the folder


@pytest.fixture
def run(tmp_path):
    """A run dir with checkpoints at steps 4 and 8, and the weights and optimizer state of
    step 4."""
    ck, model, opt, state = make(str(tmp_path))
    train_to(ck, model, opt, state, 4)
    at4 = (
        {k: v.clone() for k, v in model.state_dict().items()},
        opt.state_dict()["state"][0]["exp_avg"].clone(),
    )
    train_to(ck, model, opt, state, 8)
    return tmp_path, at4


def step8(tmp_path):
    return tmp_path / "checkpoints" / "step-8"


def edit_manifest(tmp_path, fn):
    path = step8(tmp_path) / "manifest.json"
    m = json.loads(path.read_text())
    m = fn(m)
    path.write_text(json.dumps(m))


def replace_file(tmp_path, name, obj):
    """Put ``obj`` in step-8/name with a manifest entry whose size and sha256 are right: only its
    content lies."""
    data = serialize(obj)
    (step8(tmp_path) / name).write_bytes(data)
    edit_manifest(
        tmp_path,
        lambda m: {
            **m,
            "files": {
                **m["files"],
                name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()},
            },
        },
    )


def lie_dir(tmp_path):
    (step8(tmp_path) / "manifest.json").unlink()
    (step8(tmp_path) / "manifest.json").mkdir()


def lie_copied_folder(tmp_path):
    shutil.rmtree(step8(tmp_path))
    shutil.copytree(tmp_path / "checkpoints" / "step-4", step8(tmp_path))


def lie_foreign_model(tmp_path):
    """Another model's weights, carrying step 8's checkpoint id: only their shapes lie."""
    ident = json.loads((step8(tmp_path) / "manifest.json").read_text())["checkpoint_id"]
    foreign = identity.stamp({"model.pt": torch.nn.Linear(3, 5).state_dict()}, ident, 8)
    replace_file(tmp_path, "model.pt", foreign["model.pt"])


def lie_no_train_state(tmp_path):
    (step8(tmp_path) / "train_state.pt").unlink()
    edit_manifest(tmp_path, lambda m: {**m, "files": {"model.pt": m["files"]["model.pt"]}})


def lie_foreign_optimizer(tmp_path):
    saved = torch.load(step8(tmp_path) / "train_state.pt", weights_only=True)
    other = torch.nn.Linear(3, 4, bias=False)
    opt = torch.optim.AdamW(other.parameters())
    saved["optimizer"] = opt.state_dict()  # one parameter where the run has two
    replace_file(tmp_path, "train_state.pt", saved)


def lie_counters_missing(tmp_path):
    saved = torch.load(step8(tmp_path) / "train_state.pt", weights_only=True)
    del saved["train"][
        "global_step"
    ]  # the optimizer (registered first) loads, then the counters fail
    replace_file(tmp_path, "train_state.pt", saved)


def copy_from_step4(name):
    """``name`` and its manifest entry copied from step 4: size and digest agree with the file."""

    def damage(tmp_path):
        step4 = tmp_path / "checkpoints" / "step-4"
        shutil.copyfile(step4 / name, step8(tmp_path) / name)
        entry = json.loads((step4 / "manifest.json").read_text())["files"][name]
        edit_manifest(tmp_path, lambda m: {**m, "files": {**m["files"], name: entry}})

    return damage


def lie_rng_missing(tmp_path):
    saved = torch.load(step8(tmp_path) / "train_state.pt", weights_only=True)
    saved["rng"] = []
    replace_file(tmp_path, "train_state.pt", saved)


def flip_a_bit(tmp_path):
    """Bit rot: one bit of model.pt flipped, its manifest entry as written."""
    path = step8(tmp_path) / "model.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def tear_train_state(tmp_path):
    """A torn write: train_state.pt cut to half its size."""
    path = step8(tmp_path) / "train_state.pt"
    os.truncate(path, path.stat().st_size // 2)


LIES = {
    "a flipped bit": (flip_a_bit, "model.pt does not match its blake3 digest"),
    "a torn train_state.pt": (tear_train_state, "train_state.pt has"),
    "files empty": (lambda t: edit_manifest(t, lambda m: {**m, "files": {}}), "lists no files"),
    "a list": (lambda t: edit_manifest(t, lambda m: []), "JSON list, not an object"),
    "entry without size": (
        lambda t: edit_manifest(
            t,
            lambda m: {
                **m,
                "files": {
                    **m["files"],
                    "model.pt": {k: v for k, v in m["files"]["model.pt"].items() if k != "size"},
                },
            },
        ),
        "model.pt has no valid size",
    ),
    "files a string": (
        lambda t: edit_manifest(t, lambda m: {**m, "files": "model.pt"}),
        "'files' is str",
    ),
    "manifest a directory": (lie_dir, "unreadable manifest: manifest.json is a folder, not a"),
    "no train_state.pt": (lie_no_train_state, "lists no train_state.pt"),
    "train_state.pt unlisted": (
        lambda t: edit_manifest(t, lambda m: {**m, "files": {"model.pt": m["files"]["model.pt"]}}),
        "train_state.pt is in the folder but not in its manifest",
    ),
    "file outside its folder": (
        lambda t: edit_manifest(
            t,
            lambda m: {**m, "files": {**m["files"], "../step-4/model.pt": m["files"]["model.pt"]}},
        ),
        "not in its folder",
    ),
    "position not a list": (
        lambda t: edit_manifest(t, lambda m: {**m, "position": 5}),
        "position 5 is not a list",
    ),
    "folder copied from another step": (lie_copied_folder, "says step 4, but its folder is step-8"),
    "sha256 not hex": (
        lambda t: edit_manifest(
            t, lambda m: {**m, "files": {**m["files"], "model.pt": {"size": 1, "sha256": "x"}}}
        ),
        "model.pt has no valid digest",
    ),
    "model that does not fit": (
        lie_foreign_model,
        "model.pt does not fit the model: weight is (5, 3) in the checkpoint, (4, 3)",
    ),
    "optimizer of another model": (
        lie_foreign_optimizer,
        "train_state.pt does not fit this run (ValueError",
    ),
    "counters missing": (lie_counters_missing, "train_state.pt does not fit this run (KeyError"),
    "no RNG state": (lie_rng_missing, "no RNG state for each of its ranks"),
    "model.pt of step 4": (copy_from_step4("model.pt"), "model.pt belongs to step 4's checkpoint"),
    "train_state.pt of step 4": (
        copy_from_step4("train_state.pt"),
        "train_state.pt belongs to step 4's checkpoint",
    ),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_each_lie_is_skipped_and_the_previous_checkpoint_used(run, lie, caplog):
    tmp_path, (weights4, exp_avg4) = run
    damage, reason = LIES[lie]
    damage(tmp_path)
    ck, model, opt, state = make(str(tmp_path))
    with caplog.at_level("WARNING"):
        assert ck.restore()
    assert state.global_step == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights4.items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], exp_avg4)
    warning = next(
        r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()
    )
    assert str(step8(tmp_path)) in warning and reason in warning, warning


def _skipped(caplog, step):
    """The warning that skipped checkpoint ``step``."""
    (said,) = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("skipping damaged checkpoint")
        and f"step-{step}:" in r.getMessage()
    ]
    return said


@pytest.mark.parametrize(
    "lie", ["model that does not fit", "optimizer of another model", "counters missing"]
)
def test_a_refused_checkpoint_leaves_model_states_and_rng_untouched(tmp_path, caplog, lie):
    """The only checkpoint is damaged: the run refuses to start over it (a fresh start would
    train over the run's work and exit 0), and leaves the model, states and RNG as they were."""
    ck, model, opt, state = make(str(tmp_path))
    train_to(ck, model, opt, state, 8)
    for name in os.listdir(tmp_path / "checkpoints"):  # only the step that will lie is left
        if name != "step-8":
            shutil.rmtree(tmp_path / "checkpoints" / name)
    LIES[lie][0](tmp_path)
    ck, model, opt, state = make(str(tmp_path))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with (
        pytest.raises(RunFailed, match=re.escape(f"step-8 ({LIES[lie][1]}")),
        caplog.at_level(logging.WARNING),
    ):
        ck.restore()
    assert _skipped(caplog, 8).endswith("; no older checkpoint to fall back to")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in init.items())
    assert opt.state_dict()["state"] == {} and state.global_step == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_when_every_checkpoint_is_damaged_the_run_refuses_naming_each_and_the_way_out(run, caplog):
    """Steps 4 and 8 both damaged: one line naming each step and why, and how to start from step
    0 on purpose; doing exactly that starts the run afresh."""
    tmp_path, _ = run
    LIES["model that does not fit"][0](tmp_path)
    (tmp_path / "checkpoints" / "step-4" / "train_state.pt").write_bytes(b"torn")
    ck, _, _, state = make(str(tmp_path))
    with pytest.raises(RunFailed) as refused, caplog.at_level(logging.WARNING):
        ck.restore()
    # Step 8 is skipped for step 4; step 4, found damaged by the store, has none to fall back to.
    assert _skipped(caplog, 8).endswith("; falling back to the previous one")
    assert _skipped(caplog, 4).endswith("; no older checkpoint to fall back to")
    said = str(refused.value)
    ckpts = tmp_path / "checkpoints"
    assert "\n" not in said and said.startswith(f"every checkpoint in {ckpts} is damaged"), said
    assert "step-8 (model.pt does not fit the model" in said, said
    assert "step-4 (train_state.pt has 4 bytes, the manifest says" in said, said
    way_out = f"mv {ckpts} {ckpts}.damaged"
    assert way_out in said and "or use a new run.dir" in said, said
    assert sorted(os.listdir(ckpts)) == ["step-4", "step-8"]  # nothing moved, nothing deleted
    os.rename(ckpts, f"{ckpts}.damaged")
    ck, _, _, state = make(str(tmp_path))
    assert not ck.restore() and state.global_step == 0


def test_a_checkpoint_of_an_older_version_without_ids_loads_as_before(run):
    """Manifests and files written before checkpoint ids existed carry none: such a checkpoint is
    checked by sizes and digests only, and loads."""
    tmp_path, _ = run
    saved = torch.load(step8(tmp_path) / "train_state.pt", weights_only=True)
    saved.pop("checkpoint", None)
    model = dict(torch.load(step8(tmp_path) / "model.pt", weights_only=True))  # no _metadata
    replace_file(tmp_path, "train_state.pt", saved)
    replace_file(tmp_path, "model.pt", model)
    edit_manifest(tmp_path, lambda m: {k: v for k, v in m.items() if k != "checkpoint_id"})
    ck, model, _, state = make(str(tmp_path))
    assert ck.restore() and state.global_step == 8


def test_schema_accepts_what_the_store_writes(run):
    tmp_path, _ = run
    m = json.loads((step8(tmp_path) / "manifest.json").read_text())
    assert manifest.check(m, 8) is m


def test_a_run_resumes_past_lying_checkpoints_bitwise(
    tmp_path, monkeypatch, tiny_one_process_model
):
    """End to end: a run killed in step 10 leaves steps 4, 6 and 8; step 8 gets correct hashes of a
    model that does not fit, step 6 a manifest listing no files. The resume skips both, naming them,
    starts from step 4 and ends bitwise equal to an uninterrupted run."""
    from conftest import REPO, run_cli, weights_equal

    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))
    d = tmp_path / "run"
    over = [
        f"run.dir={d}",
        "task.target=testtasks:KillAtEnv",
        "checkpoint.async=false",
    ]  # a kill at step 10 finds step 8 committed, never still being written
    assert (
        run_cli(
            "clusterflow.run", "configs/tiny.yaml", *over, env={"CLUSTERFLOW_TEST_KILL_AT": "10"}
        ).returncode
        == -9
    )
    lie_foreign_model(d)  # step-8, found under RUN/checkpoints by the helpers
    m6 = d / "checkpoints" / "step-6" / "manifest.json"
    m6.write_text(json.dumps({**json.loads(m6.read_text()), "files": {}}))
    out = run_cli("clusterflow.run", "configs/tiny.yaml", *over)
    assert out.returncode == 0, out.stdout + out.stderr
    log = open(d / "logs" / "rank0.attempt1.log").read()
    assert (
        f"skipping damaged checkpoint {d}/checkpoints/step-8: model.pt does not fit the model"
        in log
    )
    assert f"skipping damaged checkpoint {d}/checkpoints/step-6: the manifest lists no files" in log
    assert f"resumed from {d}/checkpoints/step-4" in log
    # Reached again, each refused step is set aside for inspection and committed anew.
    assert f"checkpoint {d}/checkpoints/step-8 is damaged (model.pt does not fit the model" in log
    assert len([n for n in os.listdir(d / "checkpoints") if n.startswith("damaged-step-")]) == 2
    code, out, err = clihelp.call(status_main, [str(d), "--json"])
    assert code == 0, err
    damaged = sorted(os.path.basename(p)[:14] for p in json.loads(out)["damaged_checkpoints"])
    assert damaged == ["damaged-step-6", "damaged-step-8"]
    assert weights_equal(d / "model.pt", tiny_one_process_model)
