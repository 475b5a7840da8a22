"""The run of the library API (docs/own-loop.md): every guarantee of a clusterflow job for a
training loop of the user's own, and the one implementation the task trainer uses too.

    run = clusterflow.start()                       # job/script.py: the job's side of it
    model, optimizer = run.setup(model, optimizer)  # device; DDP or FSDP2 (train.parallel)
    loader = run.loader(dataset, batch_size=256)    # the epoch plan (distributed/sampler.py)
    run.restore(model=model, optimizer=optimizer, scheduler=scheduler)
    for epoch in run.epochs(20):
        for batch in loader:
            ...; optimizer.step(); optimizer.zero_grad()
            run.step(loss=loss)
        run.mine(embed)
    run.finish()

What each part owns (the trainer, ``trainer.py``, drives the same calls for a task):

- ``setup``: the model on the run's device, wrapped in DDP or sharded with FSDP2, then distinct
  per-rank random streams (``clusterflow.start`` seeded every rank alike with ``run.seed``).
- ``loader``: one global batch of ``batch_size`` samples per step, cut from the epoch's order by
  :class:`GlobalBatchSampler`, from the position the run reached: every sample once per epoch at
  any world size. Iterating it counts the batches a step takes (``accumulate``).
- ``restore``: registers what every checkpoint holds (``Checkpointer``) and restores the newest
  committed one that verifies (weights, each registered state, every rank's random streams).
- ``epochs``: the epochs left; the end of each commits a checkpoint and asks the ranks whether
  to stop.
- ``step``: after each optimizer step: the counters and the sample ledger, the heartbeat and
  straggler measure, the log cadence, the non-finite guard, the stop agreement and the scheduled
  save. A stop saves, ends the job (requeue or not) and raises :class:`RunStopped`.
- ``mine``: the mining stage (``mining/stage.py``) when it is due; its labels are saved with the
  end-of-epoch checkpoint. A script's epoch that mines saves its last step as the loop ended it
  (``LOOP_END``): a stop inside the round commits nothing new, and the next attempt runs the
  script's code after the loop once more, on those states.
- ``finish``: waits for the last write, writes ``RUN_DIR/model.pt`` and ends the job.

Calls out of order are refused with one line naming the fix (a step missing or twice, a model
not set up, state registered twice, a DataLoader of the user's own), so a loop can never lose
exactness silently.
"""

from __future__ import annotations

import collections
import copy
import io
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, overload

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from clusterflow import rundir
from clusterflow.checkpoint import checkpointer, rng
from clusterflow.checkpoint.checkpointer import Checkpointer, Stateful
from clusterflow.checkpoint.data_identity import identify
from clusterflow.checkpoint.rng import (
    RngState,
    capture_rng,
    rank_seed,
    restore_rng,
    seed_everything,
)
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.config.job_config import Config
from clusterflow.distributed import comm as dist
from clusterflow.distributed import workers
from clusterflow.distributed.sampler import (
    LOADER_BATCH,
    TASK_BATCH,
    EpochItems,
    EpochPlan,
    GlobalBatchSampler,
    WithEpoch,
    check_fits,
    epoch_order,
    shard_range,
    split,
)
from clusterflow.errors import UserError
from clusterflow.mining import figure
from clusterflow.mining.stage import Miner, for_status
from clusterflow.observe import phases
from clusterflow.observe.metrics import Every, NullWriter, gpu_stats, writer_for
from clusterflow.observe.observer import mining_wait_timeout_s
from clusterflow.observe.profiling import NoProfile, profile_for
from clusterflow.observe.timeline import (
    FIRST_BATCH,
    FIRST_STEP,
    MODEL,
    RESTORE,
    TASK_DATA,
    Startup,
    process_started_at,
    timeline_for,
)
from clusterflow.rundir import restarts, transitions
from clusterflow.rundir.states import State, StopReason
from clusterflow.storage import durable
from clusterflow.storage.tensors import TORCH
from clusterflow.tasks import Task
from clusterflow.train import parallel
from clusterflow.train.finite import FiniteGuard
from clusterflow.train.preemption import AGREE_EVERY_S, WHY, Preemption, StopAgreement
from clusterflow.train.window import LossWindow

log = logging.getLogger("clusterflow.trainer")

# Names a checkpoint's train_state.pt holds besides the registered states.
RESERVED = ("model", "train", "rng", "world_size")
# What the mining embed and the sharded model may compute in, besides the script's own autocast.
Amp = torch.dtype | None


class RunStopped(SystemExit):
    """Every rank agreed to stop (a signal, a cancel): the stop checkpoint is committed and the job
    has ended (requeued, stopped or cancelled). A ``SystemExit``, so an ``except Exception`` of the
    training loop does not swallow it; its code is the process's exit status."""

    def __init__(self, outcome: str, code: int) -> None:
        super().__init__(code)
        self.outcome = outcome


class Ending(Protocol):
    """The job's end (``job/attempt.py``): requeue or not, status, the run dir let go, the process
    group shut down. Returns the job's outcome and the process's exit status."""

    def __call__(self, outcome: str) -> tuple[str, int]: ...


def _stateful(name: str, obj: object) -> Stateful:
    """``obj`` as a registered state: anything with ``state_dict``/``load_state_dict`` as it is;
    a dict (restored in place) through an adapter."""
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return obj  # type: ignore[return-value]
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_savable(name, f"[{key!r}]", value)
        return _InPlace(obj)
    raise UserError(
        f"run.restore({name}=...): a {type(obj).__name__} cannot be saved with the checkpoint; "
        "pass an object with state_dict()/load_state_dict() (optimizer, scheduler, GradScaler, "
        "module), a dict of numbers, strings, lists and tensors (restored in place), or a "
        "torch.Generator, numpy Generator or random.Random"
    )


def _stream(obj: object) -> tuple[Callable[[], object], Callable[[object], None]] | None:
    """A random generator of the script's own as (its state, set it), or None for another
    object: saved per rank, like the global streams."""
    if isinstance(obj, torch.Generator):
        return obj.get_state, obj.set_state  # type: ignore[return-value]
    if isinstance(obj, np.random.Generator):
        bits = obj.bit_generator

        def put(state: object) -> None:
            bits.state = copy.deepcopy(state)

        return (lambda: copy.deepcopy(bits.state)), put
    if isinstance(obj, random.Random):
        r = obj

        def put_py(state: object) -> None:
            version, internal, gauss = state  # type: ignore[misc]
            r.setstate((version, tuple(internal), gauss))

        return (lambda: [r.getstate()[0], list(r.getstate()[1]), r.getstate()[2]]), put_py
    return None


