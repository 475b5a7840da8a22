"""What a job asks Slurm for, and what it does after a fault (``cluster.*``).

Read by ``slurm/sbatch.py`` (the sbatch parameters), ``launch/`` (``submit.py``, ``local.py``,
``gpus.py``), ``job/`` (``attempt.py``, ``restarts.py``, ``requeue.py``) and
``train/memory_estimate.py`` (the memory a process needs). Every key applies to a task and to a
script.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from clusterflow.config.sections.fields import NUMERICS, RESOURCE, WORLD_WHY, check, doc


@dataclass
class ClusterConfig:
    """Resources asked of Slurm (ignored by --local except tasks_per_node)."""

    nodes: int = doc(1, "Number of nodes.", kind=NUMERICS, why=WORLD_WHY)
    tasks_per_node: int = doc(
        1,
        "Processes per node. With gpus_per_node > 0 it "
        "must equal gpus_per_node (one process per GPU).",
        kind=NUMERICS,
        why=WORLD_WHY,
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
    end_check_s: float = doc(
        60.0,
        "Rank 0 of a Slurm job reads the job's end (scontrol show job's EndTime) this often, so "
        "that a time limit an admin changes is seen; when the end is closer than two saves (as "
        "the run measured them) plus end_margin_s, the ranks save and the job requeues itself, "
        "whether or not the --signal came; 0: only the signal (docs/preemption.md).",
        kind=RESOURCE,
        why="how often the job asks Slurm for its end; saving is exact at any step",
    )
    end_margin_s: float = doc(
        30.0,
        "Seconds kept before the job's end beyond two saves: the agreement to stop, an eval or "
        "a mining round that does not stop at once, the requeue itself.",
        kind=RESOURCE,
        why="how long before the end the job stops; saving is exact at any step",
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
        "How many times one step is restarted when it fails again without progress: after a "
        "failure a restart can cure (a rank killed by a signal, a device error, a hang, a full "
        "disk) the job starts a new srun step from the newest checkpoint inside its allocation "
        "(or requeues itself when too few healthy nodes remain); a failure after a newer step "
        "was committed is restarted however many came before, and the same step failing "
        "restarts_in_job + 1 times in a row, restarts in the job and requeues counted "
        "together, ends the run failed with 'no progress' and its batch's samples; 0: never "
        "restart inside the job (docs/restarts.md).",
        kind=RESOURCE,
        why="how often a step that keeps failing is tried again; a restart resumes exactly",
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
    warm_restarts: bool = doc(
        True,
        "Keep a warm standby for restarts inside the job: once the training step trains, one "
        "more srun step (--overlap) on the allocation's nodes whose processes have imported torch "
        "and the task and become the next step's ranks after a crash, and a crashed step ended "
        "at once; without one ready, a restart starts new processes (docs/restarts.md).",
        kind=RESOURCE,
        why="whether a restart inside the job reuses processes that imported ahead; a rank runs "
        "the same code either way",
    )
    exclude_stragglers: bool = doc(
        False,
        "When the next restart inside the allocation starts, leave out the nodes of ranks named "
        "stragglers (RUN_DIR/stragglers.jsonl, observe.straggler_ratio); false: they stay.",
        kind=RESOURCE,
        why="which nodes a restart runs on",
    )

    def __post_init__(self) -> None:
        check(
            self.nodes >= 1,
            "cluster.nodes",
            self.nodes,
            "must be >= 1 (a job needs at least one node)",
        )
        check(
            self.tasks_per_node >= 1, "cluster.tasks_per_node", self.tasks_per_node, "must be >= 1"
        )
        check(self.gpus_per_node >= 0, "cluster.gpus_per_node", self.gpus_per_node, "must be >= 0")
        self.gpus = _gpu_list(self.gpus)
        if isinstance(self.gpus, int):
            check(
                self.gpus_per_node in (0, self.gpus),
                "cluster.gpus",
                self.gpus,
                f"asks for {self.gpus} GPU(s) but cluster.gpus_per_node={self.gpus_per_node}; "
                "set one of them (cluster.gpus: N sets cluster.gpus_per_node)",
            )
            self.gpus_per_node = self.gpus
        if self.gpus_per_node > 0:
            check(
                self.tasks_per_node in (1, self.gpus_per_node),
                "cluster.tasks_per_node",
                self.tasks_per_node,
                f"with cluster.gpus_per_node={self.gpus_per_node} clusterflow runs "
                f"one process per GPU; set cluster.tasks_per_node={self.gpus_per_node} "
                "(or leave it at 1 and it is set for you)",
            )
            self.tasks_per_node = self.gpus_per_node
        check(self.cpus_per_task >= 1, "cluster.cpus_per_task", self.cpus_per_task, "must be >= 1")
        check(self.mem_gb >= 0, "cluster.mem_gb", self.mem_gb, "must be >= 0")
        check(self.time_min >= 1, "cluster.time_min", self.time_min, "must be >= 1 minute")
        check(
            0 <= self.signal_delay_s < self.time_min * 60,
            "cluster.signal_delay_s",
            self.signal_delay_s,
            f"must be between 0 and the time limit ({self.time_min * 60} s)",
        )
        check(self.end_check_s >= 0, "cluster.end_check_s", self.end_check_s, "must be >= 0")
        check(self.end_margin_s >= 0, "cluster.end_margin_s", self.end_margin_s, "must be >= 0")
        check(
            self.max_timeout_requeues >= 0,
            "cluster.max_timeout_requeues",
            self.max_timeout_requeues,
            "must be >= 0",
        )
        check(
            self.max_node_failures >= 0,
            "cluster.max_node_failures",
            self.max_node_failures,
            "must be >= 0",
        )
        check(
            self.restarts_in_job >= 0,
            "cluster.restarts_in_job",
            self.restarts_in_job,
            "must be >= 0 (0: a failure requeues or fails the job as before)",
        )
        check(
            self.spare_nodes >= 0,
            "cluster.spare_nodes",
            self.spare_nodes,
            "must be >= 0 (nodes allocated beyond cluster.nodes for restarts)",
        )
        for key, value in self.sbatch_extra.items():
            # Each becomes a line "#SBATCH --key=value" of the job script.
            check(
                bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", key)),
                "cluster.sbatch_extra",
                key,
                "keys are sbatch option names such as mail-type (letters, digits, - and _)",
            )
            check(
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
        check(
            value >= 1,
            "cluster.gpus",
            value,
            "a count of GPUs must be >= 1 (cluster.gpus_per_node=0 runs on CPU)",
        )
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*\[?\s*\d+(\s*,\s*\d+)*\s*\]?\s*", value):
        value = [int(v) for v in re.findall(r"\d+", value)]
    if isinstance(value, str):
        check(
            value == "auto",
            "cluster.gpus",
            value,
            "must be auto, a count of GPUs, or a list of GPU indices as nvidia-smi numbers them, "
            "e.g. [0, 2]",
        )
        return value
    check(
        len(set(value)) == len(value) and all(v >= 0 for v in value),
        "cluster.gpus",
        value,
        "must list distinct GPU indices (>= 0), e.g. [0, 2]",
    )
    return value
