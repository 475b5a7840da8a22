"""The config sections: one dataclass per section, each field documented where it is declared.

Every field's ``doc`` text is the configuration reference (``docs/configuration.md`` is generated
from it by ``python -m clusterflow.config``), and its ``kind`` and ``why`` say what changing it
does to a run's result (``fingerprint.py`` builds its table from them); ``__post_init__`` checks
say what is wrong and how to fix it. ``job_config.py`` assembles the sections and reads YAML and
overrides; ``clusterflow.config`` re-exports these classes. No torch here: this runs on the login
node.
"""

from __future__ import annotations

import dataclasses
import math
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clusterflow.config.values import short
from clusterflow.errors import UserError

# What changing a key does to a run's result (``fingerprint.py`` says what each kind allows on a
# resume): part of the experiment; the same experiment computed another way; where and how fast.
RESULT, NUMERICS, RESOURCE = "result", "numerics", "resource"
KINDS = (RESULT, NUMERICS, RESOURCE)

# Why the world size (cluster.nodes, cluster.tasks_per_node) is a numerics key.
_WORLD = (
    "the global-batch sampler keeps the data order and the global batch; per-rank RNG streams are "
    "re-derived and the all-reduce sums in another order, so the result is not bitwise equal to an "
    "uninterrupted run (tasks whose loss depends on the per-rank batch, e.g. BatchNorm without "
    "dist.sync_batchnorm, train differently)"
)


