"""The process group, DDP and the timeouts of a job's collectives (``dist.*``).

Read by ``distributed/comm.py`` through ``job/attempt.py`` (rendezvous, backend),
``train/parallel.py`` (DDP's buckets), ``train/session.py`` (the stop agreement),
``observe/observer.py`` (heartbeats, the stall watchdog), ``mining/adapter.py`` and
``checkpoint/checkpointer.py`` (their groups' timeouts). Every key applies to a task and to a
script.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.config.sections.fields import (
    NUMERICS,
    RESOURCE,
    RESULT,
    YEAR_S,
    check,
    choice,
    doc,
)


@dataclass
class DistConfig:
    """Process group settings."""

    backend: str = doc(
        "auto",
        "auto (nccl with CUDA, gloo without), nccl or gloo.",
        kind=NUMERICS,
        why=(
            "gloo and nccl reduce in another order (gloo trains on CPU: with train.amp=auto "
            "the precision changes too: refused)"
        ),
    )
    timeout_s: int = doc(
        600,
        "Process-group timeout: a rank that stops answering fails the job after this long.",
        kind=RESOURCE,
        why="how long a silent rank is waited for",
    )
    find_unused_parameters: bool = doc(
        False,
        "DDP find_unused_parameters (needed when some parameters get no gradient; costs a walk "
        "of the autograd graph per step).",
        kind=NUMERICS,
        why=(
            "DDP keeps its first bucket layout when it looks for unused parameters, and "
            "dist.fixed_buckets builds another one when it does not: the layout decides the order "
            "in which ranks' gradients are summed (with more than two ranks)"
        ),
    )
    bucket_cap_mb: int = doc(
        25,
        "DDP gradient bucket size in MB.",
        kind=NUMERICS,
        why=(
            "the bucket layout decides the order in which ranks' gradients are "
            "summed (with more than two ranks)"
        ),
    )
    fixed_buckets: bool = doc(
        True,
        "DDP's gradient buckets are built once, before the first step, in reverse order of "
        "the model's parameters (a backward of zeros, no data, no random draw), instead of DDP "
        "reducing the first step in one bucket and rebuilding after it: every step of every "
        "attempt then sums the ranks' gradients in the same order, so a resumed run equals an "
        "uninterrupted one bit for bit with 3 or more ranks. No cost per step. false: DDP's own "
        "rebuild (resume then differs in the last bits with 3+ ranks).",
        kind=NUMERICS,
        why=(
            "whether DDP rebuilds its buckets after the first step decides the order in which "
            "ranks' gradients are summed (with more than two ranks)"
        ),
    )
    sync_batchnorm: bool = doc(
        False,
        "Convert BatchNorm layers to SyncBatchNorm.",
        kind=RESULT,
        why="BatchNorm statistics over the global batch instead of each rank's",
    )
    heartbeat_s: float = doc(
        10.0,
        "Each rank writes its step, phase, step time, host and GPU memory/utilisation to "
        "RUN_DIR/heartbeats/ this often, from a background thread (status --ranks shows them); 0 "
        "turns heartbeats off. May change on resume.",
        kind=RESOURCE,
        why="how often each rank reports where it is; touches no weight",
    )
    stall_s: int | str = doc(
        "auto",
        "Stall watchdog: a rank whose loop has not moved for this many seconds prints every "
        "thread's stack into its log, names itself in status and ends the job (exit code 86), "
        "instead of holding it until dist.timeout_s. auto: half of dist.timeout_s, at most 300; "
        "0: no watchdog. Must be below dist.timeout_s and above the slowest step or checkpoint "
        "save; the mining wait follows mining.timeout_s instead. May change on resume.",
        kind=RESOURCE,
        why="when a rank that stopped moving ends the job; touches no weight",
    )

    def __post_init__(self) -> None:
        choice("dist.backend", self.backend, ("auto", "nccl", "gloo"))
        check(
            10 <= self.timeout_s <= YEAR_S,
            "dist.timeout_s",
            self.timeout_s,
            f"must be between 10 and {YEAR_S} seconds (a year)",
        )
        check(
            self.heartbeat_s == 0 or 0.1 <= self.heartbeat_s <= 3600,
            "dist.heartbeat_s",
            self.heartbeat_s,
            "must be 0 (off) or between 0.1 and 3600 seconds",
        )
        if isinstance(self.stall_s, str):
            check(
                self.stall_s == "auto",
                "dist.stall_s",
                self.stall_s,
                "must be auto, 0 (off) or a number of seconds",
            )
        elif self.stall_s != 0:
            check(
                1 <= self.stall_s < self.timeout_s,
                "dist.stall_s",
                self.stall_s,
                "must be 0 (off), or at least 1 s and below dist.timeout_s "
                f"({self.timeout_s} s), or the process-group timeout fires first and "
                "blames a waiting peer; raise dist.timeout_s or lower dist.stall_s",
            )
        check(
            1 <= self.bucket_cap_mb <= 1 << 20,
            "dist.bucket_cap_mb",
            self.bucket_cap_mb,
            "must be between 1 and 1048576 (1 TB)",
        )

    @property
    def stall_limit_s(self) -> float | None:
        """The watchdog's limit in seconds, None when it is off."""
        if self.stall_s == 0:
            return None
        return (
            float(min(300, self.timeout_s // 2)) if self.stall_s == "auto" else float(self.stall_s)
        )
