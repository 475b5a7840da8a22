"""No host read on a training step that does not log.

A real Trainer (configs/tiny.yaml, CPU, 1 and 2 gloo ranks, mining rounds so later epochs train on
mined labels) runs with every way of reading a tensor's value into Python patched to count its
calls: ``item``, ``__float__``, ``__int__``, ``__index__``, ``__bool__``, ``tolist``, ``cpu``,
``numpy`` and ``to`` a CPU device. On a GPU each of them waits for the device to finish every
queued kernel; on this CPU machine the counting is how we know the loop would not wait.

``to`` counts a move to the CPU, except a move to the training device itself (that is a copy
onto the GPU there; the trainer's own ``torch.device`` object tells them apart on a CPU run).

Calls are attributed to steps: a step's window runs from the end of the previous step (or the
start of the epoch's loop) to the end of its own (after the stop poll and the checkpoint check).
Three call sites read tensors that live on the host on a GPU too, and are allowed: the
optimizer's step counter (``torch.optim.optimizer._get_value``: AdamW keeps ``step`` on the CPU
unless ``capturable`` or ``fused``), the DataLoader's worker seed drawn when its iterator starts,
and the sampler's permutation (a CPU tensor made into a list once per epoch).
"""

import collections
import contextlib
import os
import sys
import warnings

import pytest
from conftest import REPO
from multirank import run_ranks

HOST_SIDE = (
    "torch/optim/optimizer.py:_get_value",
    "torch/utils/data/dataloader.py:__init__",
    "sampler.py:_epoch_order",
)
READS = ("item", "__float__", "__int__", "__index__", "__bool__", "tolist", "cpu", "numpy")


def _site(depth=2):
    f = sys._getframe(depth)
    where = f.f_code.co_filename.replace(os.sep, "/")
    where = (
        where.split("site-packages/")[-1].split("clusterflow/", 1)[-1]
        if "/torch/" not in where
        else "torch/" + where.split("/torch/", 1)[1]
    )
    return f"{where}:{f.f_code.co_name}"


def _patch(calls, device):
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in (*READS, "to")}

    def counting(name):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            if name != "to" or _to_cpu(args, kwargs, device):
                calls.append(f"{name} from {_site()}")
            return original(self, *args, **kwargs)

        return wrapper

    for name in originals:
        setattr(torch.Tensor, name, counting(name))
    return lambda: [setattr(torch.Tensor, n, f) for n, f in originals.items()]


def _to_cpu(args, kwargs, device):
    import torch

    target = kwargs.get("device", args[0] if args else None)
    return (
        target is not device
        and isinstance(target, (str, torch.device))
        and torch.device(target).type == "cpu"
    )


@contextlib.contextmanager
def _cuda_syncs_counted(device, calls):
    """On a GPU, also every synchronising CUDA call that torch itself makes (sync debug mode:
    boolean indexing, nonzero, a copy to pageable host memory...), which no patch above can see."""
    import torch

    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning
        warnings.showwarning = lambda message, *rest: calls.append(f"cuda sync: {message}")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown


def _train_counting(config_path, run_dir, overrides, device="cpu"):
    """Runs a real Trainer; returns {step: (kind, [call, ...])} for every step of the run."""
    import torch

    from clusterflow import config, rundir
    from clusterflow.checkpoint import checkpointer
    from clusterflow.distributed import comm as dist
    from clusterflow.observe.context import JobContext
    from clusterflow.tasks import load_task
    from clusterflow.train import builders
    from clusterflow.train.preemption import Preemption
    from clusterflow.train.saves import Saves
    from clusterflow.train.session import Run, RunInternals
    from clusterflow.train.trainer import Trainer

    cfg = config.load(config_path, [f"run.dir={run_dir}", *overrides])
    os.makedirs(run_dir, exist_ok=True)
    device = torch.device(device)
    task = load_task(cfg.task.target, cfg.run.seed, cfg.task.params)
    run = Run(
        JobContext(cfg, rundir.RunPaths(run_dir)),
        device,
        Preemption(),
        lambda outcome: (outcome, 0),  # the job's end: nothing to requeue here
        amp=builders.amp_dtype(cfg.train.amp, device),
    )
    internals = RunInternals(run)
    trainer = Trainer(run, internals, task)
    calls, steps = [], {}
    save, dataloader = Saves.save, trainer.loader.dataloader

    def start_of_loop(epoch):
        calls.clear()  # what the end-of-epoch work read belongs to no step
        return dataloader(epoch)

    def end_of_step(saves, event):
        save(saves, event)
        if event == checkpointer.STEP:
            logs = saves.reporter.log_due(
                run.global_step, internals.state.step_in_epoch, internals.steps_per_epoch
            )
            kind = "log" if logs else "save" if saves.checkpointer.due(event) else "plain"
            steps[run.global_step] = (kind, list(calls))
            calls.clear()

    Saves.save, trainer.loader.dataloader = end_of_step, start_of_loop
    restore = _patch(calls, trainer.device)
    try:
        with _cuda_syncs_counted(device, calls):
            outcome = trainer.fit()
    finally:
        restore()
        Saves.save = save
    assert outcome == "completed" and dist.world() in (1, 2)
    return steps


def _check(steps):
    device_reads = {
        s: [c for c in calls if not c.endswith(HOST_SIDE)] for s, (kind, calls) in steps.items()
    }
    plain = [s for s, (kind, _) in steps.items() if kind == "plain"]
    assert len(steps) == 18 and len(plain) >= 8, (
        steps
    )  # 3 epochs x 6 steps; log every 3, save every 5
    for s in plain:
        assert device_reads[s] == [], (
            f"step {s} (does not log) read tensors back: {device_reads[s]}"
        )
    per_kind = collections.defaultdict(list)
    for s, (kind, _) in steps.items():
        per_kind[kind].append(len(device_reads[s]))
    return {k: max(v) for k, v in per_kind.items()}, device_reads


@pytest.mark.parametrize("world", [1, 2])
def test_a_step_that_does_not_log_reads_nothing_back(world, tmp_path, capsys):
    overrides = [
        "train.log_every_steps=3",
        "checkpoint.every_steps=5",
        f"cluster.tasks_per_node={world}",
    ]
    results = run_ranks(
        world,
        _train_counting,
        os.path.join(REPO, "configs", "tiny.yaml"),
        str(tmp_path / "run"),
        overrides,
    )
    for rank, steps in enumerate(results):
        worst, reads = _check(steps)
        assert worst["log"] >= 1  # the counting sees the reads a log step makes (the window's sums)
        with capsys.disabled():
            log_step = next(s for s, (kind, _) in steps.items() if kind == "log")
            print(
                f"\n[world {world} rank {rank}] most reads per step: {worst}; log step {log_step}: "
                f"{dict(collections.Counter(reads[log_step]))}"
            )


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="no CUDA GPU on this machine"
)
def test_on_a_gpu_a_step_that_does_not_log_never_synchronises(tmp_path):
    """The same run on one GPU in bf16, with CUDA's sync debug mode reporting what no patch sees."""
    overrides = [
        "train.log_every_steps=3",
        "checkpoint.every_steps=5",
        "cluster.tasks_per_node=1",
        "train.amp=bf16",
    ]
    steps = run_ranks(
        1,
        _train_counting,
        os.path.join(REPO, "configs", "tiny.yaml"),
        str(tmp_path / "run"),
        overrides,
        "cuda",
    )[0]
    _check(steps)
