"""Whose seeds the global random streams carry (docs/own-loop.md, "Random streams").

A script that seeds a global generator itself (``torch.manual_seed(1337 + rank)``,
``np.random.seed(0)``, ``random.seed(0)``), before ``clusterflow.start()`` or between it and its
first ``run.setup``, keeps what it set: converted, it draws the numbers it drew before. Each
generator the script leaves alone gets ``run.seed`` at ``start`` (the same initial weights on
every rank) and a stream of its own on each rank at the first ``run.setup`` (dropout,
augmentations). A seed set after ``run.setup`` simply replaces the per-rank one. A task has no
seeds of its own: its job gives every generator its stream per rank (``script=False``).

How a seed the script set is told from none, for each generator:

- torch (its CUDA generators follow it): a seed a script writes is below 2**32 (the ones numpy's
  legacy seeding takes, which seed helpers give torch too); torch seeds itself at import with 64
  random bits, and ``start`` gives it ``run.seed + 2**32``. So ``torch.initial_seed() < 2**32``,
  at ``start`` or at ``run.setup``, is the script's seed.
- NumPy's global generator: before ``start``, one that ``np.random.seed`` (or ``set_state``)
  seeded holds no ``SeedSequence``, where numpy's own seeding from entropy at import does; after
  ``start``, a state other than the one ``start`` left when ``run.setup`` comes.
- Python's ``random``: its state when ``clusterflow`` was imported (``at_import.py`` keeps it)
  against its state at ``start``; after ``start``, as NumPy's.

A draw from NumPy's or Python's generator between ``start`` and ``run.setup`` counts as the
script's use of it, which it then keeps as it is.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from clusterflow import at_import
from clusterflow.checkpoint.rng import rank_seed, seed_everything

# Seeds below this are a script's (see above); start() marks its own torch seed above it.
SCRIPT_SEEDS = 2**32


def _torch_seeded() -> bool:
    return torch.initial_seed() < SCRIPT_SEEDS


def _numpy_seeded() -> bool:
    """Whether ``np.random.seed`` or ``np.random.set_state`` seeded NumPy's global generator: its
    own seeding at import keeps the ``SeedSequence`` it drew from entropy."""
    bits = getattr(np.random.mtrand._rand, "_bit_generator", None)
    return bits is not None and getattr(bits, "_seed_seq", True) is None


def _same_numpy(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


class GlobalSeeds:
    """Which global generators a script seeded itself, and the seeds of the others. ``script``:
    False for a task's job, whose generators are all the run's."""

    def __init__(self, run_seed: int, script: bool) -> None:
        self.run_seed, self.script = run_seed, script
        self.torch = self.numpy = self.python = False  # seeded by the script
        self._numpy_left: tuple[object, ...] | None = None  # the states start() left
        self._python_left: object = None

    def at_start(self) -> None:
        """``clusterflow.start()``: ``run.seed`` on every rank, for each generator the script did
        not seed before it."""
        if self.script:
            self.torch, self.numpy = _torch_seeded(), _numpy_seeded()
            self.python = random.getstate() != at_import.RANDOM
        if not self.torch:
            torch.manual_seed(self.run_seed + SCRIPT_SEEDS if self.script else self.run_seed)
        if not self.numpy:
            np.random.seed(self.run_seed % 2**32)
            self._numpy_left = np.random.get_state()
        if not self.python:
            random.seed(self.run_seed)
            self._python_left = random.getstate()

    def at_setup(self, rank: int) -> None:
        """The first ``run.setup``: a stream of this rank's own for each generator the script
        has not seeded (nor, NumPy's and Python's, drawn from) by now."""
        seed = rank_seed(self.run_seed, rank)
        if not self.script:
            seed_everything(seed)
            return
        if not self.torch and not _torch_seeded():
            torch.manual_seed(seed)
        left = self._numpy_left
        if not self.numpy and (left is None or _same_numpy(np.random.get_state(), left)):
            np.random.seed(seed % 2**32)
        if not self.python and self._python_left in (None, random.getstate()):
            random.seed(seed)
