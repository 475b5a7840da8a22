"""Non-finite losses and weights, caught without a host read on every step.

``observe(loss)``, on every micro-step, folds the loss into two device tensors: a flag (every loss
finite since the last check) and a count (micro-steps before the first one that was not). Nothing
is read back, so a step that does not log still never waits for the device. ``check`` reads them,
with one small all-reduce so that every rank decides alike, and names the exact step of the first
non-finite loss. The trainer checks at every log step, before every checkpoint (the weights and
optimizer state too: a non-finite state is never committed) and before mining (the weights).

Policies (``train.on_nonfinite``):

- ``fail``: the first check that sees a non-finite value stops the run (status ``failed``, exit 1)
  with a message naming the step. Checkpoints are only ever committed after a check, so every
  committed one is finite, and ``keep_last`` only ever prunes finite ones.
- ``skip_step``: every optimizer step reads the flag (and whether every gradient is finite) before
  it updates the weights, and skips the update when not: one host read and one all-reduce per
  step (``benchmarks/nonfinite.py`` measures it). ``train.max_consecutive_skips`` skipped steps
  in a row fail the run as ``fail`` does: a run whose every step is skipped learns nothing.
  The step still counts (data order and learning-rate schedule move on, as with fp16's GradScaler).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import NoReturn, Protocol

import torch

from clusterflow.config.sections import TrainConfig
from clusterflow.distributed import comm as dist
from clusterflow.errors import RunFailed

log = logging.getLogger("clusterflow.trainer")

_NONE = 1 << 40  # "no non-finite loss" in the all-reduced minimum
_BAD = "\0non-finite"  # the flag's key among the means: no metric name starts with a NUL


class HasGrad(Protocol):
    """A parameter as :meth:`FiniteGuard.step_ok` sees it: something with a gradient (a
    parameter, or this rank's shard of one: ``parallel.local_grads``)."""

    @property
    def grad(self) -> torch.Tensor | None: ...


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Every element of every tensor is finite (a host read). An inf or NaN makes its tensor's sum
    inf or NaN, so finite sums prove it with one cheap reduction each; only when a sum is not
    finite (an element that is not, or finite values that overflowed) does the exact test decide."""
    if not tensors:
        return True
    device = tensors[0].device
    if bool(
        torch.isfinite(
            torch.stack([t.detach().sum().to(device, torch.float64) for t in tensors]).sum()
        )
    ):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class FiniteGuard:
    """``train``: the train section; ``committed``: the committed steps, for the failure message."""

    def __init__(
        self,
        device: torch.device,
        train: TrainConfig,
        committed: Callable[[], list[int]],
        own_loop: bool = False,
    ) -> None:
        # own_loop: a script's loop, whose learning rate and clipping are its own, not train.*'s.
        self.train, self.committed, self.own_loop = train, committed, own_loop
        self.policy = train.on_nonfinite
        self.ok = torch.ones((), dtype=torch.bool, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.checked_at = 0  # the global step up to which everything was seen finite
        self.skipped = 0  # optimizer steps skipped so far in this attempt (skip_step)
        self.in_a_row = 0

    def start(self, global_step: int) -> None:
        """Where this attempt starts (a resumed checkpoint is finite: it was checked before its
        commit)."""
        self.checked_at = global_step
        self._reset()

    def observe(self, loss: torch.Tensor) -> None:
        """Every micro-step; device-side only."""
        self.ok &= torch.isfinite(loss.detach()).all()
        self.count += self.ok

    def _reset(self) -> None:
        self.ok.fill_(True)
        self.count.zero_()

    def check(
        self,
        global_step: int,
        state: Iterable[object] = (),
        means: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Collective. Returns when every loss since the last check (and every tensor of ``state``)
        is finite on every rank; raises RunFailed naming the step otherwise. ``means``: numbers to
        average over the ranks in the same collective (a log step's loss and rate), returned
        averaged, so a log step pays for one collective, not two. Only when some rank saw a
        non-finite value does a second one find the exact step for the message."""
        first = int(torch.where(self.ok, _NONE, self.count))  # the host read
        tensors = [t for t in state if torch.is_tensor(t) and t.is_floating_point()]
        bad_state = not _all_finite(tensors)
        reduced = dist.all_reduce_dict(
            {**(means or {}), _BAD: float(first < _NONE or bad_state)}, op="mean"
        )
        if reduced.pop(_BAD) > 0:
            self._judge(first, bad_state, global_step)
        self.checked_at = global_step
        self._reset()
        return reduced

    def _judge(self, first: int, bad_state: bool, global_step: int) -> NoReturn:
        """Collective, once some rank saw a non-finite value: the earliest step over the ranks."""
        agreed = dist.all_reduce_dict({"first": _NONE - first, "state": float(bad_state)}, op="max")
        first, since = _NONE - int(agreed["first"]), self.checked_at
        if first < _NONE:
            step = since + first // self.train.grad_accum + 1
            self._fail(
                f"the loss became non-finite (NaN or inf) at global step {step} "
                f"(seen by the check at step {global_step}; every loss before step {step} was "
                "finite)"
            )
        self._fail(
            f"the weights or optimizer state became non-finite between global steps {since} and "
            f"{global_step}, while every loss was finite"
        )

    def step_ok(self, params: Iterable[HasGrad], scaler: torch.amp.GradScaler, step: int) -> bool:
        """skip_step, before optimizer step ``step``: True when its losses (every rank) and
        gradients are finite; else the step is to be skipped (a warning says so), and too many in
        a row fail. With fp16 loss scaling, infinite gradients are the scaler's business (it
        skips those steps itself), so only the loss is judged."""
        grads = [] if scaler.is_enabled() else [p.grad for p in params if p.grad is not None]
        # Host reads: the step waits for its gradients here.
        ok = bool(self.ok) and _all_finite(grads)
        good = not dist.any_rank(not ok)  # the ranks agree (each saw only its own losses)
        self._reset()
        if good:
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        limit = self.train.max_consecutive_skips
        if self.in_a_row > limit:
            self._fail(
                f"the loss or a gradient was non-finite at {self.in_a_row} optimizer steps in a "
                f"row, up to global step {step} (train.max_consecutive_skips={limit})"
            )
        if dist.rank() == 0:
            log.warning(
                "global step %d: non-finite loss or gradient; the optimizer step is skipped "
                "(%d in a row, %d in all)",
                step,
                self.in_a_row,
                self.skipped,
            )
        if scaler.is_enabled():  # what the scaler does after a step it skipped itself
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
        return False

    def _fail(self, problem: str) -> NoReturn:
        steps = self.committed()
        kept = (
            f"the newest checkpoint, step-{steps[-1]}, holds finite state"
            if steps
            else "no checkpoint was committed"
        )
        if self.own_loop:
            raise RunFailed(
                f"training diverged: {problem}. Nothing non-finite was saved ({kept}). Lower the "
                "script's learning rate or clip its gradients, and start a new run.dir"
            )
        raise RunFailed(
            f"training diverged: {problem}. Nothing non-finite was saved ({kept}). Lower train.lr "
            f"(now {self.train.lr:g}) or set train.grad_clip and start a new run.dir, or resume "
            "this one with train.on_nonfinite=skip_step to skip such steps"
        )
