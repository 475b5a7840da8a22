"""What a rank does for ``clusterflow check`` (``launch/check.py``), and only in a run dir that
holds the check's plan (``RUN_DIR/check/plan.json``: ``{"halt_at": S, "save": true}``, written by
the check before it launches the run):

- each step's record, one JSON line per step in ``RUN_DIR/check/rank<R>.jsonl``: the attempt, the
  step, this rank's loss of the step (the loop's sum, which the check's ``train.log_every_steps=1``
  clears at every step), the learning rate of every parameter group of every registered
  optimizer, a digest of what the forwards of the set-up models took since the previous step
  (the batch, whoever drew it: ``run.loader``, a ``get_batch`` of the script's own), and
  ``carried``: the script's variables whose tensors those forwards took although the script
  held them, new, at the previous ``run.step`` (a batch drawn before ``run.step`` and carried
  over to the next step: the script's frame is the first one outside clusterflow that called
  ``run.step``);
- the halt at step ``S``, in ``run.step``: the state saved there when ``save`` (a stop's
  checkpoint, synchronous), the write in flight landed (the checkpoint before it committed),
  ``{"halted": S}`` recorded, and once every rank recorded it, each one SIGKILLs itself: the
  job ends as a kill of every process at that step ends it, whatever loop the script runs. Rank 0
  marks the run failed first, saying why (the launcher would record the dead ranks as a failure
  anyway, after waiting for a result that never comes).

The loop is not changed otherwise: the record reads the loss and the inputs back to the host
(the check's runs are small), and draws no random number.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
import weakref
from typing import Any

import torch

from clusterflow import rundir
from clusterflow.checkpoint import checkpointer
from clusterflow.observe.reporter import ForwardMark, StepClock
from clusterflow.rundir import transitions
from clusterflow.storage.durable import Hasher
from clusterflow.train.saves import Saves
from clusterflow.train.window import LossWindow

log = logging.getLogger("clusterflow.trainer")

# How long a halting rank waits for the others to record their halt before it ends anyway.
HALT_WAIT_S = 60.0
# clusterflow's own code: the script's frame is the first caller outside it.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# A script's variables held at run.step: name -> a weak reference to its tensor.
Held = dict[str, "weakref.ref[torch.Tensor]"]


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested in tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _held_by_script() -> Held:
    """The tensors the script's frame holds in its variables now (a tuple's or list's items as
    ``name[i]``)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return {}
    held: Held = {}
    for name, value in frame.f_locals.items():
        if isinstance(value, torch.Tensor):
            held[name] = weakref.ref(value)
        elif isinstance(value, (tuple, list)) and len(value) <= 16:
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    held[f"{name}[{i}]"] = weakref.ref(item)
    return held


def _digest_into(h: Hasher, value: object) -> None:
    """The tensors in ``value`` (nested in tuples, lists and dicts), by dtype, shape and bytes;
    other leaves by their repr."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (tuple, list)):
        for item in value:
            _digest_into(h, item)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(str(key).encode())
            _digest_into(h, value[key])
    else:
        h.update(repr(value).encode())


class Probe:
    """This rank's records and halt for ``clusterflow check`` (None without the plan:
    :meth:`of`)."""

    def __init__(
        self, paths: rundir.RunPaths, rank: int, world: int, attempt: int, plan: dict[str, Any]
    ) -> None:
        self.paths, self.rank, self.world, self.attempt = paths, rank, world, attempt
        self.halt_at = int(plan.get("halt_at") or 0)
        self.save = bool(plan.get("save"))
        self._inputs = hashlib.sha256()
        self._file = rundir.open_jsonl(paths.check_trace(rank))
        # What the script held at the last run.step, and at the one before.
        self._held: Held = {}
        self._held_before: Held = {}
        self._carried: set[str] = set()

    @classmethod
    def of(cls, paths: rundir.RunPaths, rank: int, world: int, attempt: int) -> Probe | None:
        plan = rundir.read_json(paths.check_plan, within=paths.root)
        return cls(paths, rank, world, attempt, plan) if isinstance(plan, dict) else None

    def mark(self, clock: StepClock) -> ForwardMark:
        """The forward hook of a set-up model: the step's clock, and the inputs digested."""
        return _ProbedMark(clock, self)

    def saw(self, inputs: object) -> None:
        _digest_into(self._inputs, inputs)
        for t in _tensors(inputs):
            for name, ref in self._held.items():
                new = all(old() is not t for old in self._held_before.values())
                if ref() is t and new:
                    self._carried.add(name)

    def _write(self, row: dict[str, Any]) -> None:
        self._file.write((json.dumps({"attempt": self.attempt, **row}) + "\n").encode())
        self._file.flush()

    def stepped(self, step: int, window: LossWindow, saves: Saves) -> None:
        """After step ``step`` was counted (before its log clears the window): its record; the
        halt when it is the plan's step."""
        loss = float(window.loss) if window.losses else None
        lrs = [float(g["lr"]) for o in saves.optimizers for g in o.param_groups]
        inputs = self._inputs.hexdigest()[:16]
        carried = sorted(self._carried)
        self._write({"step": step, "loss": loss, "lr": lrs, "inputs": inputs, "carried": carried})
        self._inputs, self._carried = hashlib.sha256(), set()
        self._held_before, self._held = self._held, _held_by_script()

    def halt_due(self, step: int) -> bool:
        return step == self.halt_at

    def halt(self, step: int, saves: Saves) -> None:
        """Save (when the plan says so), let every write land, then end every rank by SIGKILL."""
        assert saves.checkpointer is not None
        if self.save and not saves.saved_now():
            saves.save(checkpointer.STOP)
        saves.checkpointer.landed()  # collective: the newest checkpoint is committed
        saves.reporter.writer.flush()
        log.warning("clusterflow check: halting at global step %d (SIGKILL)", step)
        self._write({"halted": step})
        self._file.close()
        if self.rank == 0:
            transitions.mark_failed(
                self.paths, error=f"clusterflow check halted every rank at step {step} (SIGKILL)"
            )
        # No collective may be in flight when a peer dies: the ranks meet through their files.
        deadline = time.monotonic() + HALT_WAIT_S
        while time.monotonic() < deadline and not self._all_halted(step):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)

    def _all_halted(self, step: int) -> bool:
        for rank in range(self.world):
            rows = rundir.read_jsonl(self.paths.check_trace(rank), within=self.paths.root)
            if not any(r.get("halted") == step and r.get("attempt") == self.attempt for r in rows):
                return False
        return True


class _ProbedMark(ForwardMark):
    """:class:`ForwardMark`, and the forward's positional inputs to the probe; a copy of the
    model gets no hook (``ForwardMark``'s own rule)."""

    def __init__(self, clock: StepClock, probe: Probe) -> None:
        super().__init__(clock)
        self.probe = probe

    def __call__(self, *hook_args: object) -> None:
        super().__call__()
        if len(hook_args) >= 2:  # (module, args, output)
            self.probe.saw(hook_args[1])


__all__ = ["Probe"]
