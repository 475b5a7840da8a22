"""Mixed precision has one owner: the run's ``Precision`` (train/builders.py). The task trainer
steps the run's GradScaler (``run.scaler``) under the run's autocast, and every checkpoint saves
that one scaler, as it was stepped; a resume gives it back. A task under train.amp=fp16 trains on
a CPU too (torch's CPU autocast and GradScaler), so this runs a real Trainer in this process."""

import os

import torch
from conftest import REPO

from clusterflow import config, rundir
from clusterflow.checkpoint.registered import AMP_SCALER
from clusterflow.observe.context import JobContext
from clusterflow.storage.names import TRAIN_STATE
from clusterflow.storage.store import CheckpointStore
from clusterflow.tasks import load_task
from clusterflow.train.preemption import Preemption
from clusterflow.train.session import Run, RunInternals
from clusterflow.train.trainer import Trainer

# tiny: 6 steps an epoch; one epoch, a checkpoint every 3 steps and at the epoch's end.
OVERRIDES = ("train.amp=fp16", "train.epochs=1", "checkpoint.every_steps=3")


def _trainer(run_dir: str, attempt: int) -> Trainer:
    cfg = config.load(
        os.path.join(REPO, "configs", "tiny.yaml"), [f"run.dir={run_dir}", *OVERRIDES]
    )
    os.makedirs(run_dir, exist_ok=True)
    device = torch.device("cpu")
    run = Run(
        JobContext(cfg, rundir.RunPaths(run_dir), attempt),
        device,
        Preemption(),
        lambda outcome: (outcome, 0),  # the job's end: nothing to requeue here
        amp=torch.float16,
    )
    task = load_task(cfg.task.target, cfg.run.seed, cfg.task.params)
    return Trainer(run, RunInternals(run), task)


def test_the_task_trainer_steps_and_saves_the_runs_one_scaler(tmp_path):
    run_dir = str(tmp_path / "run")
    trainer = _trainer(run_dir, 0)
    run = trainer.run
    precision = trainer.internals.precision
    assert trainer.scaler is run.scaler is precision.scaler and run.scaler.is_enabled()
    with run.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.float16
    fresh = torch.amp.GradScaler("cpu").state_dict()
    assert trainer.fit() == "completed"
    stepped = run.scaler.state_dict()
    assert stepped["_growth_tracker"] + (stepped["scale"] < fresh["scale"]) > 0, stepped

    store = CheckpointStore(rundir.RunPaths(run_dir).checkpoints)
    saved = torch.load(
        os.path.join(store.step_path(store.steps()[-1]), TRAIN_STATE), weights_only=True
    )
    # One scaler in the checkpoint, under the name the trainer registers: the stepped one.
    assert "scaler" in saved and AMP_SCALER not in saved, sorted(saved)
    assert saved["scaler"] == stepped

    again = _trainer(run_dir, 1)
    assert again.fit() == "completed"  # resumed at the end: restores, trains nothing
    assert again.run.scaler.state_dict() == stepped
