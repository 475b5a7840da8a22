"""The Task protocol, and how a task named in config is found.

A task is named in config as ``task.target: "package.module:Class"`` and built as
``Class(seed=run.seed, **task.params)``. It implements:

- ``build_model() -> nn.Module``
- ``train_dataset() -> Dataset`` whose items are dicts holding at least ``"index"`` (the sample's
  position in the dataset; labels and mining are keyed by it). It may offer ``data_digest() ->
  str``, a hash of what names each sample in index order: with its length, the identity of the
  data that a run's checkpoints record and a resume must match (the image tasks' file list and
  shard index; without one the length alone is compared)
- ``loss(model, batch, labels) -> (loss, metrics)``: ``labels`` holds the current pseudo-labels of
  the batch (a LongTensor, -1 = ignore) or None before the first mining round; ``metrics`` maps
  names to numbers averaged over the batch (logged after an all-reduce): 0-dim tensors, which stay
  on the device until a log step (best: no step waits for the GPU), or Python floats (each
  ``float(tensor)`` makes every step wait for the device)

and optionally:

- ``eval_dataset() -> Dataset | None`` and ``eval_step(model, batch) -> {name: (sum, count)}``;
  sums and counts are all-reduced over ranks, so the reported value is exact, not a mean of means.
  A sum may be a vector (e.g. per-class true positives), summed element-wise
- ``eval_metrics(totals) -> {name: float}``: turns the reduced ``{name: (sum, count)}`` into the
  reported metrics; the default reports ``sum / count`` for every scalar sum (override it for
  metrics such as macro F1 that are not a ratio of two sums)
- ``embed(model, batch) -> Tensor (B, d)``: what the mining stage clusters (``can_embed`` True)
- ``embed_dataset() -> Dataset``: what is embedded (defaults to the train dataset)
- ``ground_truth() -> np.ndarray | None``: true labels of the embedded samples, for quality metrics
- ``shard_units(model) -> list[nn.Module]``: with ``train.parallel=fsdp``, the submodules that
  are sharded as one unit each (gathered for their forward and freed after it), e.g. the
  transformer blocks; without it, the elements of the model's outermost ``nn.Sequential`` /
  ``nn.ModuleList`` containers that hold parameters. A task whose model cannot be sharded sets
  ``shard_units = None``: ``submit`` refuses fsdp for it
- ``set_epoch(epoch)``: called before each epoch (augmentations that depend on the epoch); with
  ``data.persistent_workers`` also in each DataLoader worker, on its own copy of the task, when
  the first item of a new epoch reaches it: it must only set state the task reaches (its dataset)

A parameter's valid values can be declared in its annotation with :class:`Range`
(``identities: Annotated[int, Range(min=2)] = 100``) or :class:`OneOf`
(``backbone: Annotated[str, OneOf("small", "resnet18")] = "small"``): ``submit`` refuses a value
outside them, with what they allow, before anything is written, as it refuses a value of the
wrong type.

A task whose construction takes long (scanning a large folder) calls :func:`check_stop` now and
then: while ``load_task`` builds it, a stop signal (preemption, time limit, cancel) raises
:class:`Stopped` there, and the job ends before its first step instead of after the scan.

See docs/tasks.md for a complete example.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import typing
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from clusterflow.errors import TaskError, UserError

if TYPE_CHECKING:  # the login side imports this module: torch and numpy are named, not imported
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import Dataset


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric task parameter takes, declared in its annotation, e.g.
    ``keep: Annotated[float, Range(0, 1)]`` or ``temperature: Annotated[float, Range(0,
    open_min=True)]`` (> 0). ``min``/``max``: None for no bound; a NaN is never in range."""

    min: float | None = None
    max: float | None = None
    open_min: bool = False
    open_max: bool = False
    what: str = ""  # what the number means, shown with a refusal, e.g. "pixels per side"

    def holds(self, value: object) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return True  # a value of another type is the type check's to refuse
        if isinstance(value, float) and math.isnan(value):
            return False
        low = self.min is None or (value > self.min if self.open_min else value >= self.min)
        high = self.max is None or (value < self.max if self.open_max else value <= self.max)
        return low and high

    def __str__(self) -> str:
        low = None if self.min is None else f"{'>' if self.open_min else '>='} {self.min:g}"
        high = None if self.max is None else f"{'<' if self.open_max else '<='} {self.max:g}"
        bounds = " and ".join(b for b in (low, high) if b) or "any number"
        return f"{bounds} ({self.what})" if self.what else bounds