# What a registered dict may hold as it is: a checkpoint's train_state.pt is read back with
# torch.load(weights_only=True), which takes these, tensors, and lists, tuples and these dicts of
# them; anything else is tried.
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_CONTAINERS = (dict, collections.OrderedDict)


def _check_savable(name: str, where: str, value: object) -> None:
    """Refuse, naming its place, a value of a registered dict that a checkpoint cannot hold: it
    would fail the first save (a file, a lock), or the resume that loads it."""
    if type(value) in _PLAIN or isinstance(value, torch.Tensor):
        return
    if isinstance(value, dict) and type(value) in _CONTAINERS:
        for key, item in value.items():
            _check_savable(name, f"{where}[{key!r}]", item)
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):  # type: ignore[arg-type]
            _check_savable(name, f"{where}[{i}]", item)
        return
    try:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - any failure is the same answer: not a state
        raise UserError(
            f"run.restore({name}=...): {name}{where} is a {type(value).__name__}, which a "
            "checkpoint cannot hold (it is saved and read back as torch.save and "
            "torch.load(weights_only=True) do); keep numbers, strings, lists, dicts and tensors "
            "in a registered dict, and register an object with state_dict()/load_state_dict() "
            "under a name of its own"
        ) from None


class _InPlace:
    """A dict of the script's own (counters, best metric): saved as a copy, restored in place."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.d)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.d.clear()
        self.d.update(copy.deepcopy(state))


def _to_device(batch: object, device: torch.device) -> object:
    """Every tensor of a (nested) batch on ``device``."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class _Indexed(Dataset):
    """A script's dataset as the mining stage reads it: each item with its index."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"index": i, "item": self.dataset[i]}


class _Embedding(Task):
    """A script's embedding function as the mining stage asks for a task's."""

    def __init__(
        self,
        embed: Callable[[Any], torch.Tensor],
        dataset: Dataset,
        truth: np.ndarray | None,
        device: torch.device,
    ) -> None:
        self.fn, self.dataset, self.truth, self.device = embed, _Indexed(dataset), truth, device

    def embed(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self.fn(_to_device(batch["item"], self.device))

    def embed_dataset(self) -> Dataset:
        return self.dataset

    def ground_truth(self) -> np.ndarray | None:
        return self.truth


def _no_mark(*_: object) -> None:
    """The forward hook of a copy of a set-up model (an EMA, an AveragedModel): nothing."""


class _Mark:
    """A forward hook on a set-up model: the step's own part (data, forward) ends with its last
    forward, for the straggler watch. A copy or a pickle of the model gets :func:`_no_mark`, so
    copying a model never copies the run."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def __call__(self, *_: object) -> None:
        self.run._busy_until, self.run._waited_until = time.perf_counter(), dist.waited_s()

    def __deepcopy__(self, memo: dict[int, object]) -> Callable[..., None]:
        return _no_mark

    def __reduce__(self) -> tuple[Callable[..., None], tuple[()]]:
        return _no_mark_factory, ()


def _no_mark_factory() -> Callable[..., None]:
    return _no_mark


class Loader:
    """What ``run.loader`` returns: iterate it once in each epoch of ``run.epochs``; it yields
    this rank's slice of each global batch, from the position the run reached."""

    def __init__(
        self,
        run: Run,
        dataset: Dataset,
        batch_size: int,
        accumulate: int,
        set_epoch: Callable[[int], None] | None,
        kwargs: dict[str, Any],
    ) -> None:
        self.run, self.dataset, self.batch_size = run, dataset, batch_size
        self.accumulate, self.set_epoch, self.kwargs = accumulate, set_epoch, kwargs
        self.n = len(dataset)  # type: ignore[arg-type]
        # What a checkpoint records of the data, and a resume compares with it.
        self.data = identify(dataset)  # type: ignore[arg-type]
        self.sampler = GlobalBatchSampler(
            self.n,
            batch_size,
            run.rank,
            run.world_size,
            run.config.run.seed,
            accumulate,
            order=lambda seed, epoch: epoch_order(dataset, seed, epoch),
            key=run.batch_key,
        )
        self._persistent: DataLoader | None = None

    def __len__(self) -> int:
        """The batches left in this epoch (all of them at its start), from where the run is: a
        resumed epoch's, before the loop too."""
        run = self.run
        if run.plan is None:  # before run.epochs
            return len(self.sampler)
        return len(run.plan.batches_from(run.state.sample_in_epoch or 0)) * self.accumulate

    def __iter__(self) -> Iterator[Any]:
        return self.run._iterate(self)

    def dataloader(self, epoch: int) -> DataLoader:
        """This epoch's DataLoader; with persistent workers, one per attempt."""
        kw = dict(self.kwargs)
        persistent = bool(kw.pop("persistent_workers", False)) and kw.get("num_workers", 0) > 0
        if persistent and self._persistent is not None:
            return self._persistent
        # Its own generator: worker seeds depend on (seed, rank, epoch) only, and the global
        # random stream (dropout) is not drawn from, so a resume in mid-epoch continues that
        # stream exactly.
        g = torch.Generator().manual_seed(
            rank_seed(self.run.config.run.seed, self.run.rank) + epoch
        )
        data, batches = (
            (EpochItems(self.dataset, self.set_epoch), WithEpoch(self.sampler))
            if persistent
            else (self.dataset, self.sampler)
        )
        if kw.get("num_workers", 0) > 0:
            # The job's stop signals reach the workers too: the rank stops, they outlive them.
            kw["worker_init_fn"] = workers.quiet(kw.get("worker_init_fn"))
        loader = DataLoader(
            data, batch_sampler=batches, generator=g, persistent_workers=persistent, **kw
        )
        if persistent:
            self._persistent = loader
        return loader


