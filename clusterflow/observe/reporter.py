"""What a run tells the outside while it trains, for scripts and tasks alike: the metrics at the
log cadence (TensorBoard, ``metrics.jsonl``, the trackers), status.json's progress, the attempt's
timeline and start-up marks, the straggler measure of each step, and ``train.profile``'s window.

The run (``train/session.py``) says what happened (a batch came, a step was counted, a log step
is due); the :class:`Reporter` decides what is written and when. Nothing here reads a tensor: a
step's numbers are Python numbers, and the losses reach it already reduced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from clusterflow.distributed import comm as dist
from clusterflow.observe.context import JobContext
from clusterflow.observe.metrics import Every, NullWriter, gpu_stats, writer_for
from clusterflow.observe.profiling import NoProfile, profile_for
from clusterflow.observe.timeline import FIRST_BATCH, FIRST_STEP, Startup, timeline_for
from clusterflow.rundir import restarts, transitions
from clusterflow.rundir.inflight import InFlight

log = logging.getLogger("clusterflow.trainer")

# Where the run is, as status.json and the log line show it: epoch, global_step, step_in_epoch,
# steps_per_epoch; and max_steps for a loop without a loader (run.steps(max_steps)), whose unit
# is the step.
Progress = Callable[[], dict[str, int]]


class StepClock:
    """A step's own part (data, forward) less its waits in collectives, for the straggler watch:
    the marks of the step's start and of its last forward (:class:`ForwardMark`); and the
    seconds the step waited for its batches, for the heartbeat's data wait."""

    def __init__(self) -> None:
        self.forwards = 0  # forwards of a set-up model so far (a peek at a batch has none)
        self.reset()

    def reset(self) -> None:
        self.step_mark = self.busy_until = time.perf_counter()
        self.waited_mark = self.waited_until = dist.waited_s()
        self.data_wait = 0.0

    def forward_ended(self) -> None:
        self.busy_until, self.waited_until = time.perf_counter(), dist.waited_s()
        self.forwards += 1

    def asking(self, first_of_step: bool) -> float:
        """The loop asks for a batch: a step's first batch is waited for from the step's start
        (run.step's clock read), a later micro-batch from now."""
        return self.step_mark if first_of_step else time.perf_counter()

    def came(self, asked: float) -> None:
        self.data_wait += time.perf_counter() - asked

    def lap(self) -> tuple[float | None, float, float]:
        """This step's busy seconds (None when no forward of a set-up model ran in it), the
        seconds it waited for its batches, and its length; the next step starts now."""
        now = time.perf_counter()
        busy = self.busy_until - self.step_mark - (self.waited_until - self.waited_mark)
        seen = self.busy_until > self.step_mark
        lap = (busy if seen else None, self.data_wait, now - self.step_mark)
        self.step_mark, self.waited_mark, self.data_wait = now, dist.waited_s(), 0.0
        return lap


def _no_mark(*_: object) -> None:
    """The forward hook of a copy of a set-up model (an EMA, an AveragedModel): nothing."""


def _no_mark_factory() -> Callable[..., None]:
    return _no_mark