@dataclasses.dataclass(frozen=True, init=False)
class OneOf:
    """The only values a task parameter takes, declared in its annotation, e.g.
    ``channels: Annotated[int, OneOf(1, 3, what="grey or RGB")]`` or
    ``backbone: Annotated[str, OneOf("small", "resnet18")]``."""

    values: tuple[object, ...]
    what: str = ""

    def __init__(self, *values: object, what: str = "") -> None:
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "what", what)

    def holds(self, value: object) -> bool:
        # True == 1 in Python: a bool matches only a bool
        return any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.values
        )

    def __str__(self) -> str:
        listed = ", ".join(str(v) for v in self.values)
        return f"one of {listed} ({self.what})" if self.what else f"one of {listed}"


class DatasetError(UserError):
    """Bad data met while reading an item (an image that does not decode, a damaged shard): one
    line naming the file and the fix. Raised in a DataLoader worker, it reaches the main process
    rebuilt from "Caught ... Original Traceback ...": only its own last line is kept, so the
    job's error stays that one line."""

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


class Stopped(Exception):
    """A stop was requested while the task was being built; nothing has trained yet."""


def _never() -> bool:
    return False


# While load_task builds a task: whether the job was asked to stop (a plain callable, so that
# tasks know nothing of how signals are handled).
_stop_requested: Callable[[], bool] = _never


def check_stop(doing: str) -> None:
    """Raise :class:`Stopped` when the job was asked to stop; ``doing`` says where (for the log)."""
    if _stop_requested():
        raise Stopped(f"stop requested while {doing}")


