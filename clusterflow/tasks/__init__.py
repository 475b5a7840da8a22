"""The Task protocol, and how a task named in config is found.

A task is named in config as ``task.target: "package.module:Class"`` and built as
``Class(seed=run.seed, **task.params)``. It implements:

- ``build_model() -> nn.Module``
- ``train_dataset() -> Dataset`` whose items are dicts holding at least ``"index"`` (the sample's
  position in the dataset; labels and mining are keyed by it)
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
- ``set_epoch(epoch)``: called before each epoch (augmentations that depend on the epoch); with
  ``data.persistent_workers`` also in each DataLoader worker, on its own copy of the task, when
  the first item of a new epoch reaches it: it must only set state the task reaches (its dataset)

See docs/tasks.md for a complete example.
"""

from __future__ import annotations

import importlib
from typing import Any

from clusterflow.errors import UserError


class Task:
    """Base class with the optional parts filled in; subclass it (or duck-type it)."""

    def __init__(self, seed: int = 0, **params: Any) -> None:
        if params:
            raise UserError(f"task {type(self).__name__} takes no parameters, got task.params keys: {', '.join(params)}")
        self.seed = seed

    def build_model(self) -> Any:
        raise NotImplementedError("a Task must implement build_model()")

    def train_dataset(self) -> Any:
        raise NotImplementedError("a Task must implement train_dataset()")

    def loss(self, model: Any, batch: dict[str, Any], labels: Any) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError("a Task must implement loss()")

    def eval_dataset(self) -> Any:
        return None

    def eval_step(self, model: Any, batch: dict[str, Any]) -> dict[str, tuple[Any, float]]:
        return {}

    def eval_metrics(self, totals: dict[str, tuple[Any, float]]) -> dict[str, float]:
        return {k: s / max(c, 1e-12) for k, (s, c) in totals.items() if isinstance(s, float)}

    @property
    def can_embed(self) -> bool:
        return type(self).embed is not Task.embed

    def embed(self, model: Any, batch: dict[str, Any]) -> Any:
        raise NotImplementedError(f"task {type(self).__name__} does not embed; set mining.enabled=false")

    def embed_dataset(self) -> Any:
        return self.train_dataset()

    def ground_truth(self) -> Any:
        return None

    def set_epoch(self, epoch: int) -> None:
        pass


def load_task(target: str, seed: int, params: dict[str, Any]) -> Task:
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UserError(f"task.target={target!r}: module {module_name!r} not found ({exc}); check the spelling and that it is importable (pip install -e . or PYTHONPATH)") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        names = [n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n), type)]
        raise UserError(f"task.target={target!r}: {module_name} has no class {cls_name!r}; classes there: {', '.join(names) or 'none'}")
    try:
        return cls(seed=seed, **params)
    except TypeError as exc:
        raise UserError(f"task.params for {target}: {exc}; see the task's docstring for its parameters") from None