class ForwardMark:
    """A forward hook on a set-up model: the step's own part ends with its last forward. A copy
    or a pickle of the model gets :func:`_no_mark`, so copying a model never copies the run."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def __call__(self, *_: object) -> None:
        self.clock.forward_ended()

    def __deepcopy__(self, memo: dict[int, object]) -> Callable[..., None]:
        return _no_mark

    def __reduce__(self) -> tuple[Callable[..., None], tuple[()]]:
        return _no_mark_factory, ()


class Reporter:
    """One attempt's reports on this rank (rank 0 writes; the other ranks' writer, timeline and
    status writes do nothing). ``progress()`` says where the run is; ``note(scalars)`` also
    hears every logged scalar (``checkpoint.keep_best``'s metric)."""

    def __init__(
        self,
        ctx: JobContext,
        startup: Startup,
        *,
        progress: Progress,
        note: Callable[[Mapping[str, float]], None],
        cuda: bool,
    ) -> None:
        paths, attempt = ctx.paths, ctx.attempt
        self.cfg, self.paths, self.attempt, self.phases = ctx.cfg, paths, attempt, ctx.phases
        self.rank, self.world_size = dist.rank(), dist.world()
        self.startup, self.progress, self.note, self.cuda = startup, progress, note, cuda
        # Rank 0's record of this attempt in time, for the goodput ledger.
        self.timeline = timeline_for(
            self.rank == 0, paths, attempt, ctx.phases, startup, world_size=self.world_size
        )
        self.clock = StepClock()
        self._writer: NullWriter | None = None
        self.profile: NoProfile = NoProfile()
        self._progress_due = Every(1.0)  # status.json's progress fields
        # The latest log step's loss and rate: every status write carries them, so the epoch's
        # and the run's end record the last logged loss even when the cadence skipped its write.
        self._logged: dict[str, float] = {}
        self._first_batch = self._first_step = True
        # The step this rank is about to train and its samples, for a crash that leaves nothing
        # else (rundir/inflight.py).
        self.inflight = InFlight(paths, self.rank, attempt)

    # -- the loop's events ------------------------------------------------------------------
    def loop_starts(self, purge_step: int) -> None:
        """The loop's start: the writer opened from the first step this attempt logs (earlier
        attempts' points from there on are dropped), the profiler's window armed."""
        self.open_writer(purge_step)
        self.profile = profile_for(
            self.cfg.train.profile_window, self.rank, self.attempt, self.paths, self.cuda
        )
        self.report(running=True)

    def batch_asked(self, step: int, epoch: int, micro: int, indices: Sequence[int] | None) -> None:
        """The loop asks for micro-batch ``micro`` of ``step`` (its samples ``indices``): the
        in-flight record, before the batch is fetched."""
        self.inflight.note(step, epoch, micro, indices)

    def batch_came(self, step_begins: int | None) -> None:
        """A batch of the run's loader came; ``step_begins``: the step it starts, if it is the
        step's first."""
        if step_begins is not None:
            self.profile.begin(step_begins)
        if self._first_batch:
            self._first_batch = False
            self.startup.mark(FIRST_BATCH)

    def step_counted(self, global_step: int) -> None:
        """After the step's counters moved: the profiler, the heartbeat's step and busy time, the
        first step's marks."""
        self.profile.end(global_step)
        # Python numbers: the heartbeat reads nothing from the device.
        self.phases.tick(global_step, *self.clock.lap())
        if self._first_step:
            self._first_step = False
            self.startup.mark(FIRST_STEP)
            self.timeline.first_step(global_step)
            if self.rank == 0:  # an attempt a restart inside the job started: when it trains
                restarts.note_first_step(self.paths, self.attempt, global_step)

    def log_due(self, global_step: int, step_in_epoch: int, steps_per_epoch: int) -> bool:
        return global_step % self.cfg.train.log_every_steps == 0 or step_in_epoch == steps_per_epoch

    # -- writing ----------------------------------------------------------------------------
    @property
    def writer(self) -> NullWriter:
        """TensorBoard, metrics.jsonl and the trackers (rank 0), opened at the first use."""
        return self.open_writer(self.progress()["global_step"] + 1)

    def open_writer(self, purge_step: int) -> NullWriter:
        if self._writer is None:
            self._writer = writer_for(
                self.rank == 0,
                self.paths,
                self.attempt,
                purge_step,
                self.cfg.trackers,
                self.cfg.to_dict(),
            )
        return self._writer

    def log(self, scalars: Mapping[str, float]) -> None:
        self.writer.scalars(scalars, self.progress()["global_step"])
        self.note(scalars)

    def interval(
        self,
        reduced: dict[str, float],
        rate_rank: float,
        step_time_s: float,
        lr: float | None,
    ) -> None:
        """A log step: ``reduced``, the loop's means over every rank since the last one, with
        ``rate`` (samples a second per rank, averaged). A loop without a loader counts steps, not
        samples: its rate is in steps a second."""
        p = self.progress()
        rate = reduced.pop("rate") * self.world_size
        counted = p.get("max_steps")
        unit: dict[str, float] = (
            {"perf/steps_per_s": 1.0 / max(step_time_s, 1e-9)}
            if counted
            else {
                "perf/samples_per_s_total": rate,
                "perf/samples_per_s_rank0": rate_rank,
                "train/epoch": p["epoch"] + p["step_in_epoch"] / max(1, p["steps_per_epoch"]),
            }
        )
        out = {
            **reduced,
            **({"train/lr": float(lr)} if lr is not None else {}),
            **unit,
            "perf/step_time_s": step_time_s,
            **gpu_stats(),
            **self.phases.scalars(),
        }
        self.log(out)
        said = (
            f" loss {out['train/loss']:.4f}" if "train/loss" in out else "",
            f" lr {out['train/lr']:.2e}" if "train/lr" in out else "",
        )
        if self.rank == 0 and counted:
            log.info(
                "step %d/%d%s%s %.2f steps/s",
                p["global_step"],
                counted,
                *said,
                out["perf/steps_per_s"],
            )
        elif self.rank == 0:
            log.info(
                "epoch %d step %d/%d (global %d)%s%s %.0f samples/s",
                p["epoch"] + 1,
                p["step_in_epoch"],
                p["steps_per_epoch"],
                p["global_step"],
                *said,
                out["perf/samples_per_s_total"],
            )
        rated = (
            {"steps_per_s": out["perf/steps_per_s"]}
            if counted
            else {"samples_per_s": out["perf/samples_per_s_total"]}
        )
        self._logged = {
            **({"last_loss": out["train/loss"]} if "train/loss" in out else {}),
            **rated,
        }
        # Each write is a rename: milliseconds on ext4 or NFS, so at most one a second.
        if self._progress_due.due():
            self.report(fsync=False, running=True)

    def saved(self, scalars: Mapping[str, float], event: str) -> None:
        """A checkpoint was saved (or its write started): its scalars, the trackers' tag."""
        self.log(scalars)
        step = self.progress()["global_step"]
        self.writer.tag("clusterflow.checkpoint", f"step-{step} ({event})")
        # A resume from this checkpoint logs from the next step: these points are not logged
        # again.
        self.writer.flush()

    def report(self, fsync: bool = True, running: bool = False, **fields: object) -> None:
        """Rank 0: the progress into status.json, with ``fields``; ``running`` says the attempt
        goes on (a transition: refused after another writer ended the run)."""
        if self.rank != 0:
            return
        progress = {**self.progress(), "phase": self.phases.current, **self._logged, **fields}
        if running:
            transitions.mark_running(self.paths, fsync=fsync, **progress)
        else:
            transitions.report(self.paths, fsync=fsync, **progress)

    def close(self, outcome: str) -> None:
        """The attempt's end: the profile, the timeline, the metrics and trackers."""
        self.profile.close()
        step = self.progress()["global_step"]
        self.timeline.ended(outcome, step, self._writer or NullWriter())
        self.inflight.close()
        if self._writer is not None:
            self._writer.close(outcome)