class Task:
    """Base class with the optional parts filled in; subclass it (or duck-type it)."""

    def __init__(self, seed: int = 0, **params: object) -> None:
        if params:
            raise UserError(
                f"task {type(self).__name__} takes no parameters, "
                f"got task.params keys: {', '.join(params)}"
            )
        self.seed = seed

    def build_model(self) -> nn.Module:
        raise NotImplementedError("a Task must implement build_model()")

    def train_dataset(self) -> Dataset:
        raise NotImplementedError("a Task must implement train_dataset()")

    def loss(
        self, model: nn.Module, batch: dict[str, Any], labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
        raise NotImplementedError("a Task must implement loss()")

    def eval_dataset(self) -> Dataset | None:
        return None

    def eval_step(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> Mapping[str, tuple[torch.Tensor | np.ndarray | float, float]]:
        return {}

    def eval_metrics(self, totals: dict[str, tuple[np.ndarray | float, float]]) -> dict[str, float]:
        return {k: s / max(c, 1e-12) for k, (s, c) in totals.items() if isinstance(s, float)}

    @property
    def can_embed(self) -> bool:
        return type(self).embed is not Task.embed

    def embed(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError(
            f"task {type(self).__name__} does not embed; set mining.enabled=false"
        )

    def embed_dataset(self) -> Dataset:
        return self.train_dataset()

    def ground_truth(self) -> np.ndarray | None:
        return None

    def set_epoch(self, epoch: int) -> None:
        pass


def task_class(
    target: str, seed: int, params: dict[str, object]
) -> tuple[Callable[..., Task], dict[str, object]]:
    """Import ``task.target``'s class and check ``params`` against it, without building the task:
    (the class, the params as it takes them). Raises what :func:`load_task` raises for these."""
    module_name, _, cls_name = target.partition(":")
    module = _import(target, module_name)
    cls = getattr(module, cls_name, None)
    if cls is None or not callable(cls):
        names = [
            n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n), type)
        ]
        raise UserError(
            f"task.target={target!r}: {module_name} has no class {cls_name!r}; "
            f"classes there: {', '.join(names) or 'none'}"
        )
    missing = [
        m for m in ("build_model", "train_dataset", "loss") if not callable(getattr(cls, m, None))
    ]
    if missing:
        raise UserError(
            f"task.target={target!r} is not a task: it has no {', '.join(missing)} "
            "(see docs/tasks.md for the Task protocol)"
        )
    return cls, _check_params(target, cls, seed, params)


def check_can_shard(target: str, cls: Callable[..., Task]) -> None:
    """UserError when ``train.parallel=fsdp`` is asked of a task class that says it cannot be
    sharded (``shard_units = None``) or whose ``shard_units`` is not a method."""
    hook = getattr(cls, "shard_units", check_can_shard)
    if hook is None or not callable(hook):
        raise UserError(
            f"train.parallel=fsdp: task {target!r} cannot be sharded (its shard_units is "
            f"{hook!r}, not a method returning the submodules to shard); use train.parallel=ddp, "
            "or give the task a shard_units(model) method (docs/sharded.md)"
        )


def load_task(
    target: str, seed: int, params: dict[str, object], stop: Callable[[], bool] = _never
) -> Task:
    """Import and construct ``task.target``. A target that does not exist and parameters that do
    not fit the class are a UserError (exit 2); the task's own code raising while it is imported
    or constructed is a TaskError that keeps its traceback (exit 1), see
    ``clusterflow.job.failure``. ``stop``: whether the job was asked to stop; a task that calls
    :func:`check_stop` while it is built raises :class:`Stopped` once it says so."""
    cls, params = task_class(target, seed, params)
    cls_name = target.partition(":")[2]
    global _stop_requested
    _stop_requested = stop
    try:
        return cls(seed=seed, **params)
    except (UserError, Stopped):
        raise  # the task checked its parameters and said what is wrong, or the job is stopping
    except Exception as exc:
        raise TaskError(
            f"task.target {target!r} failed in {cls_name}.__init__: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        _stop_requested = _never


def _import(target: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UserError(
                f"task.target={target!r}: module {exc.name!r} not found; "
                "check the spelling and that it is importable here (pip install -e . or PYTHONPATH)"
            ) from None
        # The task module exists; something it imports does not.
        raise TaskError(
            f"task.target {target!r}: importing {module_name} failed because the module it "
            f"imports, {exc.name!r}, is not installed; install it where the job runs "
            f"(e.g. pip install {(exc.name or '?').split('.')[0]})"
        ) from exc
    except UserError:
        raise
    # A SyntaxError or anything raised at import: the task's code.
    except Exception as exc:
        raise TaskError(
            f"task.target {target!r}: importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from exc


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _check_params(
    target: str, cls: Callable[..., Task], seed: int, params: dict[str, object]
) -> dict[str, object]:
    """``params`` checked against the signature of ``cls``: unknown or missing names are refused,
    and so is a value of the wrong type for a parameter annotated int, float, bool or str, before
    the task runs (a whole number written as ``1e3`` is the int 1000). Finer checks are the
    task's."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return params
    try:
        sig.bind(seed=seed, **params)
    except TypeError as exc:
        names = [
            n
            for n, p in sig.parameters.items()
            if n != "seed" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
        raise UserError(
            f"task.params for {target}: {exc}; its parameters: {', '.join(names) or 'none'}"
        ) from None
    try:
        hints = typing.get_type_hints(
            cls.__init__ if isinstance(cls, type) else cls, include_extras=True
        )
    except Exception:  # noqa: BLE001 - annotations we cannot resolve are simply not checked
        hints = {}
    out = dict(params)
    for name, value in params.items():
        tp, ranges = _annotation(hints.get(name))
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if tp is int and isinstance(value, float) and value.is_integer():
            out[name] = int(value)
        elif (
            tp in _KINDS
            and not {
                int: number and isinstance(value, int),
                float: number,
                bool: isinstance(value, bool),
                str: isinstance(value, str),
            }[tp]
        ):
            raise UserError(
                f"task.params.{name} = {value!r} is invalid for "
                f"{getattr(cls, '__name__', target)}: expected {_KINDS[tp]}"
            )
        for r in ranges:
            if not r.holds(out[name]):
                raise UserError(
                    f"task.params.{name} = {value!r} is out of range for "
                    f"{getattr(cls, '__name__', target)}: must be {r}"
                )
    return out


def _annotation(hint: object) -> tuple[object, list[Range | OneOf]]:
    """(the type, the declared ranges and choices) of a parameter's annotation."""
    if typing.get_origin(hint) is typing.Annotated:
        found = [m for m in hint.__metadata__ if isinstance(m, (Range, OneOf))]
        return hint.__origin__, found
    return hint, []