def doc(
    default: object = dataclasses.MISSING,
    help: str = "",
    factory: Callable[[], object] | None = None,
    key: str = "",
    *,
    kind: str,
    why: str,
) -> Any:
    """A dataclass field with its documentation attached (read by the config reference). ``key``:
    the name in YAML and overrides when it cannot be a Python name (``checkpoint.async``).
    ``kind`` (one of :data:`KINDS`) and ``why``: what changing the key does to the run's result,
    and why; ``fingerprint.KEYS`` is built from them and a resume that changes the key shows
    ``why``."""
    if kind not in KINDS or not why:
        raise ValueError(f"config field kind={kind!r}, why={why!r}: give one of {KINDS} and a why")
    metadata = {"help": help, "kind": kind, "why": why, **({"key": key} if key else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def keys(section_cls: type) -> dict[str, str]:
    """Config key -> dataclass field name, in declaration order (they differ only where
    ``doc(key=...)`` says)."""
    return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(section_cls)}


_YEAR_S = 365 * 24 * 3600  # timeouts become a timedelta, and then int64 milliseconds in torch
_INT32 = 2**31 - 1


def _check(ok: bool, key: str, value: object, why: str) -> None:
    if not ok:
        raise UserError(f"{key} = {short(repr(value))}: {why}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(choices)}")


# numpy's legacy seeding takes seeds below 2**32; the derived seeds stay within int64.
SEED_LIMIT = 2**32

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|::")


def is_url(text: str) -> bool:
    """``scheme://...`` or an fsspec chain (``simplecache::s3://...``), as opposed to a path."""
    return bool(_URL.search(text))


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
        _check(
            bool(self.dir.strip()),
            "run.dir",
            self.dir,
            "must name a directory, e.g. run.dir=runs/exp1",
        )
        _check(
            not is_url(self.dir),
            "run.dir",
            self.dir,
            "is a URL, but the run dir must be a filesystem path shared by all nodes "
            "(logs, status and the config live there); keep run.dir on a shared filesystem "
            f"and put checkpoints on the object store with checkpoint.dir={self.dir}",
        )
        _check(
            0 <= self.seed < SEED_LIMIT,
            "run.seed",
            self.seed,
            f"must be between 0 and 2**32-1 = {SEED_LIMIT - 1}",
        )
        _check(
            1 <= self.lease_s <= _YEAR_S,
            "run.lease_s",
            self.lease_s,
            "must be between 1 second and a year",
        )


@dataclass
class ClusterConfig:
    """Resources asked of Slurm (ignored by --local except tasks_per_node)."""

    nodes: int = doc(1, "Number of nodes.", kind=NUMERICS, why=_WORLD)
    tasks_per_node: int = doc(
        1,
        "Processes per node. With gpus_per_node > 0 it "
        "must equal gpus_per_node (one process per GPU).",
        kind=NUMERICS,
        why=_WORLD,
    )
    gpus_per_node: int = doc(
        0,
        "GPUs per node; 0 runs on CPU with gloo.",
        kind=NUMERICS,
        why=(
            "CPU and GPU kernels compute the same math in another order "
            "(with train.amp=auto the precision changes too: refused)"
        ),
    )
    gpus: str | int | list[int] = doc(
        "auto",
        "submit --local only: which of this machine's GPUs to use, one per process. auto: "
        "the free ones (no other process, room for the run's estimated need) with the most "
        "free memory; a count N: N of those (sets cluster.gpus_per_node=N); or a list of "
        "nvidia-smi indices, e.g. [0, 2], each of which must be free. Slurm jobs get the GPUs "
        "Slurm allocates.",
        kind=RESOURCE,
        why="which of a workstation's GPUs run the job (submit --local)",
    )
    cpus_per_task: int = doc(
        1,
        "CPU cores per process.",
        kind=RESOURCE,
        why="cores asked of Slurm; torch's thread count is set from the node's cores",
    )
    mem_gb: float = doc(
        0.0,
        "Memory per node in GB; 0 leaves Slurm's default.",
        kind=RESOURCE,
        why="memory asked of Slurm",
    )
    partition: str = doc(
        "",
        "Slurm partition; empty uses the cluster default.",
        kind=RESOURCE,
        why="where Slurm runs the job (other hardware computes in another order)",
    )
    account: str = doc("", "Slurm account to charge.", kind=RESOURCE, why="who is charged")
    qos: str = doc("", "Slurm quality of service.", kind=RESOURCE, why="queue priority")
    constraint: str = doc(
        "",
        "Slurm node feature constraint, e.g. a100|h100.",
        kind=RESOURCE,
        why="which nodes (other hardware computes in another order)",
    )
    time_min: int = doc(
        60,
        "Time limit of one attempt, in minutes.",
        kind=RESOURCE,
        why="the time limit of one attempt",
    )
    exclusive: bool = doc(
        False, "Ask for whole nodes.", kind=RESOURCE, why="whole nodes or shared ones"
    )
    signal_delay_s: int = doc(
        120,
        "Seconds before the time limit at which Slurm sends SIGUSR2 (save and requeue).",
        kind=RESOURCE,
        why="when the time-limit signal comes; saving is exact at any step",
    )
    max_timeout_requeues: int = doc(
        5,
        "How many times a run may requeue itself after "
        "hitting the time limit. Preemptions are not counted.",
        kind=RESOURCE,
        why="how often a run requeues itself",
    )
    exclude_failed_nodes: bool = doc(
        True,
        "When a failure is the node's (a CUDA or NCCL device error on a rank, a rank the stall "
        "watchdog ends outside a collective), requeue the batch job with that node excluded, "
        "at most max_node_failures times; false: such a job fails like any other.",
        kind=RESOURCE,
        why="whether a node's failure requeues without it",
    )
    max_node_failures: int = doc(
        3,
        "How many times a run may requeue itself after a node's failure.",
        kind=RESOURCE,
        why="how often a node's failure requeues the run",
    )
    restarts_in_job: int = doc(
        2,
        "How many times a job restarts its training step inside its own allocation (a new srun "
        "step from the newest checkpoint) after a failure a restart can cure: a rank killed by a "
        "signal, a device error, a hang the stall watchdog ended. Only when none is left, or too "
        "few healthy nodes remain, is the job requeued as before; 0: never (docs/restarts.md).",
        kind=RESOURCE,
        why="how often a failure restarts the job inside its allocation; a restart resumes exactly",
    )
    spare_nodes: int = doc(
        0,
        "Nodes allocated beyond cluster.nodes and kept idle: a restart inside the job runs on "
        "cluster.nodes of the allocation's healthy nodes, leaving the failed node out.",
        kind=RESOURCE,
        why="idle nodes allocated for restarts; the world size stays",
    )
    setup: list[str] = doc(
        factory=list,
        help="Shell lines run before the job on each node (module load, conda activate).",
        kind=RESOURCE,
        why="shell lines before the job (keep the same software for bitwise resumes)",
    )
    sbatch_extra: dict[str, Any] = doc(
        factory=dict,
        help="Extra #SBATCH parameters, e.g. {mail-type: END}.",
        kind=RESOURCE,
        why="extra #SBATCH lines",
    )
    srun_args: list[str] = doc(
        factory=list,
        help="Extra arguments for srun, e.g. [--cpu-bind=cores].",
        kind=RESOURCE,
        why="extra srun arguments",
    )
    shrink: bool = doc(
        True,
        "When a restart inside the job leaves a node out and no spare node is left, continue on "
        "the healthy nodes (fewer ranks, each sample still once per epoch) instead of requeueing; "
        "the next requeue asks for cluster.nodes again; false: requeue as before.",
        kind=RESOURCE,
        why="whether a restart may continue on fewer nodes; a run that shrank is not bitwise "
        "equal to an uninterrupted one (as after any change of world size)",
    )
    exclude_stragglers: bool = doc(
        False,
        "When the next restart inside the allocation starts, leave out the nodes of ranks named "
        "stragglers (RUN_DIR/stragglers.jsonl, observe.straggler_ratio); false: they stay.",
        kind=RESOURCE,
        why="which nodes a restart runs on",
    )

    def __post_init__(self) -> None:
        _check(
            self.nodes >= 1,
            "cluster.nodes",
            self.nodes,
            "must be >= 1 (a job needs at least one node)",
        )
        _check(
            self.tasks_per_node >= 1, "cluster.tasks_per_node", self.tasks_per_node, "must be >= 1"
        )
        _check(self.gpus_per_node >= 0, "cluster.gpus_per_node", self.gpus_per_node, "must be >= 0")
        self.gpus = _gpu_list(self.gpus)
        if isinstance(self.gpus, int):
            _check(
                self.gpus_per_node in (0, self.gpus),
                "cluster.gpus",
                self.gpus,
                f"asks for {self.gpus} GPU(s) but cluster.gpus_per_node={self.gpus_per_node}; "
                "set one of them (cluster.gpus: N sets cluster.gpus_per_node)",
            )
            self.gpus_per_node = self.gpus
        if self.gpus_per_node > 0:
            _check(
                self.tasks_per_node in (1, self.gpus_per_node),
                "cluster.tasks_per_node",
                self.tasks_per_node,
                f"with cluster.gpus_per_node={self.gpus_per_node} clusterflow runs "
                f"one process per GPU; set cluster.tasks_per_node={self.gpus_per_node} "
                "(or leave it at 1 and it is set for you)",
            )
            self.tasks_per_node = self.gpus_per_node
        _check(self.cpus_per_task >= 1, "cluster.cpus_per_task", self.cpus_per_task, "must be >= 1")
        _check(self.mem_gb >= 0, "cluster.mem_gb", self.mem_gb, "must be >= 0")
        _check(self.time_min >= 1, "cluster.time_min", self.time_min, "must be >= 1 minute")
        _check(
            0 <= self.signal_delay_s < self.time_min * 60,
            "cluster.signal_delay_s",
            self.signal_delay_s,
            f"must be between 0 and the time limit ({self.time_min * 60} s)",
        )
        _check(
            self.max_timeout_requeues >= 0,
            "cluster.max_timeout_requeues",
            self.max_timeout_requeues,
            "must be >= 0",
        )
        _check(
            self.max_node_failures >= 0,
            "cluster.max_node_failures",
            self.max_node_failures,
            "must be >= 0",
        )
        _check(
            self.restarts_in_job >= 0,
            "cluster.restarts_in_job",
            self.restarts_in_job,
            "must be >= 0 (0: a failure requeues or fails the job as before)",
        )
        _check(
            self.spare_nodes >= 0,
            "cluster.spare_nodes",
            self.spare_nodes,
            "must be >= 0 (nodes allocated beyond cluster.nodes for restarts)",
        )
        for key, value in self.sbatch_extra.items():
            # Each becomes a line "#SBATCH --key=value" of the job script.
            _check(
                bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", key)),
                "cluster.sbatch_extra",
                key,
                "keys are sbatch option names such as mail-type (letters, digits, - and _)",
            )
            _check(
                isinstance(value, (str, int, float, bool))
                and not re.search(r"[\x00-\x1f\x7f]", str(value)),
                f"cluster.sbatch_extra.{key}",
                value,
                "must be one value on one line, such as END or 4",
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def _gpu_list(value: str | int | list[int]) -> str | int | list[int]:
    """cluster.gpus: auto, a count (2, or "2" on the command line), or a list of indices
    ([0, 2], or cluster.gpus=0,2 as one word on the command line)."""
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        _check(
            value >= 1,
            "cluster.gpus",
            value,
            "a count of GPUs must be >= 1 (cluster.gpus_per_node=0 runs on CPU)",
        )
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*\[?\s*\d+(\s*,\s*\d+)*\s*\]?\s*", value):
        value = [int(v) for v in re.findall(r"\d+", value)]
    if isinstance(value, str):
        _check(
            value == "auto",
            "cluster.gpus",
            value,
            "must be auto, a count of GPUs, or a list of GPU indices as nvidia-smi numbers them, "
            "e.g. [0, 2]",
        )
        return value
    _check(
        len(set(value)) == len(value) and all(v >= 0 for v in value),
        "cluster.gpus",
        value,
        "must list distinct GPU indices (>= 0), e.g. [0, 2]",
    )
    return value


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
        _choice("dist.backend", self.backend, ("auto", "nccl", "gloo"))
        _check(
            10 <= self.timeout_s <= _YEAR_S,
            "dist.timeout_s",
            self.timeout_s,
            f"must be between 10 and {_YEAR_S} seconds (a year)",
        )
        _check(
            self.heartbeat_s == 0 or 0.1 <= self.heartbeat_s <= 3600,
            "dist.heartbeat_s",
            self.heartbeat_s,
            "must be 0 (off) or between 0.1 and 3600 seconds",
        )
        if isinstance(self.stall_s, str):
            _check(
                self.stall_s == "auto",
                "dist.stall_s",
                self.stall_s,
                "must be auto, 0 (off) or a number of seconds",
            )
        elif self.stall_s != 0:
            _check(
                1 <= self.stall_s < self.timeout_s,
                "dist.stall_s",
                self.stall_s,
                "must be 0 (off), or at least 1 s and below dist.timeout_s "
                f"({self.timeout_s} s), or the process-group timeout fires first and "
                "blames a waiting peer; raise dist.timeout_s or lower dist.stall_s",
            )
        _check(
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


@dataclass
class ObserveConfig:
    """Watching the ranks while they train (docs/goodput.md)."""

    straggler_ratio: float = doc(
        1.2,
        "Name a rank a straggler (in its log, status --ranks, the goodput ledger and "
        "RUN_DIR/stragglers.jsonl) when its own part of a training step stays above this many "
        "times the other ranks' median for observe.straggler_window_s; 0: off. Read from the "
        "heartbeats by rank 0's heartbeat thread (needs dist.heartbeat_s > 0): no collective.",
        kind=RESOURCE,
        why="which ranks are named slow; not what they compute",
    )
    straggler_window_s: float = doc(
        60.0,
        "How long a rank must stay above observe.straggler_ratio before it is named; at least "
        "dist.heartbeat_s, so that more than one heartbeat decides.",
        kind=RESOURCE,
        why="which ranks are named slow; not what they compute",
    )
    on_event: str = doc(
        "",
        "A shell command run when the run fails, stalls, is requeued (or restarted inside its "
        "allocation) or completes, with CLUSTERFLOW_EVENT (failed|stalled|requeued|completed), "
        "CLUSTERFLOW_RUN_DIR, CLUSTERFLOW_ATTEMPT and CLUSTERFLOW_MESSAGE in its environment "
        "(a mail or a chat webhook is a script of yours); run once per event by rank 0, the "
        "rank that saw it or the batch step's driver, never waited for by training; its output "
        "in RUN_DIR/logs/events.log. Empty: off.",
        kind=RESOURCE,
        why="a command run on the run's events; not what the run computes",
    )

    def __post_init__(self) -> None:
        _check(
            "\0" not in self.on_event,
            "observe.on_event",
            self.on_event,
            "must be a shell command without NUL bytes, e.g. 'mail -s run me@example.org'",
        )
        _check(
            self.straggler_ratio == 0 or 1 < self.straggler_ratio <= 100,
            "observe.straggler_ratio",
            self.straggler_ratio,
            "must be 0 (off) or above 1 and at most 100, e.g. 1.2 (20% slower than the median)",
        )
        _check(
            0 <= self.straggler_window_s <= _YEAR_S,
            "observe.straggler_window_s",
            self.straggler_window_s,
            f"must be between 0 and {_YEAR_S} seconds, e.g. 60",
        )


@dataclass
class TrainConfig:
    """The optimisation loop."""

    epochs: int = doc(
        4,
        "Number of epochs.",
        kind=RESULT,
        why="the cosine schedule spans all epochs, so every step's learning rate depends on it",
    )
    batch_size: int = doc(
        128,
        "Global batch per optimizer step, over all ranks and accumulation steps.",
        kind=RESULT,
        why="the global batch",
    )
    grad_accum: int = doc(
        1,
        "Micro-steps accumulated per optimizer step.",
        kind=RESULT,
        why="the micro-batch, hence in-batch negatives and BatchNorm statistics",
    )
    lr: float = doc(
        1e-3, "Learning rate for one process (see lr_scaling).", kind=RESULT, why="optimisation"
    )
    lr_scaling: str = doc(
        "none",
        "How lr grows with world size: none, linear or sqrt.",
        kind=RESULT,
        why="optimisation",
    )
    warmup_steps: int = doc(0, "Linear warm-up steps.", kind=RESULT, why="optimisation")
    schedule: str = doc(
        "cosine",
        "Learning-rate schedule after warm-up: cosine or constant.",
        kind=RESULT,
        why="optimisation",
    )
    optimizer: str = doc("adamw", "adamw or sgd (momentum 0.9).", kind=RESULT, why="optimisation")
    weight_decay: float = doc(0.0, "Weight decay.", kind=RESULT, why="optimisation")
    amp: str = doc(
        "auto",
        "Mixed precision: auto (bf16 on GPU, none on CPU), none, bf16 or fp16.",
        kind=RESULT,
        why="the precision of every forward and backward pass",
    )
    tf32: bool = doc(
        True,
        "Allow TF32 matrix products on Ampere+ GPUs "
        "(off for bitwise comparisons across GPU types).",
        kind=RESULT,
        why="the precision of every matmul on Ampere+ GPUs, chosen for the experiment",
    )
    grad_clip: float = doc(
        0.0, "Clip the gradient norm to this value; 0 disables.", kind=RESULT, why="optimisation"
    )
    log_every_steps: int = doc(
        10,
        "Steps between metric logs (TensorBoard, stdout, status).",
        kind=RESOURCE,
        why="logging reduces metrics only; it touches no weight and no random stream",
    )
    eval_every_epochs: int = doc(
        1,
        "Epochs between evaluations; 0 disables.",
        kind=NUMERICS,
        why=(
            "each evaluation's DataLoader draws one number from the global torch "
            "random stream, so dropout after it draws other numbers"
        ),
    )
    progress_bar: bool = doc(
        True, "Show a tqdm progress bar on rank 0.", kind=RESOURCE, why="display only"
    )
    profile: str = doc(
        "",
        "Record a torch.profiler trace of global steps FIRST-LAST on the listed ranks, written as "
        "FIRST-LAST@RANK,RANK (e.g. 10-12@0,1; without @: rank 0), into RUN_DIR/profile/ "
        "(TensorBoard's profiler view and Perfetto open it; on GPUs a CUDA memory snapshot too). "
        "Empty: off.",
        kind=RESOURCE,
        why="which steps are traced; not what they compute",
    )
    on_nonfinite: str = doc(
        "fail",
        "A NaN or inf loss (or weights, checked before each checkpoint): fail stops the "
        "run naming the step, never saving the non-finite state (checked on log steps and "
        "before saves: no per-step host sync); skip_step skips that optimizer step (reads a "
        "flag every step: one host sync and one all-reduce per step). May change on resume.",
        kind=RESOURCE,
        why=(
            "what a non-finite loss does (stop, or skip the step); a run that never "
            "meets one trains identically either way"
        ),
    )
    max_consecutive_skips: int = doc(
        10,
        "skip_step: fail the run when more optimizer steps than this in a row are skipped.",
        kind=RESOURCE,
        why="when skipping non-finite steps gives up",
    )
    ema_decay: float = doc(
        0.0,
        "Keep an exponential moving average of the weights (on every rank; sharded like the "
        "model under fsdp): after each optimizer step ema = decay * ema + (1 - decay) * "
        "weights; 0 turns it off. Saved in every checkpoint, evaluated beside the weights "
        "(eval_ema/...), written as model_ema.pt at the end (docs/sharded.md).",
        kind=RESULT,
        why="the EMA weights (and the labels when mining embeds with them)",
    )
    parallel: str = doc(
        "ddp",
        "ddp: every rank holds the whole model, rank 0 writes checkpoints. fsdp: parameters, "
        "gradients and optimizer state are sharded over every rank (FSDP2 fully_shard; the "
        "task's shard_units hook says which submodules), every rank writes its shards of each "
        "checkpoint (torch.distributed.checkpoint) and a run may resume on another world size "
        "(docs/sharded.md).",
        kind=RESULT,
        why="how gradients are reduced and the checkpoint format (sharded or one file)",
    )
    allow_batch_size_change: bool = doc(
        False,
        "Let this launch resume a run with another train.batch_size (refused otherwise: it "
        "changes the result). The run continues the same sample order from the sample it "
        "reached, in batches of the new size; the learning-rate schedule counts samples, so it "
        "continues too (docs/data.md). Give both on the command line, e.g. "
        "train.batch_size=256 train.allow_batch_size_change=true.",
        kind=RESOURCE,
        why="whether a resume may change train.batch_size; by itself it changes nothing",
    )

    @property
    def profile_window(self) -> tuple[int, int, tuple[int, ...]] | None:
        """(first step, last step, ranks) of ``profile``, or None when off."""
        if not self.profile:
            return None
        steps, _, ranks = self.profile.partition("@")
        first, _, last = steps.partition("-")
        return int(first), int(last or first), tuple(int(r) for r in (ranks or "0").split(","))

    def __post_init__(self) -> None:
        _check(
            not self.profile or re.fullmatch(r"\d+(-\d+)?(@\d+(,\d+)*)?", self.profile) is not None,
            "train.profile",
            self.profile,
            "must be FIRST-LAST@RANKS, e.g. 10-12@0,1 (global steps, 1-based; ranks default to 0)",
        )
        window = self.profile_window
        _check(
            window is None or 1 <= window[0] <= window[1],
            "train.profile",
            self.profile,
            "the first step must be >= 1 and not after the last, e.g. 10-12",
        )
        _check(self.epochs >= 1, "train.epochs", self.epochs, "must be >= 1")
        _check(self.batch_size >= 1, "train.batch_size", self.batch_size, "must be >= 1")
        _check(self.grad_accum >= 1, "train.grad_accum", self.grad_accum, "must be >= 1")
        _check(
            self.lr > 0 and math.isfinite(self.lr), "train.lr", self.lr, "must be a positive number"
        )
        _choice("train.lr_scaling", self.lr_scaling, ("none", "linear", "sqrt"))
        _choice("train.schedule", self.schedule, ("cosine", "constant"))
        _choice("train.optimizer", self.optimizer, ("adamw", "sgd"))
        _choice("train.amp", self.amp, ("auto", "none", "bf16", "fp16"))
        _check(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0")
        _check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0")
        _check(
            self.log_every_steps >= 1, "train.log_every_steps", self.log_every_steps, "must be >= 1"
        )
        _check(
            self.eval_every_epochs >= 0,
            "train.eval_every_epochs",
            self.eval_every_epochs,
            "must be >= 0",
        )
        _choice("train.on_nonfinite", self.on_nonfinite, ("fail", "skip_step"))
        _choice("train.parallel", self.parallel, ("ddp", "fsdp"))
        _check(
            0.0 <= self.ema_decay < 1.0,
            "train.ema_decay",
            self.ema_decay,
            "must be in [0, 1): 0 turns the EMA off, e.g. 0.999 averages over about 1000 steps",
        )
        _check(
            not (self.parallel == "fsdp" and self.amp == "fp16"),
            "train.amp",
            self.amp,
            "fp16 loss scaling is not supported with train.parallel=fsdp; "
            "use train.amp=bf16 (FSDP's bf16 parameters with fp32 gradient reduction)",
        )
        _check(
            self.max_consecutive_skips >= 0,
            "train.max_consecutive_skips",
            self.max_consecutive_skips,
            "must be >= 0",
        )


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
        "in it becomes the node's host name.",
        kind=RESOURCE,
        why="where the snapshots live",
    )

    def __post_init__(self) -> None:
        _check(self.every_steps >= 1, "checkpoint.every_steps", self.every_steps, "must be >= 1")
        _check(
            self.memory_every_steps >= 0,
            "checkpoint.memory_every_steps",
            self.memory_every_steps,
            "must be >= 0 (0: no snapshots in memory)",
        )
        _check(
            self.memory_dir.startswith("/") and "://" not in self.memory_dir,
            "checkpoint.memory_dir",
            self.memory_dir,
            "must be an absolute path on each node (node-local memory such as /dev/shm), not a URL",
        )
        _check(
            not set("{}") & set(self.memory_dir.replace("{node}", "")),
            "checkpoint.memory_dir",
            self.memory_dir,
            "may hold {node} (the node's host name) and no other {...}",
        )
        _check(
            self.keep_last >= 2,
            "checkpoint.keep_last",
            self.keep_last,
            "must be >= 2 so a damaged newest checkpoint has a fallback",
        )
        _check(
            self.keep_every_steps >= 0,
            "checkpoint.keep_every_steps",
            self.keep_every_steps,
            "must be >= 0 (0 keeps no extra checkpoints)",
        )
        if self.keep_best:
            metric, _, mode = self.keep_best.rpartition(":")
            _check(
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


@dataclass
class MiningConfig:
    """The pseudo-label mining stage run between epochs."""

    enabled: bool = doc(
        True, "Run the mining stage (only for tasks that can embed).", kind=RESULT, why="mining"
    )
    every_epochs: int = doc(1, "Mine after every N-th epoch.", kind=RESULT, why="mining")
    start_epoch: int = doc(
        1,
        "First epoch (1-based, counted as finished epochs) after which mining runs.",
        kind=RESULT,
        why="mining",
    )
    k: int = doc(10, "Neighbours per sample in the k-NN graph.", kind=RESULT, why="mining")
    embed_with: str = doc(
        "model",
        "Which weights embed the data for mining: model (the trained weights) or ema (their "
        "moving average, train.ema_decay > 0: a teacher).",
        kind=RESULT,
        why="mining",
    )
    method: str = doc(
        "mutual_knn",
        "How labels come from the k-NN lists: mutual_knn (mutual edges >= threshold, "
        "connected components) or finch (first-neighbour clustering hierarchy, no "
        "threshold; the level of highest silhouette). docs/mining.md compares them.",
        kind=RESULT,
        why="mining",
    )
    threshold: float | str = doc(
        0.5,
        "mutual_knn: minimum cosine similarity of a kept mutual edge, or auto: each round, the "
        "threshold of highest modularity on that round's threshold curve.",
        kind=RESULT,
        why="mining",
    )
    index: str = doc(
        "flat",
        "FAISS index: flat (exact), ivf or hnsw.",
        kind=RESULT,
        why="approximate indexes find other neighbours",
    )
    engine: str = doc(
        "auto",
        "k-NN engine: auto, faiss or torch (exact chunked matmul + top-k).",
        kind=RESULT,
        why="FAISS and torch may break similarity ties differently",
    )
    search: str = doc(
        "rank0",
        "Where the k-NN search runs: rank0 (every embedding gathered to rank 0, which "
        "searches on all its GPUs or cores), all (every rank searches its own block with "
        "the exact torch engine; query blocks are broadcast and the partial top-k merged) or "
        "sharded (every rank indexes only its own shard with mining.engine and mining.index, "
        "query blocks travel a ring of ranks, and the mutual edges, components and curves are "
        "computed across ranks: no rank holds every embedding or every k-NN list).",
        kind=RESULT,
        why="decides the engine",
    )
    nlist: int = doc(1024, "ivf: number of inverted lists.", kind=RESULT, why="approximate search")
    nprobe: int = doc(16, "ivf: lists visited per query.", kind=RESULT, why="approximate search")
    hnsw_m: int = doc(32, "hnsw: graph degree M.", kind=RESULT, why="approximate search")
    ef_search: int = doc(128, "hnsw: efSearch.", kind=RESULT, why="approximate search")
    query_batch: int = doc(
        65536,
        "Queries per search batch (bounds rank 0's memory).",
        kind=NUMERICS,
        why="FAISS picks its distance kernel by query block size",
    )
    embed_batch: int = doc(
        512,
        "Samples per embedding batch on each rank.",
        kind=NUMERICS,
        why="batched kernels sum in an order that depends on the batch size",
    )
    singletons: str = doc(
        "cluster",
        "cluster: a sample without edges is its own cluster; "
        "ignore: it gets label -1, which losses skip.",
        kind=RESULT,
        why="mining",
    )
    max_cluster_size: int = doc(
        0,
        "Split components larger than this by raising the threshold inside them; 0 disables.",
        kind=RESULT,
        why="mining",
    )
    timeout_s: int = doc(
        3600,
        "The longest the k-NN search may take (rank 0's gather, index and search). With the "
        "watchdog on (dist.stall_s), a search that takes longer ends the job and is named as the "
        "cause; the other ranks wait for it dist.stall_s plus the watchdog's grace for a "
        "waiting rank (max(10 s, dist.stall_s / 4)) longer, so their timeout never comes first.",
        kind=RESOURCE,
        why="how long ranks wait for rank 0's search",
    )
    resume: bool = doc(
        True,
        "Keep each rank's embeddings and the finished k-NN query "
        "blocks of a round in RUN_DIR/mining/ until its labels are "
        "committed, so a round cut short resumes where it stopped.",
        kind=RESOURCE,
        why=(
            "a round read back from its files gives the labels of one computed anew, and mining "
            "leaves the random streams as it found them"
        ),
    )

    def __post_init__(self) -> None:
        _check(self.every_epochs >= 1, "mining.every_epochs", self.every_epochs, "must be >= 1")
        _check(self.start_epoch >= 1, "mining.start_epoch", self.start_epoch, "must be >= 1")
        _check(self.k >= 1, "mining.k", self.k, "must be >= 1")
        _check(
            self.k <= _INT32,
            "mining.k",
            self.k,
            f"must be at most {_INT32} (FAISS takes it as a C int)",
        )
        if isinstance(self.threshold, str):
            _check(
                self.threshold == "auto",
                "mining.threshold",
                self.threshold,
                "must be a number between -1 and 1, or auto",
            )
        else:
            _check(
                -1.0 <= self.threshold <= 1.0,
                "mining.threshold",
                self.threshold,
                "is a cosine similarity: between -1 and 1, or auto",
            )
        _choice("mining.method", self.method, ("mutual_knn", "finch"))
        _choice("mining.embed_with", self.embed_with, ("model", "ema"))
        _choice("mining.index", self.index, ("flat", "ivf", "hnsw"))
        _choice("mining.engine", self.engine, ("auto", "faiss", "torch"))
        _choice("mining.singletons", self.singletons, ("cluster", "ignore"))
        _choice("mining.search", self.search, ("rank0", "all", "sharded"))
        _check(
            self.search != "sharded" or self.method != "finch",
            "mining.method",
            self.method,
            "needs every embedding on rank 0 (cluster means and a search at every level), "
            "which mining.search=sharded never gathers; set mining.search=rank0",
        )
        if self.search == "all":
            _check(
                self.engine != "faiss",
                "mining.engine",
                self.engine,
                "cannot run with mining.search=all, which uses the "
                "exact torch engine; set mining.engine=auto or torch",
            )
            _check(
                self.index == "flat",
                "mining.index",
                self.index,
                "is a FAISS index; mining.search=all is exact (flat) "
                "search: set mining.index=flat or mining.search=rank0",
            )
            _check(
                self.method != "finch",
                "mining.method",
                self.method,
                "needs every embedding on rank 0 (cluster means at every level), "
                "which mining.search=all never gathers; set mining.search=rank0",
            )
        _check(
            self.method != "finch" or not self.max_cluster_size,
            "mining.max_cluster_size",
            self.max_cluster_size,
            "splits components by raising a threshold, which "
            "mining.method=finch does not have; set it to 0",
        )
        for key in ("nlist", "nprobe", "hnsw_m", "ef_search", "query_batch", "embed_batch"):
            # FAISS takes these as C ints
            _check(
                1 <= getattr(self, key) <= _INT32,
                f"mining.{key}",
                getattr(self, key),
                f"must be between 1 and {_INT32}",
            )
        _check(
            self.max_cluster_size >= 0,
            "mining.max_cluster_size",
            self.max_cluster_size,
            "must be >= 0",
        )
        _check(
            10 <= self.timeout_s <= _YEAR_S,
            "mining.timeout_s",
            self.timeout_s,
            f"must be between 10 and {_YEAR_S} seconds (a year)",
        )


@dataclass
class TaskConfig:
    """What is trained."""

    target: str = doc(
        "clusterflow.tasks.pseudo_id:PseudoIDTask",
        "The task class, as package.module:Class.",
        kind=RESULT,
        why="the task",
    )
    params: dict[str, Any] = doc(
        factory=dict,
        help="Keyword arguments of the task (validated by the task).",
        kind=RESULT,
        why="the task",
    )
    init_from: str = doc(
        "",
        "Start from these weights (matched by name and shape): a model.pt or safetensors file, "
        "a run dir (its model.pt, else its newest checkpoint that verifies) or one "
        "checkpoints/step-N folder (verified like a resume).",
        kind=RESULT,
        why="the initial weights",
    )

    def __post_init__(self) -> None:
        mod, sep, cls = self.target.partition(":")
        named = bool(
            sep
            and mod
            and cls
            and cls.isidentifier()
            and all(p.isidentifier() for p in mod.split("."))
        )
        _check(
            named,
            "task.target",
            self.target,
            "must look like package.module:ClassName, "
            "e.g. clusterflow.tasks.pseudo_id:PseudoIDTask",
        )


@dataclass
class ScriptConfig:
    """A training script of the user's own that calls the library API (``clusterflow.start()``,
    docs/own-loop.md) instead of a task: what ``submit --script`` runs."""

    path: str = doc(
        "",
        "The script that trains (python PATH), as given to submit --script, run --script or "
        "python/torchrun by hand; empty for a task.target run.",
        kind=RESULT,
        why="the program that trains",
    )
    args: list[str] = doc(
        factory=list,
        help="The script's own command-line arguments, passed to it untouched (the words after "
        "-- on the submit command line).",
        kind=RESULT,
        why="a script's arguments choose its model, data and optimisation",
    )

    def __post_init__(self) -> None:
        _check(
            not self.path or self.path.endswith(".py"),
            "script.path",
            self.path,
            "must be a Python file (train.py); a module or a task is task.target's",
        )
        _check(
            not self.args or bool(self.path),
            "script.args",
            self.args,
            "are the arguments of a script: give its path too (submit --script train.py -- ARGS)",
        )


@dataclass
class DataConfig:
    """Data loading."""

    num_workers: int = doc(
        0,
        "DataLoader worker processes per rank, for training and for the mining embed.",
        kind=RESOURCE,
        why=(
            "items depend only on (seed, epoch, index), as the Task protocol asks; a task "
            "that draws from the global random stream in __getitem__ breaks this"
        ),
    )
    pin_memory: bool = doc(
        True,
        "Pin host memory when training on GPU (faster, non-blocking copies to the device).",
        kind=RESOURCE,
        why="transfer speed",
    )
    persistent_workers: bool = doc(
        False,
        "Keep the training DataLoader's workers from one epoch to the next (with "
        "num_workers > 0) instead of starting new ones each epoch. Each index travels with its "
        "epoch, so augmentations stay exactly those of fresh workers.",
        kind=RESOURCE,
        why="each index travels with its epoch, so persistent workers fetch the same items",
    )
    prefetch_factor: int = doc(
        2,
        "Batches each worker prepares ahead (with num_workers > 0).",
        kind=RESOURCE,
        why="how far ahead workers fetch; not what they fetch",
    )
    allow_change: bool = doc(
        False,
        "Let this launch resume a run whose data changed since its checkpoint (another number "
        "of samples, or another digest: a shard folder packed again, an image folder with other "
        "files); refused otherwise. Taken only at an epoch boundary: the run trains its next "
        "epoch on the new data, without the pseudo-labels mined on the old (docs/data.md).",
        kind=RESOURCE,
        why="whether a resume may take other data; by itself it changes nothing",
    )

    def __post_init__(self) -> None:
        _check(
            0 <= self.num_workers <= 256,
            "data.num_workers",
            self.num_workers,
            "must be between 0 and 256 (processes per rank)",
        )
        _check(
            1 <= self.prefetch_factor <= 1024,
            "data.prefetch_factor",
            self.prefetch_factor,
            "must be between 1 and 1024",
        )


MLFLOW_KEYS = {
    "uri": "tracking URI: a directory (file store), sqlite:///PATH, or http(s)://HOST:PORT",
    "experiment": "experiment name (created when missing); empty: run.name",
}
WANDB_KEYS = {
    "project": "W&B project",
    "mode": "online (default) or offline (files under RUN_DIR/wandb/; wandb sync uploads them)",
    "entity": "W&B entity (user or team); empty: the account's default",
}


@dataclass
class TrackersConfig:
    """Experiment trackers that receive the same scalars as TensorBoard (docs/trackers.md)."""

    mlflow: dict[str, Any] = doc(
        factory=dict,
        help="MLflow, on when uri is set. "
        + "; ".join(f"trackers.mlflow.{k}: {v}" for k, v in MLFLOW_KEYS.items())
        + ". Needs pip install 'clusterflow[mlflow]'.",
        kind=RESOURCE,
        why="where the scalars are also sent; not what they are",
    )
    wandb: dict[str, Any] = doc(
        factory=dict,
        help="Weights & Biases, on when project is set. "
        + "; ".join(f"trackers.wandb.{k}: {v}" for k, v in WANDB_KEYS.items())
        + ". Needs pip install 'clusterflow[wandb]'.",
        kind=RESOURCE,
        why="where the scalars are also sent; not what they are",
    )

    def __post_init__(self) -> None:
        for name, known in (("mlflow", MLFLOW_KEYS), ("wandb", WANDB_KEYS)):
            for key, value in getattr(self, name).items():
                _check(
                    key in known,
                    f"trackers.{name}.{key}",
                    value,
                    f"unknown key; keys of trackers.{name}: {', '.join(known)}",
                )
                _check(
                    isinstance(value, str),
                    f"trackers.{name}.{key}",
                    value,
                    "must be text, e.g. " + ("sqlite:///mlflow.db" if key == "uri" else "demo"),
                )
        mode = self.wandb.get("mode", "online")
        _choice("trackers.wandb.mode", mode, ("online", "offline"))
        if self.wandb and not self.wandb.get("project"):
            _check(False, "trackers.wandb.project", "", "must be set to use W&B")
        if self.mlflow and not self.mlflow.get("uri"):
            _check(False, "trackers.mlflow.uri", "", "must be set to use MLflow")
        if self.mlflow:
            _check_mlflow_uri(self.mlflow["uri"])


# The tracking-URI schemes MLflow's client opens (databases by their SQLAlchemy dialect).
_MLFLOW_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql")


def _check_mlflow_uri(uri: str) -> None:
    """A tracking URI MLflow can open; anything else would track nothing, silently."""
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.split("+")[0]  # postgresql+psycopg2://...
    fix = "e.g. a directory, sqlite:///PATH/mlflow.db or http://HOST:5000"
    if len(parts.scheme) == 1:  # a Windows drive letter: a directory
        return
    _check(
        scheme in _MLFLOW_SCHEMES or scheme == "databricks",
        "trackers.mlflow.uri",
        uri,
        f"scheme {parts.scheme!r} is not one MLflow tracks to "
        f"({', '.join(s for s in _MLFLOW_SCHEMES if s)}, databricks); {fix}",
    )
    if scheme in ("http", "https"):
        _check(bool(parts.hostname), "trackers.mlflow.uri", uri, f"names no host; {fix}")
    if scheme == "sqlite":
        _check(
            uri.startswith("sqlite:///") and len(uri) > len("sqlite:///"),
            "trackers.mlflow.uri",
            uri,
            f"a SQLite URI is sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH; {fix}",
        )


# Section name -> its dataclass, in the order of the config reference.
SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "cluster": ClusterConfig,
    "dist": DistConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "mining": MiningConfig,
    "task": TaskConfig,
    "data": DataConfig,
    "trackers": TrackersConfig,
    "observe": ObserveConfig,
    "script": ScriptConfig,
}
