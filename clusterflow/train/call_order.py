"""The order of a run's calls, as one state object: where the loop is (:class:`Phase`), what each
call of the library API does to it (:data:`TRANSITIONS`), and the one line that refuses a call
out of order (:func:`refusal`), naming the fix. ``tests/test_call_order.py`` reads the table.

    OPEN --restore--> RESTORED --epochs|steps--> BETWEEN --epoch begins--> EPOCH
    EPOCH|STEPPED --a batch--> MICRO ... --a step's last batch--> STEP_DUE --run.step--> STEPPED
    EPOCH|STEPPED --a step of run.steps(max_steps)--> STEP_DUE      (a loop without a loader)
    MICRO|STEP_DUE --a new iteration of run.loader--> EPOCH  (the batches no step counted: again)
    EPOCH|STEPPED --the epoch ends--> BETWEEN --the loop ends--> LOOP_DONE --finish--> FINISHED
    any live phase --an agreed stop--> STOPPED

A loop that would lose exactness silently (a step not counted, a loader made after the resume
checked the data, a DataLoader of the script's own driving the steps) is stopped at its first
wrong call instead.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping

from clusterflow.errors import UserError


class Phase(enum.Enum):
    OPEN = "open"  # after start(): models set up, the loader made
    RESTORED = "restored"  # run.restore registered the states and resumed
    BETWEEN = "between epochs"  # inside run.epochs or run.steps, no epoch begun
    EPOCH = "epoch"  # an epoch began; no batch of run.loader came in it yet
    MICRO = "micro-batches"  # some, not all, micro-batches of a step came
    STEP_DUE = "step due"  # every micro-batch of a step came: run.step is due
    STEPPED = "stepped"  # run.step counted the step; the next batch, or the epoch's end
    LOOP_DONE = "loop done"  # the loop of run.epochs or run.steps ended
    FINISHED = "finished"  # run.finish: the run completed
    STOPPED = "stopped by an agreed stop"  # every rank agreed to stop: saved, the job ended


class Call(enum.Enum):
    SETUP = "run.setup"
    LOADER = "run.loader"
    RESTORE = "run.restore"
    EPOCHS = "run.epochs"
    STEPS = "run.steps"
    EPOCH_BEGIN = "the start of an epoch"
    ITERATE = "iterating run.loader"
    BATCH = "a batch of run.loader"  # a micro-batch that is not its step's last
    LAST_BATCH = "the last batch of a step"
    COUNTED_STEP = "a step of run.steps(max_steps)"  # an iteration of a loop without a loader
    RETAKE = "a new iteration of run.loader"  # after batches that no run.step counted
    STEP = "run.step"
    MINE = "run.mine"
    EPOCH_END = "the end of an epoch"
    LOOP_END = "the end of the loop"
    FINISH = "run.finish"
    STOP = "an agreed stop"


P, C = Phase, Call
_IN_EPOCH = (P.EPOCH, P.STEPPED)
_LIVE = tuple(p for p in Phase if p not in (P.FINISHED, P.STOPPED))

# (where the loop is, the call) -> where it goes; every pair not here is refused.
TRANSITIONS: dict[tuple[Phase, Call], Phase] = {
    (P.OPEN, C.SETUP): P.OPEN,
    (P.OPEN, C.LOADER): P.OPEN,
    (P.OPEN, C.RESTORE): P.RESTORED,
    (P.RESTORED, C.EPOCHS): P.BETWEEN,
    (P.RESTORED, C.STEPS): P.BETWEEN,
    (P.RESTORED, C.FINISH): P.FINISHED,
    (P.BETWEEN, C.EPOCH_BEGIN): P.EPOCH,
    (P.BETWEEN, C.LOOP_END): P.LOOP_DONE,
    **{(p, C.ITERATE): p for p in _IN_EPOCH},
    **{(p, C.BATCH): P.MICRO for p in (*_IN_EPOCH, P.MICRO)},
    **{(p, C.LAST_BATCH): P.STEP_DUE for p in (*_IN_EPOCH, P.MICRO)},
    **{(p, C.COUNTED_STEP): P.STEP_DUE for p in _IN_EPOCH},
    (P.STEP_DUE, C.STEP): P.STEPPED,
    # A peek at a batch (next(iter(loader))) that reached no model: fetched again by the loop.
    **{(p, C.RETAKE): P.EPOCH for p in (P.MICRO, P.STEP_DUE)},
    **{(p, C.MINE): p for p in _IN_EPOCH},
    **{(p, C.EPOCH_END): P.BETWEEN for p in _IN_EPOCH},
    # run.steps leaves in mid-epoch at max_steps; a script may break out of its epochs loop.
    **{(p, C.LOOP_END): P.LOOP_DONE for p in _IN_EPOCH},
    **{(p, C.FINISH): P.FINISHED for p in (*_IN_EPOCH, P.BETWEEN, P.LOOP_DONE)},
    **{(p, C.STOP): P.STOPPED for p in _LIVE},
}

# What a refusal's message may name: the step being taken, the micro-batches of it that came,
# the run.loader accumulate, the epoch (1-based), its steps left, the run's outcome, and
# "counted": a loop of run.steps(max_steps), without a loader.
Facts = Mapping[str, object]

_STEP_MISSING = (
    "run.step() was not called after global step {step}'s batch of run.loader: call "
    "run.step(loss=...) once after each optimizer.step() (a step of several batches: "
    "run.loader(..., accumulate=N)), or a resume cannot know which samples were trained"
)
_COUNTED_STEP_MISSING = (
    "run.step() was not called in step {step} of run.steps(max_steps): call run.step(loss=...) "
    "once in each iteration of the loop, after optimizer.step(), or a resume cannot know which "
    "steps were trained"
)
_AFTER_RESTORE = {
    C.SETUP: "run.setup(...) came after run.restore: set every model up first, then register "
    "it with run.restore(model=..., ...)",
    C.LOADER: "run.loader(...) came after run.restore: a resume checks the checkpoint's data "
    "(its length and digest) against the loader's dataset, so a resume on other data would go "
    "unnoticed; call loader = run.loader(dataset, batch_size=...) before run.restore(...)",
}
_OUTSIDE_EPOCH = {
    C.ITERATE: "run.loader is iterated inside `for epoch in run.epochs(n):`, or through `for "
    "batch in run.steps(loader, max_steps):` (the epoch plan needs the epoch and the position "
    "the run reached)",
    C.STEP: "run.step() came outside `for epoch in run.epochs(n):` (or run.steps); call it after "
    "each optimizer step of the loop",
    C.MINE: "run.mine(...) belongs inside `for epoch in run.epochs(n):`, after the epoch's steps",
}
_IN_LOOP = (P.BETWEEN, P.EPOCH, P.MICRO, P.STEP_DUE, P.STEPPED)


def refusal(phase: Phase, call: Call, facts: Facts) -> str:
    """The one line that refuses ``call`` in ``phase``, naming the fix."""
    f = dict(facts)
    if phase is P.FINISHED:
        return f"{call.value} came after run.finish(): the run has ended (completed)"
    if phase is P.STOPPED:
        return (
            f"{call.value} came after the run stopped ({f.get('outcome')}): the stop raised "
            "clusterflow.RunStopped, a SystemExit, and the script caught it (an `except "
            "BaseException:` or `except SystemExit:`); let it end the script: the run resumes "
            "from its checkpoint when it starts again"
        )
    if call in _AFTER_RESTORE:
        return _AFTER_RESTORE[call]
    if call is C.RESTORE:
        if phase in _IN_LOOP:
            return "run.restore(...) came inside the epochs loop: call it once before it"
        return (
            "run.restore was called twice: register every state in one call, "
            "run.restore(model=..., optimizer=..., scheduler=..., ...), before the loop"
        )
    if call in (C.EPOCHS, C.STEPS):
        name = call.value
        if phase is P.OPEN:
            return (
                f"{name}(...) came before run.restore: register the model and its states with "
                "run.restore(model=..., optimizer=...) first, so that a resume can skip what "
                "was trained"
            )
        if phase is P.LOOP_DONE:
            return (
                f"{name}(...) came after the run's loop ended: one loop of run.epochs(n) or "
                "run.steps(...) trains a run (a resume skips what it trained); "
                "give it the whole length of the run, then call run.finish()"
            )
        return (
            f"{name}(...) came inside the loop of run.epochs or run.steps: one loop trains a "
            "run; give it the whole length of the run"
        )
    if phase in (P.MICRO, P.STEP_DUE) and call is not C.STEP:
        if call is C.MINE:
            return (
                f"run.mine(...) came before the end of epoch {f.get('epoch')}'s steps "
                f"({f.get('left')} left): call it after the loop over run.loader"
            )
        return (_COUNTED_STEP_MISSING if f.get("counted") else _STEP_MISSING).format(**f)
    if call is C.STEP:
        if phase is P.MICRO:
            return (
                f"run.step() came after {f.get('micro')} of the {f.get('accumulate')} batches "
                f"of a step (run.loader(..., accumulate={f.get('accumulate')})): call it once "
                "per optimizer step"
            )
        if phase is P.EPOCH:
            return (
                "run.step(): no batch of run.loader came before this step; a DataLoader of your "
                "own (shuffle=True, a DistributedSampler) bypasses the epoch plan, so neither "
                "the exact resume nor each sample once per epoch would hold: build it with "
                "loader = run.loader(dataset, batch_size=...) and iterate that"
            )
        if phase is P.STEPPED:
            return (
                "run.step() was called twice after one batch of run.loader: call it once after "
                "each optimizer.step()"
            )
    if call in _OUTSIDE_EPOCH:
        return _OUTSIDE_EPOCH[call]
    if call is C.FINISH:
        return (
            "run.finish() came before run.restore(model=...): nothing was registered, so "
            "nothing could be saved"
        )
    # The run's own moves (an epoch's start and end, the loop's end) in a phase they never
    # come in from a script's calls.
    return f"{call.value} came in phase {phase.value!r}: the run's calls are out of order"


class CallOrder:
    """Where the loop is. ``facts()`` gives what a refusal names (called only to refuse)."""

    def __init__(self, facts: Callable[[], Facts]) -> None:
        self.phase = P.OPEN
        self.facts = facts
        self.outcome: str | None = None  # the job's outcome once the run has ended

    def check(self, call: Call) -> Phase:
        """Where ``call`` leads from here, or the one-line UserError that refuses it."""
        nxt = TRANSITIONS.get((self.phase, call))
        if nxt is None:
            raise UserError(refusal(self.phase, call, {**self.facts(), "outcome": self.outcome}))
        return nxt

    def enter(self, call: Call) -> Phase:
        """Move on by ``call``, or raise the one-line UserError that refuses it."""
        self.phase = self.check(call)
        return self.phase

    def end(self, outcome: str) -> None:
        """The run ended with the job's ``outcome`` (an agreed stop, or the end after
        ``run.finish``): every later call is refused, naming it."""
        self.outcome = outcome
        if self.phase is not P.FINISHED:
            self.enter(C.STOP)

    def allows(self, call: Call) -> bool:
        return (self.phase, call) in TRANSITIONS

    @property
    def in_epoch(self) -> bool:
        """Inside an epoch (begun, not ended)."""
        return self.phase in (P.EPOCH, P.MICRO, P.STEP_DUE, P.STEPPED)

    @property
    def mid_step(self) -> bool:
        """Batches of a step came and run.step has not counted it."""
        return self.phase in (P.MICRO, P.STEP_DUE)
