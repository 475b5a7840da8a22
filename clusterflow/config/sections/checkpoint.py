"""When checkpoints are saved, where, and how many are kept (``checkpoint.*``).

Read by ``checkpoint/checkpointer.py`` (and ``memory.py``, ``staging.py``, ``restore.py``),
``storage/store.py`` through it, ``checkpoint/export.py`` and ``rundir/preflight.py``. Every
key applies to a task and to a script.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.config.sections.fields import RESOURCE, check, doc


@dataclass
class CheckpointConfig:
    """Committed checkpoints."""

    every_steps: int = doc(
        100,
        "Optimizer steps between checkpoints (one is also "
        "written at the end of each epoch and of the run).",
        kind=RESOURCE,
        why="saving reads the state and draws no random number; the weights do not change",
    )
    keep_last: int = doc(
        3,
        "Committed checkpoints kept (>= 2, so a corrupt newest one always has a predecessor).",
        kind=RESOURCE,
        why="retention",
    )
    keep_every_steps: int = doc(
        0,
        "Also keep every checkpoint whose step is a multiple of this (0: off), besides keep_last.",
        kind=RESOURCE,
        why="which checkpoints stay on disk",
    )
    keep_best: str = doc(
        "",
        "Also keep the checkpoint with the best value of a logged scalar, as METRIC:min or "
        "METRIC:max (e.g. eval/view_cos:max; empty: off). A checkpoint's value is the metric's "
        "latest value when it was saved; ties go to the earliest. RUN_DIR/best points to it.",
        kind=RESOURCE,
        why="which checkpoints stay on disk",
    )
    dir: str = doc(
        "",
        "Where checkpoints go; empty means RUN_DIR/checkpoints. A relative path "
        "is inside the run dir (it moves with it); an absolute path or any fsspec "
        "URL (s3://, gs://, memory://, ...) is used as given, when its fsspec "
        "package (s3fs, gcsfs, ...) is installed; submit checks that it is.",
        kind=RESOURCE,
        why="where checkpoints live; a resume reads the newest one there, so move them first",
    )
    fsync: bool = doc(
        True,
        "fsync files before publishing (turn off only on filesystems where it is a no-op).",
        kind=RESOURCE,
        why="durability",
    )
    async_: bool = doc(
        True,
        "Save in the background: the loop is blocked only while the state is "
        "snapshotted into host memory (one extra host copy of rank 0's state, kept "
        "between saves); a background thread writes, hashes, fsyncs and commits it. "
        "Stops and the end of the run still wait for the write (docs/preemption.md).",
        key="async",
        kind=RESOURCE,
        why=(
            "the background writer commits the same state the loop "
            "would have written; the loop computes the same steps"
        ),
    )

    memory_every_steps: int = doc(
        0,
        "Optimizer steps between snapshots in the nodes' memory (0: off): each rank's state is "
        "copied off the training path into checkpoint.memory_dir on its node and replicated to a "
        "rank on another node; a restart restores from the newest complete snapshot set newer "
        "than the shared checkpoint (docs/restarts.md).",
        kind=RESOURCE,
        why="a snapshot reads the state and draws no random number; a restore from one is "
        "bitwise the state saved",
    )
    memory_dir: str = doc(
        "/dev/shm",
        "Where each node keeps its snapshots and a peer's replicas (node-local memory); {node} "
        "in it becomes the node's host name. The run's folder there is made by the run, 0700, "
        "its files 0600; a folder others can change is never used (docs/restarts.md).",
        kind=RESOURCE,
        why="where the snapshots live",
    )

    def __post_init__(self) -> None:
        check(self.every_steps >= 1, "checkpoint.every_steps", self.every_steps, "must be >= 1")
        check(
            self.memory_every_steps >= 0,
            "checkpoint.memory_every_steps",
            self.memory_every_steps,
            "must be >= 0 (0: no snapshots in memory)",
        )
        check(
            self.memory_dir.startswith("/") and "://" not in self.memory_dir,
            "checkpoint.memory_dir",
            self.memory_dir,
            "must be an absolute path on each node (node-local memory such as /dev/shm), not a URL",
        )
        check(
            not set("{}") & set(self.memory_dir.replace("{node}", "")),
            "checkpoint.memory_dir",
            self.memory_dir,
            "may hold {node} (the node's host name) and no other {...}",
        )
        check(
            self.keep_last >= 2,
            "checkpoint.keep_last",
            self.keep_last,
            "must be >= 2 so a damaged newest checkpoint has a fallback",
        )
        check(
            self.keep_every_steps >= 0,
            "checkpoint.keep_every_steps",
            self.keep_every_steps,
            "must be >= 0 (0 keeps no extra checkpoints)",
        )
        if self.keep_best:
            metric, _, mode = self.keep_best.rpartition(":")
            check(
                bool(metric) and mode in ("min", "max"),
                "checkpoint.keep_best",
                self.keep_best,
                "must be METRIC:min or METRIC:max, e.g. eval/view_cos:max",
            )

    @property
    def best(self) -> tuple[str, str] | None:
        """(metric, "min" | "max") of keep_best, or None."""
        if not self.keep_best:
            return None
        metric, _, mode = self.keep_best.rpartition(":")
        return metric, mode