class Run:
    """One attempt's training, on this rank. Built by ``clusterflow.start()`` (a script) or
    ``run_job`` (a task); ``ending`` is the job's end. ``amp``: the precision of a sharded model's
    forward and of the mining embed (None: as the model is); ``what``: the task or script, for
    messages."""

    def __init__(
        self,
        cfg: Config,
        paths: rundir.RunPaths,
        device: torch.device,
        attempt: int,
        preemption: Preemption,
        ending: Ending,
        amp: Amp = None,
        what: str = "",
        startup: Startup | None = None,
    ) -> None:
        self.config, self.paths, self.device, self.attempt = cfg, paths, device, attempt
        self.rank, self.world_size = dist.rank(), dist.world()
        self.run_dir = paths.root
        self.amp, self.what, self._ending = amp, what, ending
        self.phases = phases.Phases()
        # Where the start-up went, marked up to the first step (the attempt marked its part).
        self.startup = startup or Startup(process_started_at())
        # Rank 0's record of this attempt in time, for the goodput ledger.
        self.timeline = timeline_for(
            self.rank == 0, paths, attempt, self.phases, self.startup, world_size=self.world_size
        )
        self.stop = StopAgreement(preemption, cfg.dist.timeout_s, interval_s=AGREE_EVERY_S)
        self.state = TrainState()
        self.window = LossWindow()
        self.own_loop = own_loop = bool(cfg.script.path)
        self.guard = FiniteGuard(device, cfg.train, self.committed_steps, own_loop=own_loop)
        # What the messages about the batch name: a script's run.loader argument, or the task's
        # config key.
        self.batch_key = LOADER_BATCH if own_loop else TASK_BATCH
        self.miner = Miner(
            cfg.mining,
            device,
            amp,
            self.stop,
            self.phases,
            progress_bar=cfg.train.progress_bar,
            rounds_dir=paths.mining_rounds,
            fsync=cfg.checkpoint.fsync,
            data=cfg.data,
            wait_timeout_s=mining_wait_timeout_s(cfg.mining.timeout_s, cfg.dist.stall_limit_s),
        )
        self.checkpointer: Checkpointer | None = None
        self.total_epochs = 0
        self._modules: dict[int, torch.nn.Module] = {}  # setup's input and output -> the module
        self._module: torch.nn.Module | None = None  # the one saved as model.pt
        self._optimizers: list[torch.optim.Optimizer] = []
        self._seeded = False
        self._loader: Loader | None = None
        self.plan: EpochPlan | None = None
        self.steps_per_epoch = 0
        self._writer: NullWriter | None = None
        self._profile: NoProfile = NoProfile()
        self._progress_due = Every(1.0)  # status.json's progress fields
        # The latest log step's loss and rate: every status write carries them, so the epoch's
        # and the run's end record the last logged loss even when the cadence skipped its write.
        self._logged: dict[str, float] = {}
        self._before_commit: list[Callable[[str], None]] = []
        self._at_finish: list[Callable[[], None]] = []
        # Where this epoch is: its steps left, the step being fetched, whether step() is due.
        self._in_epoch = False
        self._steps: Iterator[tuple[int, int]] = iter(())
        self.global_batch: tuple[int, int] | None = None  # (first sample, size) of this step
        self._micro = 0
        self._awaiting_step = False
        self._fetched = False  # a batch of run.loader came this epoch
        self._first_step = True
        self._first_batch = True
        self._mined = -1  # the epoch whose mining round ran in this attempt
        self._saved_at: tuple[int, tuple[int, int]] | None = None
        self._steps_done_rng: RngState | None = None
        # A step's own part (data, forward) less its waits in collectives, for the straggler
        # watch: the marks of the step's start and of its last forward.
        self._step_mark = self._busy_until = 0.0
        self._waited_mark = self._waited_until = 0.0
        self._data_wait = 0.0  # seconds this step waited for its batches of run.loader
        self._closed = False
        # A stop agreed at an epoch's last step: saved there, before the loop's end-of-epoch work
        # (the task trainer: its eval and mining resume in a fresh attempt), or at the epoch's end
        # after it (a script: a resume never starts in an epoch whose steps are all done, where a
        # loop that reads its last batch's variables after the loop would find none).
        self.stop_before_epoch_end = False
        # Whether the script calls run.mine after its loop: True from its first call (or a round
        # in the state restored), False once an epoch due to mine ended without one, None until
        # then. Unless False, the last step of an epoch whose end mines is saved as the loop ended
        # it (LOOP_END): a stop inside the round must not save the states that the script's own
        # code after the loop has changed.
        self._mines: bool | None = None
        self._resumed = False
        self._streams: list[str] = []  # the script's own random streams (rng.track)
        self.outcome: str | None = None

    # -- what the loop reads ------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Epochs finished."""
        return self.state.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps done in all (this run's, across its attempts)."""
        return self.state.global_step

    @property
    def labels(self) -> np.ndarray | None:
        """The last mining round's labels by sample index (restored on resume), or None."""
        return self.state.labels

    def samples_trained(self) -> int:
        """Samples of the run's epochs trained, the step being taken included (a learning-rate
        schedule that counts samples reads it between the optimizer step and ``step()``)."""
        n = self._loader.n if self._loader is not None else 0
        at = (
            self.global_batch[0] + self.global_batch[1]
            if self.global_batch is not None
            else self.state.sample_in_epoch or 0
        )
        return self.state.epoch * n + at

    def committed_steps(self) -> list[int]:
        return self.checkpointer.committed_steps() if self.checkpointer is not None else []

    # -- setup --------------------------------------------------------------------------------
    @overload
    def setup(
        self,
        model: torch.nn.Module,
        optimizer: None = None,
        *,
        shard_units: Sequence[torch.nn.Module]
        | Callable[[torch.nn.Module], Sequence[torch.nn.Module]]
        | None = None,
    ) -> torch.nn.Module: ...

    @overload
    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        shard_units: Sequence[torch.nn.Module]
        | Callable[[torch.nn.Module], Sequence[torch.nn.Module]]
        | None = None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]: ...

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        shard_units: Sequence[torch.nn.Module]
        | Callable[[torch.nn.Module], Sequence[torch.nn.Module]]
        | None = None,
    ) -> torch.nn.Module | tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model on this rank's device, wrapped for the world (DDP, or FSDP2 with
        ``train.parallel=fsdp``: ``shard_units``, or a function of the model giving them, are
        sharded one by one); the optimizer's parameters follow the sharding. Every rank then draws
        from a random stream of its own (dropout, augmentations)."""
        self._live("run.setup")
        if self._in_epoch or self.checkpointer is not None:
            raise UserError(
                "run.setup(...) came after run.restore: set every model up first, then "
                "register it with run.restore(model=..., ...)"
            )
        if not isinstance(model, torch.nn.Module):
            raise UserError(
                f"run.setup(model): expected a torch.nn.Module, got {type(model).__name__}"
            )
        if id(model) in self._modules or parallel.is_wrapped(model):
            raise UserError(
                "run.setup(model): this model is set up (wrapped) already; set each model up "
                "once and keep what run.setup returned"
            )
        cfg, world = self.config, self.world_size
        if cfg.dist.sync_batchnorm and world > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        module = model.to(self.device)
        if cfg.train.parallel == "fsdp":
            units = shard_units(module) if callable(shard_units) else shard_units
            names = {id(p): n for n, p in module.named_parameters()}
            wrapped = parallel.wrap_fsdp(
                module,
                list(parallel.default_units(module) if units is None else units),
                self.device,
                world,
                self.amp,
            )
            if optimizer is not None:
                parallel.rebind(optimizer, names, module)
        elif world > 1:
            wrapped = parallel.wrap_ddp(module, self.device, cfg.dist)
        else:
            wrapped = module
        for m in (model, module, wrapped):
            self._modules[id(m)] = module
        module.register_forward_hook(_Mark(self))
        if not self._seeded:
            # Distinct per-rank streams from here on.
            seed_everything(rank_seed(cfg.run.seed, self.rank))
            self._seeded = True
        if self.own_loop:  # the script's code up to here built its model
            self.startup.mark(MODEL)
        return wrapped if optimizer is None else (wrapped, optimizer)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain module ``run.setup`` took (or returned) ``model`` for: what an embedding
        for ``run.mine`` calls (a DDP wrapper's forward is collective, and ranks embed different
        numbers of batches). UserError for a model not set up."""
        module = self._modules.get(id(model))
        if module is None:
            raise UserError(
                f"this {type(model).__name__} was not passed to run.setup, so it is not on the "
                "run's device nor wrapped for the world; call model, optimizer = "
                "run.setup(model, optimizer) first and pass what it returned"
            )
        return module

    # -- data ---------------------------------------------------------------------------------
    def loader(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        accumulate: int = 1,
        set_epoch: Callable[[int], None] | None = None,
        **dataloader_kwargs: object,
    ) -> Loader:
        """A DataLoader over the epoch plan: ``batch_size`` is the global batch (every rank's
        samples of one optimizer step; each rank gets ``batch_size / world_size``), with
        ``accumulate`` batches per step. ``set_epoch`` (default: the dataset's own, if it has
        one) is called with each epoch, in the worker processes too. Other keyword arguments go to
        ``torch.utils.data.DataLoader`` (num_workers, collate_fn, pin_memory, ...)."""
        self._live("run.loader")
        if self._loader is not None:
            raise UserError(
                "run.loader was called twice: the epoch plan drives one training loader; build "
                "evaluation loaders with torch.utils.data.DataLoader"
            )
        if self.checkpointer is not None:
            raise UserError(
                "run.loader(...) came after run.restore: a resume checks the checkpoint's data "
                "(its length and digest) against the loader's dataset, so a resume on other data "
                "would go unnoticed; call loader = run.loader(dataset, batch_size=...) before "
                "run.restore(...)"
            )
        if isinstance(dataset, DataLoader):
            raise UserError(
                "run.loader(dataset, ...) takes a dataset, not a DataLoader: pass the DataLoader's "
                "dataset and its batch size (run.loader builds the DataLoader over the epoch plan)"
            )
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise UserError(
                f"run.loader needs a map-style dataset (len() and dataset[i]), got a "
                f"{type(dataset).__name__}: the epoch plan orders the samples by index"
            )
        for key in ("shuffle", "sampler", "batch_sampler", "drop_last", "generator"):
            if dataloader_kwargs.get(key) not in (None, False):
                raise UserError(
                    f"run.loader(..., {key}=...): the epoch plan shuffles, shards and batches "
                    "the samples itself (each sample once per epoch, at any world size, resumed "
                    "where it stopped); a sampler, shuffle, drop_last or generator of your own "
                    f"would bypass it: remove {key}="
                )
            dataloader_kwargs.pop(key, None)
        init = dataloader_kwargs.get("worker_init_fn")
        if init is not None and not callable(init):
            raise UserError(
                f"run.loader(..., worker_init_fn={init!r}): give a function of the worker's id, "
                "or none"
            )
        if dataloader_kwargs.pop("batch_size", None) is not None:
            raise UserError("run.loader(dataset, batch_size=...): give batch_size once")
        if not isinstance(accumulate, int) or accumulate < 1:
            raise UserError(f"run.loader(..., accumulate={accumulate!r}): must be an int >= 1")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            said = self.batch_key.seen(repr(batch_size))
            raise UserError(
                f"{said}: must be an int >= 1, the samples of one optimizer step on all ranks "
                f"together (a multiple of world size x {self.batch_key.accumulate} = "
                f"{self.world_size} x {accumulate})"
            )
        check_fits(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            self.world_size * accumulate,
            self.what or "the dataset",
            self.batch_key,
        )
        self._loader = Loader(
            self,
            dataset,
            batch_size,
            accumulate,
            set_epoch if set_epoch is not None else getattr(dataset, "set_epoch", None),
            dict(dataloader_kwargs),
        )
        if self.own_loop:  # the script's code since its last call built its data
            self.startup.mark(TASK_DATA)
        return self._loader

    def _plan_epoch(self) -> None:
        """The current epoch's global batches from the state: its saved plan (a checkpoint's), with
        a new segment where a resume changed the batch size."""
        loader = self._loader
        if loader is None:
            return
        s = self.state
        if s.sample_in_epoch is None:  # a checkpoint that counted steps of the batch size
            s.sample_in_epoch = s.step_in_epoch * loader.batch_size
        old = EpochPlan.of(loader.n, loader.batch_size, s.plan)
        self.plan = old.with_batch(s.sample_in_epoch, loader.batch_size)
        if self.plan is not old and self.rank == 0:
            log.warning(
                "batch size %d from sample %d of epoch %d on (the epoch started with %d)",
                loader.batch_size,
                s.sample_in_epoch,
                s.epoch + 1,
                old.segments[-1][1],
            )
        s.plan = self.plan.as_list()
        self.steps_per_epoch = self.plan.steps()
        if self.checkpointer is not None:
            self.checkpointer.steps_per_epoch = self.steps_per_epoch

    def _iterate(self, loader: Loader) -> Iterator[Any]:
        """This epoch's batches from the position reached; counts what each step takes."""
        self._live("iterating run.loader")
        if not self._in_epoch:
            raise UserError(
                "run.loader is iterated inside `for epoch in run.epochs(n):` (the epoch plan "
                "needs the epoch and the position the run reached)"
            )
        if self._micro or self._awaiting_step:
            self._step_missing()
        s = self.state
        loader.sampler.set_epoch(s.epoch, s.sample_in_epoch or 0, self.plan)
        self._steps = iter(self.plan.batches_from(s.sample_in_epoch or 0))  # type: ignore[union-attr]
        accumulate = loader.accumulate
        batches = workers.started(loader.dataloader(s.epoch))
        while True:
            # The heartbeat's data wait: a step's first batch is waited for from the step's mark
            # (run.step's clock read), a later micro-batch from when the loop asks for it.
            asked = self._step_mark if self._micro == 0 else time.perf_counter()
            try:
                items = next(batches)
            except StopIteration:
                break
            self._data_wait += time.perf_counter() - asked
            if self._micro == 0:
                if self._awaiting_step:
                    self._step_missing()
                self.global_batch = next(self._steps)
                self._profile.begin(s.global_step + 1)
            if self._first_batch:
                self._first_batch = False
                self.startup.mark(FIRST_BATCH)
            self._micro += 1
            if self._micro == accumulate:
                self._micro, self._awaiting_step = 0, True
            self._fetched = True
            yield items

    def _step_missing(self) -> None:
        raise UserError(
            f"run.step() was not called after global step {self.state.global_step + 1}'s "
            "batch of run.loader: call run.step(loss=...) once after each optimizer.step() (a "
            "step of several batches: run.loader(..., accumulate=N)), or a resume cannot know "
            "which samples were trained"
        )

    # -- state --------------------------------------------------------------------------------
    def restore(
        self,
        model: torch.nn.Module | None = None,
        optimizer: object | None = None,
        **states: object,
    ) -> bool:
        """Register what every checkpoint holds: ``model`` (``model.pt``, a plain state_dict),
        ``optimizer`` and ``states`` (each by its name in ``train_state.pt``; None is skipped),
        beside the run's counters and every rank's random streams; then restore the newest
        committed checkpoint that verifies. True when resumed."""
        self._live("run.restore")
        if self.checkpointer is not None:
            raise UserError(
                "run.restore was called twice: register every state in one call, "
                "run.restore(model=..., optimizer=..., scheduler=..., ...), before the loop"
            )
        if self._in_epoch:
            raise UserError("run.restore(...) came inside the epochs loop: call it once before it")
        if model is None:
            raise UserError(
                "run.restore(...) needs the model: run.restore(model=model, optimizer=optimizer)"
            )
        try:
            module = self.unwrap(model)
        except UserError as exc:
            raise UserError(f"run.restore(model=...): {exc}") from None
        registered: dict[str, Stateful] = {}
        streams: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {}
        for name, obj in (("optimizer", optimizer), *states.items()):
            if obj is None:
                continue
            if name in RESERVED:
                raise UserError(
                    f"run.restore({name}=...): {name!r} is a name the checkpoint keeps for itself "
                    f"({', '.join(RESERVED)}); register it under another name"
                )
            if isinstance(obj, torch.nn.Module) and id(obj) in self._modules:
                obj = self._modules[id(obj)]  # a second model set up: its plain state_dict
            stream = _stream(obj)
            if stream is not None:
                streams[name] = stream
                continue
            registered[name] = _stateful(name, obj)
        registered["train"] = self.state
        for name, (get, put) in streams.items():
            rng.track(name, get, put)
        self._streams = list(streams)
        self._module = module
        self._optimizers = [o for o in registered.values() if isinstance(o, torch.optim.Optimizer)]
        self.checkpointer = Checkpointer(
            self.config,
            self.paths,
            module,
            registered,
            self.state,
            max(1, self.steps_per_epoch),
            self.attempt,
            self.phases,
            before_commit=self._commit_check,
            after_commit=self.timeline.committed,
        )
        self.startup.mark(MODEL)
        t0 = time.monotonic()
        resumed = self.checkpointer.restore(self._loader.data if self._loader is not None else None)
        if resumed:  # the state restored is a committed one
            self._saved_at = (self.state.global_step, self.state.position)
        self.startup.mark(RESTORE)
        self.timeline.restored(
            self.state.global_step, time.monotonic() - t0, self.checkpointer.restored_from
        )
        if self.rank == 0:
            # What the run continues from; a checkpoint skipped as damaged is not in it.
            rundir.write_ledger(self.paths, self.state.ledger.record_file(self.state.global_step))
        self._forget_mined_rounds()
        self.guard.start(self.state.global_step)
        self._resumed = resumed
        if self.state.mining_history:
            self._mines = True
        return resumed

    def before_commit(self, check: Callable[[str], None]) -> None:
        """``check(event)`` runs (collectively) before each checkpoint commits; raising refuses the
        state."""
        self._before_commit.append(check)

    def at_finish(self, write: Callable[[], None]) -> None:
        """``write()`` runs (collectively) in ``finish``, after ``model.pt``."""
        self._at_finish.append(write)

    def _commit_check(self, event: str) -> None:
        # Every point up to a checkpoint is on disk: a resume logs only later steps again.
        self.writer.flush()
        # A non-finite state is never committed.
        self.guard.check(self.state.global_step, self._state_tensors())
        for check in self._before_commit:
            check(event)

    def _state_tensors(self) -> Iterator[object]:
        """This rank's part of every weight and optimizer tensor (its shards under fsdp)."""
        if self._module is not None:
            yield from parallel.local(self._module.parameters())
            yield from parallel.local(self._module.buffers())
        for opt in self._optimizers:
            for per_param in opt.state.values():
                yield from parallel.local(per_param.values())

    # -- epochs and steps ---------------------------------------------------------------------
    def epochs(self, n: int) -> Iterator[int]:
        """The epochs ``0 .. n-1`` this run has not finished, from where it left off. The end of
        each commits its checkpoint (after the loop's eval and mining) and asks every rank
        whether to stop."""
        self._live("run.epochs")
        if self.checkpointer is None:
            raise UserError(
                "run.epochs(...) came before run.restore: register the model and its states "
                "with run.restore(model=..., optimizer=...) first, so that a resume can skip "
                "what was trained"
            )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UserError(f"run.epochs({n!r}): give the number of epochs, an int >= 1")
        self.total_epochs = n
        self.checkpointer.total_epochs = n
        self._plan_epoch()
        self._open_writer()  # now: the first step this attempt logs depends on the plan
        self._profile = profile_for(
            self.config.train.profile_window,
            self.rank,
            self.attempt,
            self.paths,
            self.device.type == "cuda",
        )
        self.report(running=True)
        while self.state.epoch < n:
            self._begin_epoch()
            yield self.state.epoch
            self._end_epoch()

    def _begin_epoch(self) -> None:
        s = self.state
        self._plan_epoch()
        loader = self._loader
        if loader is not None and loader.set_epoch is not None:
            loader.set_epoch(s.epoch)
        self._in_epoch, self._fetched, self.global_batch = True, False, None
        self._micro, self._awaiting_step = 0, False
        self.phases.step = s.global_step
        self.phases.set(phases.TRAIN)
        self._step_mark = self._busy_until = time.perf_counter()
        self._waited_mark = self._waited_until = dist.waited_s()
        self._data_wait = 0.0
        if self._steps_left() == 0:  # resumed after the epoch's last step, before its end
            self._steps_done_rng = capture_rng()
            reason = self.stop.agree()
            if reason:
                self._stop(reason)

    def _steps_left(self) -> int:
        if self._loader is None or self.plan is None:
            return 0
        return len(self.plan.batches_from(self.state.sample_in_epoch or 0))

    def _end_epoch(self) -> None:
        self._live("the end of an epoch")
        if self._micro or self._awaiting_step:
            self._step_missing()
        left = self._steps_left()
        if left:
            raise UserError(
                f"epoch {self.state.epoch + 1} ended with {left} of its {self.steps_per_epoch} "
                "steps untrained (the loop over run.loader stopped early), so this epoch would "
                "not train each sample once; to end the run early, leave the epochs loop too "
                "and call run.finish()"
            )
        if self._mines is None and self.mining_due():
            self._mines = False  # a round was due, and the script did not call run.mine
        self._in_epoch = False
        self.state.epoch_done()
        self._save(checkpointer.EPOCH_END)
        self._forget_mined_rounds()
        reason = self.stop.agree()
        if reason:
            log.warning(
                "%s: saved at global step %d (the end of epoch %d) and stopping",
                WHY.get(reason, reason),
                self.state.global_step,
                self.state.epoch,
            )
            self._end_stopped(reason)

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        metrics: Mapping[str, torch.Tensor | float] | None = None,
    ) -> None:
        """After each optimizer step: count it (and its samples, in the ledger), log ``loss`` and
        ``metrics`` at the log cadence (kept on the device until then), save when a checkpoint is
        due; when every rank agreed to stop, save, end the job and raise :class:`RunStopped`."""
        self._live("run.step")
        if not self._awaiting_step:
            self._step_refused()
        self._awaiting_step = False
        start, size = self.global_batch  # type: ignore[misc]
        self.global_batch = None
        loader = self._loader
        assert loader is not None
        mine = sum(
            len(shard_range(m, self.rank, self.world_size)) for m in split(size, loader.accumulate)
        )
        if loss is not None:
            self.guard.observe(loss if torch.is_tensor(loss) else torch.tensor(float(loss)))
        if loss is not None or metrics:
            self.window.add(loss, metrics or {})
        self.window.throughput.add(mine)
        s = self.state
        s.step_done(size)
        s.ledger.record(
            s.epoch,
            loader.data,
            start,
            start + size,
            self.attempt,
            self.world_size,
            loader.batch_size,
        )
        self._profile.end(s.global_step)
        # Python numbers: the heartbeat reads nothing from the device.
        busy = self._busy_until - self._step_mark - (self._waited_until - self._waited_mark)
        now = time.perf_counter()
        self.phases.tick(
            s.global_step,
            busy if self._busy_until > self._step_mark else None,
            self._data_wait,
            now - self._step_mark,
        )
        self._step_mark, self._waited_mark, self._data_wait = now, dist.waited_s(), 0.0
        if self._first_step:
            self._first_step = False
            self.startup.mark(FIRST_STEP)
            self.timeline.first_step(s.global_step)
            if self.rank == 0:  # an attempt a restart inside the job started: when it trains
                restarts.note_first_step(self.paths, self.attempt, s.global_step)
        if self._log_due():
            self._log_interval()
            self.window.clear()
        # The goodput record of where the attempt got (a clock read; a write at most every
        # second): a kill loses no more of it, whatever the log cadence.
        self.timeline.progress(s.global_step)
        reason = self.stop.poll()  # the answer of the previous step's reduce: no wait
        last = s.step_in_epoch == self.steps_per_epoch
        if reason and last and not self.stop_before_epoch_end:
            reason = ""  # the epoch's end stops: its flag stays set until then
        if not reason:
            loop_end = last and self._loop_end_kept()
            self._save(checkpointer.LOOP_END if loop_end else checkpointer.STEP)
            if last:
                # A round cut short is redone from here, the loop's eval included.
                self._steps_done_rng = capture_rng()
                if self.stop_before_epoch_end:
                    # After the last step, the reduce in flight is read at once (blocking costs
                    # nothing here): a signal during the last step stops before the
                    # end-of-epoch work, not after it.
                    reason = self.stop.agree()
        if reason:
            self._stop(reason)

    def _loop_end_kept(self) -> bool:
        """Whether this epoch's last step is saved as the loop ended it: a script that mines (or
        may), before a round."""
        return not self.stop_before_epoch_end and self._mines is not False and self.mining_due()

    def _step_refused(self) -> None:
        if not self._in_epoch:
            raise UserError(
                "run.step() came outside `for epoch in run.epochs(n):`; call it after each "
                "optimizer step of the loop over run.loader"
            )
        if self._micro:
            accumulate = self._loader.accumulate if self._loader is not None else 1
            raise UserError(
                f"run.step() came after {self._micro} of the {accumulate} batches of a step "
                f"(run.loader(..., accumulate={accumulate})): call it once per optimizer step"
            )
        if not self._fetched:
            raise UserError(
                "run.step(): no batch of run.loader came before this step; a DataLoader of your "
                "own (shuffle=True, a DistributedSampler) bypasses the epoch plan, so neither the "
                "exact resume nor each sample once per epoch would hold: build it with "
                "loader = run.loader(dataset, batch_size=...) and iterate that"
            )
        raise UserError(
            "run.step() was called twice after one batch of run.loader: call it once after each "
            "optimizer.step()"
        )

    def _log_due(self) -> bool:
        s = self.state
        return (
            s.global_step % self.config.train.log_every_steps == 0
            or s.step_in_epoch == self.steps_per_epoch
        )

    # -- stopping -----------------------------------------------------------------------------
    def _save(self, event: str) -> None:
        assert self.checkpointer is not None
        scalars = self.checkpointer.save(event)
        if scalars:
            self._saved_at = (self.state.global_step, self.state.position)
            self.log(scalars)
            self.writer.tag("clusterflow.checkpoint", f"step-{self.state.global_step} ({event})")
            # A resume from this checkpoint logs from the next step: these points are not logged
            # again.
            self.writer.flush()
        if event in (checkpointer.EPOCH_END, checkpointer.STOP):
            # Where a stop or an epoch's end left the run, whatever the progress cadence skipped.
            self.report()

    def _saved_now(self) -> bool:
        """Whether a save holds the state as it is (committed, or its write in flight)."""
        return self._saved_at == (self.state.global_step, self.state.position)

    def _stop(self, reason: str) -> None:
        log.warning(
            "%s: saving at global step %d and stopping",
            WHY.get(reason, reason),
            self.state.global_step,
        )
        if self._saved_now():  # resumed after an epoch's last step: the checkpoint holds it
            self.checkpointer.landed()
            self.report()
        else:
            self._save(checkpointer.STOP)
        self._end_stopped(reason)

    def _end_stopped(self, reason: str) -> None:
        outcome, code = self._end(reason)
        raise RunStopped(outcome, code)

    def _end(self, outcome: str) -> tuple[str, int]:
        self.close(outcome)
        final, code = self._ending(outcome)
        self.outcome = final
        return final, code

    def close(self, outcome: str) -> None:
        """At the end of the attempt, whatever the reason: the profile, the attempt's timeline,
        the metrics and trackers, the write in flight."""
        if self._closed:
            return
        self._closed = True
        rng.untrack(self._streams)
        self._profile.close()
        self.timeline.ended(outcome, self.state.global_step, self._writer or NullWriter())
        if self._writer is not None:
            self._writer.close(outcome)
        if self.checkpointer is not None:
            self.checkpointer.close()

    def _live(self, what: str) -> None:
        if self.outcome is None:
            return
        if self.outcome == State.COMPLETED:
            raise UserError(f"{what} came after run.finish(): the run has ended (completed)")
        raise UserError(
            f"{what} came after the run stopped ({self.outcome}): the stop raised "
            "clusterflow.RunStopped, a SystemExit, and the script caught it (an `except "
            "BaseException:` or `except SystemExit:`); let it end the script: the run resumes "
            "from its checkpoint when it starts again"
        )

    # -- mining -------------------------------------------------------------------------------
    def mining_due(self, can_embed: bool = True) -> bool:
        """Whether this epoch's end runs a mining round (``mining.*``)."""
        return self.miner.due(self.state.epoch + 1, self.total_epochs, can_embed)

    def mine(
        self,
        embed: Callable[[Any], torch.Tensor] | Task,
        dataset: Dataset | None = None,
        ground_truth: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """The mining stage, when due after this epoch (``mining.*``): ``embed(batch)`` on every
        rank's shard of ``dataset`` (default: the loader's; a batch as its DataLoader yields
        it, on the device, in eval mode without gradients), the k-NN graph and clusters on rank 0,
        the labels on every rank. Returns the labels (int64, -1 for none) or None when no round is
        due; ``run.labels`` keeps the last round's. A stop during the round saves and ends the
        job (:class:`RunStopped`); the next attempt continues the round."""
        self._live("run.mine")
        if not self._in_epoch:
            raise UserError(
                "run.mine(...) belongs inside `for epoch in run.epochs(n):`, after the epoch's "
                "steps"
            )
        left = self._steps_left()
        if left or self._micro or self._awaiting_step:
            raise UserError(
                f"run.mine(...) came before the end of epoch {self.state.epoch + 1}'s steps "
                f"({left} left): call it after the loop over run.loader"
            )
        self._mines = True
        finished = self.state.epoch + 1
        if self._mined == finished:
            raise UserError(
                f"run.mine(...) was called twice in epoch {finished}; its labels are run.labels"
            )
        if isinstance(embed, Task):
            source: Task = embed
        else:
            data = dataset if dataset is not None else getattr(self._loader, "dataset", None)
            if data is None:
                raise UserError("run.mine(embed, dataset=...): name the dataset to embed")
            source = _Embedding(embed, data, ground_truth, self.device)
        if not self.miner.due(finished, self.total_epochs, source.can_embed):
            return None
        self._mined = finished
        module = self._module
        assert module is not None
        with parallel.gathered(module):
            result = self.miner.run(source, module, finished)
        if result is None:
            self._stop_in_round(self.stop.agree() or StopReason.PREEMPTED, finished)
        self.state.labels = result.labels
        self.state.mining_history.append(result.stats)
        self._log_mining(result.stats)
        return result.labels

    def _stop_in_round(self, reason: str, finished: int) -> None:
        """A signal cut the round after epoch ``finished`` short: the next attempt resumes at the
        loop's end of that epoch (the code after the loop runs again, on the states as the loop
        ended them) and continues the round from its files."""
        why = WHY.get(reason, reason)
        if self._saved_now():
            # Saved at the epoch's last step (LOOP_END), or the checkpoint this attempt resumed
            # from.
            self.checkpointer.landed()
            self.report()
        elif self.stop_before_epoch_end:
            # The task trainer: its eval before the round changes no registered state, only the
            # random streams, which go back to the last step's.
            if self._steps_done_rng is not None:
                restore_rng(self._steps_done_rng)
            self._save(checkpointer.STOP)
        else:
            # A script that had not called run.mine in an epoch due to mine: its loop's end was
            # not kept, and its code after the loop may have changed the states, which must not
            # be saved: the newest checkpoint stays the resume point, and the steps after it are
            # trained again.
            self.checkpointer.landed()
            newest = max(self.committed_steps(), default=0)
            log.warning(
                "%s: stopping in the mining round after epoch %d, whose loop's end was not kept "
                "(an earlier epoch due to mine had no run.mine): nothing new is saved; the next "
                "attempt resumes from step %d and trains the %d step(s) after it again",
                why,
                finished,
                newest,
                self.state.global_step - newest,
            )
            self._end_stopped(reason)
        log.warning(
            "%s: saved at global step %d (in the mining round after epoch %d, which the "
            "next attempt continues) and stopping",
            why,
            self.state.global_step,
            finished,
        )
        self._end_stopped(reason)

    def _forget_mined_rounds(self) -> None:
        """Delete the files of the mining rounds whose labels a committed checkpoint holds."""
        if self.rank == 0 and self.checkpointer is not None:
            self.miner.forget_rounds(self.checkpointer.committed_epoch())

    # -- the end ------------------------------------------------------------------------------
    def finish(self) -> str:
        """The end of the run: the last state committed (saved now if the loop left before an
        epoch's end), ``RUN_DIR/model.pt`` written (the whole model, gathered under fsdp), the job
        ended. Returns the job's outcome (``completed``)."""
        self._live("run.finish")
        if self.checkpointer is None or self._module is None:
            raise UserError(
                "run.finish() came before run.restore(model=...): nothing was registered, so "
                "nothing could be saved"
            )
        if self._micro or self._awaiting_step:
            self._step_missing()
        self._in_epoch = False
        self.report(running=True)
        if self._saved_at != (self.state.global_step, self.state.position):
            self._save(checkpointer.STOP)
        self.checkpointer.finish()  # the last checkpoint is committed before the run counts as done
        # Under fsdp: the whole model, gathered (collective), so model.pt loads into the plain one.
        sharded = parallel.is_sharded(self._module)
        weights = parallel.full_state_dict(self._module) if sharded else None
        if self.rank == 0:
            durable.write_atomic(
                self.paths.model,
                weights if sharded else self._module.state_dict(),
                codec=TORCH,
            )
        for write in self._at_finish:
            write()
        dist.barrier()
        outcome, _ = self._end(State.COMPLETED)
        return outcome

    # -- reporting ----------------------------------------------------------------------------
    @property
    def writer(self) -> NullWriter:
        """TensorBoard, metrics.jsonl and the trackers (rank 0), opened at the first use."""
        return self._open_writer()

    def _open_writer(self) -> NullWriter:
        """From the first step this attempt logs: TensorBoard drops what earlier attempts logged
        from there on."""
        if self._writer is None:
            self._writer = writer_for(
                self.rank == 0,
                self.paths,
                self.attempt,
                self._purge_step(),
                self.config.trackers,
                self.config.to_dict(),
            )
        return self._writer

    def _purge_step(self) -> int:
        """The resumed step itself is logged again only when its end-of-epoch work is redone."""
        s = self.state
        at_end = self._resumed and self.plan is not None
        return (
            s.global_step
            if at_end and s.step_in_epoch == self.steps_per_epoch
            else s.global_step + 1
        )

    def log(self, scalars: Mapping[str, float]) -> None:
        """Scalars at the current global step: TensorBoard, metrics.jsonl, the trackers (rank 0),
        and ``checkpoint.keep_best``'s metric. The loop's loss is logged by ``step``."""
        self.writer.scalars(scalars, self.state.global_step)
        if self.checkpointer is not None:
            self.checkpointer.note(scalars)

    def _log_interval(self) -> None:
        window, s = self.window, self.state
        rep = window.throughput.report()
        # One collective for the finite check, the means and the throughput (a sum: the mean
        # times the world size).
        reduced = self.guard.check(
            s.global_step, means={**window.means(), "rate": rep["samples_per_s_rank"]}
        )
        rate = reduced.pop("rate") * self.world_size
        lr = self._optimizers[0].param_groups[0]["lr"] if self._optimizers else None
        out = {
            **reduced,
            **({"train/lr": float(lr)} if lr is not None else {}),
            "perf/samples_per_s_total": rate,
            "perf/samples_per_s_rank0": rep["samples_per_s_rank"],
            "perf/step_time_s": rep["step_time_s"],
            "train/epoch": s.epoch + s.step_in_epoch / max(1, self.steps_per_epoch),
            **gpu_stats(),
            **self.phases.scalars(),
        }
        self.log(out)
        if self.rank == 0:
            log.info(
                "epoch %d step %d/%d (global %d)%s%s %.0f samples/s",
                s.epoch + 1,
                s.step_in_epoch,
                self.steps_per_epoch,
                s.global_step,
                f" loss {out['train/loss']:.4f}" if "train/loss" in out else "",
                f" lr {out['train/lr']:.2e}" if "train/lr" in out else "",
                out["perf/samples_per_s_total"],
            )
        self._logged = {
            **({"last_loss": out["train/loss"]} if "train/loss" in out else {}),
            "samples_per_s": out["perf/samples_per_s_total"],
        }
        # Each write is a rename: milliseconds on ext4 or NFS, so at most one a second.
        if self._progress_due.due():
            self.report(fsync=False, running=True)

    def _log_mining(self, s: dict[str, Any]) -> None:
        scalars = {
            f"mining/{k}": float(v)
            for k, v in s.items()
            if isinstance(v, (int, float)) and k != "epoch"
        }
        scalars.update({f"mining/seconds_{k}": float(v) for k, v in s["seconds"].items()})
        scalars["mining/embed_per_s_total"] = s["embed_per_s_total"]
        scalars.update(
            {f"mining/embed_per_s_rank{r}": v for r, v in enumerate(s.get("embed_per_s_rank", []))}
        )
        self.log(scalars)
        labels = self.state.labels
        if labels is not None:
            sizes = np.bincount(labels[labels >= 0])
            if len(sizes):
                self.writer.histogram("mining/cluster_sizes", sizes, self.state.global_step)
        if "curve" in s:
            self.writer.image("mining/curve", lambda: figure.render(s), self.state.global_step)
        if self.rank == 0:
            q = "".join(
                f" {k} {s[k]:.3f}" for k in ("nmi", "ari", "pairwise_f", "bcubed_f") if k in s
            )
            log.info(
                "mining after epoch %d: %d clusters, %d singletons, largest %d, %.2f s;%s",
                s["epoch"],
                s["num_clusters"],
                s["num_singletons"],
                s["largest_cluster"],
                s["seconds"]["total"],
                q,
            )
        self.report(mining=for_status(self.state.mining_history))

    def report(self, fsync: bool = True, running: bool = False, **fields: object) -> None:
        """Rank 0: the progress into status.json, with ``fields``; ``running`` says the attempt
        goes on (a transition: refused after another writer ended the run)."""
        if self.rank == 0:
            s = self.state
            progress = {
                "epoch": s.epoch,
                "global_step": s.global_step,
                "step_in_epoch": s.step_in_epoch,
                "steps_per_epoch": self.steps_per_epoch,
                "phase": self.phases.current,
                **self._logged,
                **fields,
            }
            if running:
                transitions.mark_running(self.paths, fsync=fsync, **progress)
            else:
                transitions.report(self.paths, fsync=fsync, **progress)
