"""Where a run lives and how it is seeded (``run.*``).

Read by ``rundir/`` (the run dir's paths, ``preflight.py``, ``saved_config.py``), ``launch/``
(``submit.py``, ``local.py``, ``sweep.py``), ``job/`` (``attempt.py``, ``script.py``) and
``checkpoint/rng.py`` through the run (per-rank seeds). Every key applies to a task and to a script.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.config.sections.fields import (
    RESOURCE,
    RESULT,
    SEED_LIMIT,
    YEAR_S,
    check,
    doc,
    is_url,
)


@dataclass
class RunConfig:
    """Where the run lives and how it is seeded."""

    dir: str = doc(
        "runs/demo",
        "Run directory: a filesystem path that every node sees (a shared filesystem "
        "on a cluster), not a URL (file://PATH is read as PATH). Holds config.yaml, "
        "logs/, tb/, status and, unless checkpoint.dir says otherwise, checkpoints/.",
        kind=RESOURCE,
        why="where the run lives; a run dir may be moved",
    )
    name: str = doc(
        "clusterflow",
        "Job name shown by Slurm and in logs.",
        kind=RESOURCE,
        why="the Slurm job name",
    )
    seed: int = doc(
        0,
        "Master seed, 0 <= seed < 2**32. Per-rank seeds, data "
        "order and the synthetic demo data derive from it.",
        kind=RESULT,
        why="initial weights, data order and per-rank streams derive from it",
    )
    lease_s: int = doc(
        30,
        "One job per run dir: the job holding it renews its lease (RUN_DIR/lease/) this often; a "
        "lease not renewed for 4x as long is taken over by the next job. May change on resume.",
        kind=RESOURCE,
        why="how often the job holding the run dir renews its lease",
    )
    snapshot_code: bool = doc(
        True,
        "Freeze the task's code at submission: submit copies the task's package (when it lives "
        "outside site-packages) with its git commit and diff into RUN_DIR/code/, and every "
        "attempt imports it from there; a resubmission with changed code adds a copy and says "
        "so. false runs the code in place.",
        kind=RESOURCE,
        why="where the code is imported from, not which code (submit freezes it each time)",
    )

    def __post_init__(self) -> None:
        self.dir = self.dir.removeprefix("file://")  # fsspec's spelling of a local path
        check(
            bool(self.dir.strip()),
            "run.dir",
            self.dir,
            "must name a directory, e.g. run.dir=runs/exp1",
        )
        check(
            not is_url(self.dir),
            "run.dir",
            self.dir,
            "is a URL, but the run dir must be a filesystem path shared by all nodes "
            "(logs, status and the config live there); keep run.dir on a shared filesystem "
            f"and put checkpoints on the object store with checkpoint.dir={self.dir}",
        )
        check(
            0 <= self.seed < SEED_LIMIT,
            "run.seed",
            self.seed,
            f"must be between 0 and 2**32-1 = {SEED_LIMIT - 1}",
        )
        check(
            1 <= self.lease_s <= YEAR_S,
            "run.lease_s",
            self.lease_s,
            "must be between 1 second and a year",
        )
