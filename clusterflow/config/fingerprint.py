"""Which config keys change a run's result, and which may change when a run is resumed.

Every key of every config section has one kind:

- ``result``: part of the experiment (model, data, optimisation, seed, mining). A resumed run must
  keep it; :func:`result_fingerprint` hashes exactly these (plus the derived values below).
- ``numerics``: the same experiment computed another way: a resume may change it, but from then on
  the run is not bitwise equal to an uninterrupted one (summation order, random streams).
- ``resource``: where and how fast the job runs (Slurm resources, workers, intervals, timeouts,
  names). A resume may change it and stays bitwise exact, on the same hardware and software.

Some resource keys change the result through another key; these are derived values, hashed
with the result keys: the world size when ``train.lr_scaling`` scales the learning rate with it,
and the precision ``train.amp=auto`` resolves to (bf16 on a GPU, none on CPU; ``dist.backend=gloo``
trains on CPU). Everything here works on plain config dicts (``Config.to_dict()``), so it does not
depend on how the config classes (``job_config.py``, ``sections.py``) are organised. A key this
table does not know counts as ``result``: an unclassified key can never be changed silently (a test
requires every key to be classified).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

RESULT, NUMERICS, RESOURCE = "result", "numerics", "resource"

_WORLD = (
    "the global-batch sampler keeps the data order and the global batch; per-rank RNG streams are "
    "re-derived and the all-reduce sums in another order, so the result is not bitwise equal to an "
    "uninterrupted run (tasks whose loss depends on the per-rank batch, e.g. BatchNorm without "
    "dist.sync_batchnorm, train differently)"
)

# key -> (kind, why). The reasons are shown to users when a resume changes the key.
KEYS: dict[str, tuple[str, str]] = {
    "run.dir": (RESOURCE, "where the run lives; a run dir may be moved"),
    "run.name": (RESOURCE, "the Slurm job name"),
    "run.seed": (RESULT, "initial weights, data order and per-rank streams derive from it"),
    "run.lease_s": (RESOURCE, "how often the job holding the run dir renews its lease"),
    "run.snapshot_code": (
        RESOURCE,
        "where the code is imported from, not which code (submit freezes it each time)",
    ),
    "cluster.nodes": (NUMERICS, _WORLD),
    "cluster.tasks_per_node": (NUMERICS, _WORLD),
    "cluster.gpus_per_node": (
        NUMERICS,
        "CPU and GPU kernels compute the same math in another order "
        "(with train.amp=auto the precision changes too: refused)",
    ),
    "cluster.gpus": (RESOURCE, "which of a workstation's GPUs run the job (submit --local)"),
    "cluster.cpus_per_task": (
        RESOURCE,
        "cores asked of Slurm; torch's thread count is set from the node's cores",
    ),
    "cluster.mem_gb": (RESOURCE, "memory asked of Slurm"),
    "cluster.partition": (
        RESOURCE,
        "where Slurm runs the job (other hardware computes in another order)",
    ),
    "cluster.account": (RESOURCE, "who is charged"),
    "cluster.qos": (RESOURCE, "queue priority"),
    "cluster.constraint": (RESOURCE, "which nodes (other hardware computes in another order)"),
    "cluster.time_min": (RESOURCE, "the time limit of one attempt"),
    "cluster.exclusive": (RESOURCE, "whole nodes or shared ones"),
    "cluster.signal_delay_s": (
        RESOURCE,
        "when the time-limit signal comes; saving is exact at any step",
    ),
    "cluster.max_timeout_requeues": (RESOURCE, "how often a run requeues itself"),
    "cluster.exclude_failed_nodes": (RESOURCE, "whether a node's failure requeues without it"),
    "cluster.max_node_failures": (RESOURCE, "how often a node's failure requeues the run"),
    "cluster.restarts_in_job": (
        RESOURCE,
        "how often a failure restarts the job inside its allocation; a restart resumes exactly",
    ),
    "cluster.spare_nodes": (RESOURCE, "idle nodes allocated for restarts; the world size stays"),
    "cluster.setup": (
        RESOURCE,
        "shell lines before the job (keep the same software for bitwise resumes)",
    ),
    "cluster.sbatch_extra": (RESOURCE, "extra #SBATCH lines"),
    "cluster.srun_args": (RESOURCE, "extra srun arguments"),
    "dist.backend": (
        NUMERICS,
        "gloo and nccl reduce in another order (gloo trains on CPU: with train.amp=auto "
        "the precision changes too: refused)",
    ),
    "dist.timeout_s": (RESOURCE, "how long a silent rank is waited for"),
    "dist.heartbeat_s": (RESOURCE, "how often each rank reports where it is; touches no weight"),
    "dist.stall_s": (RESOURCE, "when a rank that stopped moving ends the job; touches no weight"),
    "dist.find_unused_parameters": (
        RESOURCE,
        "both values give the same gradients whenever both run (with dist.fixed_buckets, the "
        "default, both keep DDP's first bucket layout); false only refuses models with unused "
        "parameters",
    ),
    "dist.fixed_buckets": (
        NUMERICS,
        "whether DDP rebuilds its buckets after the first step decides the order in which ranks' "
        "gradients are summed (with more than two ranks)",
    ),
    "dist.bucket_cap_mb": (
        NUMERICS,
        "the bucket layout decides the order in which ranks' gradients are "
        "summed (with more than two ranks)",
    ),
    "dist.sync_batchnorm": (
        RESULT,
        "BatchNorm statistics over the global batch instead of each rank's",
    ),
    "train.epochs": (
        RESULT,
        "the cosine schedule spans all epochs, so every step's learning rate depends on it",
    ),
    "train.batch_size": (RESULT, "the global batch"),
    "train.grad_accum": (
        RESULT,
        "the micro-batch, hence in-batch negatives and BatchNorm statistics",
    ),
    "train.lr": (RESULT, "optimisation"),
    "train.lr_scaling": (RESULT, "optimisation"),
    "train.warmup_steps": (RESULT, "optimisation"),
    "train.schedule": (RESULT, "optimisation"),
    "train.optimizer": (RESULT, "optimisation"),
    "train.weight_decay": (RESULT, "optimisation"),
    "train.amp": (RESULT, "the precision of every forward and backward pass"),
    "train.tf32": (
        RESULT,
        "the precision of every matmul on Ampere+ GPUs, chosen for the experiment",
    ),
    "train.grad_clip": (RESULT, "optimisation"),
    "train.ema_decay": (RESULT, "the EMA weights (and the labels when mining embeds with them)"),
    "train.parallel": (
        RESULT,
        "how gradients are reduced and the checkpoint format (sharded or one file)",
    ),
    "train.allow_batch_size_change": (
        RESOURCE,
        "whether a resume may change train.batch_size; by itself it changes nothing",
    ),
    "train.log_every_steps": (
        RESOURCE,
        "logging reduces metrics only; it touches no weight and no random stream",
    ),
    "train.eval_every_epochs": (
        NUMERICS,
        "each evaluation's DataLoader draws one number from the global torch "
        "random stream, so dropout after it draws other numbers",
    ),
    "train.progress_bar": (RESOURCE, "display only"),
    "train.on_nonfinite": (
        RESOURCE,
        "what a non-finite loss does (stop, or skip the step); a run that never "
        "meets one trains identically either way",
    ),
    "train.max_consecutive_skips": (RESOURCE, "when skipping non-finite steps gives up"),
    "checkpoint.every_steps": (
        RESOURCE,
        "saving reads the state and draws no random number; the weights do not change",
    ),
    "checkpoint.keep_last": (RESOURCE, "retention"),
    "checkpoint.dir": (
        RESOURCE,
        "where checkpoints live; a resume reads the newest one there, so move them first",
    ),
    "checkpoint.fsync": (RESOURCE, "durability"),
    "checkpoint.async": (
        RESOURCE,
        "the background writer commits the same state the loop "
        "would have written; the loop computes the same steps",
    ),
    "mining.enabled": (RESULT, "mining"),
    "mining.embed_with": (RESULT, "mining"),
    "mining.every_epochs": (RESULT, "mining"),
    "mining.start_epoch": (RESULT, "mining"),
    "mining.k": (RESULT, "mining"),
    "mining.threshold": (RESULT, "mining"),
    "mining.method": (RESULT, "mining"),
    "mining.index": (RESULT, "approximate indexes find other neighbours"),
    "mining.engine": (RESULT, "FAISS and torch may break similarity ties differently"),
    "mining.search": (RESULT, "decides the engine"),
    "mining.nlist": (RESULT, "approximate search"),
    "mining.nprobe": (RESULT, "approximate search"),
    "mining.hnsw_m": (RESULT, "approximate search"),
    "mining.ef_search": (RESULT, "approximate search"),
    "mining.query_batch": (NUMERICS, "FAISS picks its distance kernel by query block size"),
    "mining.embed_batch": (
        NUMERICS,
        "batched kernels sum in an order that depends on the batch size",
    ),
    "mining.singletons": (RESULT, "mining"),
    "mining.max_cluster_size": (RESULT, "mining"),
    "mining.timeout_s": (RESOURCE, "how long ranks wait for rank 0's search"),
    "mining.resume": (
        RESOURCE,
        "a round read back from its files gives the labels of one computed anew, and mining "
        "leaves the random streams as it found them",
    ),
    "task.target": (RESULT, "the task"),
    "task.params": (RESULT, "the task"),
    "task.init_from": (RESULT, "the initial weights"),
    "data.num_workers": (
        RESOURCE,
        "items depend only on (seed, epoch, index), as the Task protocol asks; a task "
        "that draws from the global random stream in __getitem__ breaks this",
    ),
    "data.pin_memory": (RESOURCE, "transfer speed"),
    "data.persistent_workers": (
        RESOURCE,
        "each index travels with its epoch, so persistent workers fetch the same items",
    ),
    "data.prefetch_factor": (RESOURCE, "how far ahead workers fetch; not what they fetch"),
    "train.profile": (RESOURCE, "which steps are traced; not what they compute"),
    "checkpoint.keep_every_steps": (RESOURCE, "which checkpoints stay on disk"),
    "checkpoint.keep_best": (RESOURCE, "which checkpoints stay on disk"),
    "observe.straggler_ratio": (RESOURCE, "which ranks are named slow; not what they compute"),
    "observe.straggler_window_s": (RESOURCE, "which ranks are named slow; not what they compute"),
    "cluster.exclude_stragglers": (RESOURCE, "which nodes a restart runs on"),
    "trackers.mlflow": (RESOURCE, "where the scalars are also sent; not what they are"),
    "trackers.wandb": (RESOURCE, "where the scalars are also sent; not what they are"),
}


def kind(key: str) -> str:
    """The kind of ``section.key`` (or a sub-key such as ``task.params.lr``); unknown keys are
    ``result``."""
    parts = key.split(".")
    return KEYS.get(".".join(parts[:2]), (RESULT, ""))[0]


def flatten(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``; mappings inside a section (task.params,
    cluster.sbatch_extra) are flattened one level further so a change names the sub-key."""
    out: dict[str, Any] = {}
    for section, values in cfg.items():
        if not isinstance(values, Mapping):
            out[section] = values
            continue
        for key, value in values.items():
            # An empty mapping adds no key: {} and absent are the same.
            if isinstance(value, Mapping):
                for sub, v in value.items():
                    out[f"{section}.{key}.{sub}"] = v
            else:
                out[f"{section}.{key}"] = value
    return out


def _get(cfg: Mapping[str, Any], section: str, key: str, default: Any) -> Any:
    return (cfg.get(section) or {}).get(key, default)


def derived(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Result-changing values that resource keys set through other keys (hashed with the result
    keys)."""
    nodes, tasks = _get(cfg, "cluster", "nodes", 1), _get(cfg, "cluster", "tasks_per_node", 1)
    gpus, backend = _get(cfg, "cluster", "gpus_per_node", 0), _get(cfg, "dist", "backend", "auto")
    device = "cuda" if gpus and backend != "gloo" else "cpu"
    amp = _get(cfg, "train", "amp", "auto")
    out = {"precision": ("bf16" if device == "cuda" else "none") if amp == "auto" else amp}
    if _get(cfg, "train", "lr_scaling", "none") != "none":
        out["world_size"] = nodes * tasks
    return out


_DERIVED_FROM = {"precision": "train.amp", "world_size": "train.lr_scaling"}
_DERIVED_WHY = {
    "precision": (
        "train.amp=auto resolves to bf16 on a GPU and to none on CPU "
        "(set by cluster.gpus_per_node and dist.backend)"
    ),
    "world_size": (
        "train.lr_scaling scales the learning rate with cluster.nodes x cluster.tasks_per_node"
    ),
}


def result_part(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The flat result keys of ``cfg`` and its derived values: what must match for a resume."""
    flat = {k: v for k, v in flatten(cfg).items() if kind(k) == RESULT}
    return {**flat, **{f"derived.{k}": v for k, v in derived(cfg).items()}}


def result_fingerprint(cfg: Mapping[str, Any]) -> str:
    """16 hex digits over the result keys and derived values only: equal for two configs that differ
    in resources (time limit, partition, nodes, workers, intervals), different otherwise."""
    text = json.dumps(result_part(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    kind: str
    why: str = ""

    def __str__(self) -> str:
        text = f"{self.key} {_show(self.old)} -> {_show(self.new)}"
        if self.kind == NUMERICS:
            text += f" (resumes, not bitwise: {self.why})"
        elif self.kind == RESULT and self.key.startswith("derived."):
            text += f" ({self.why})"
        return text


_ABSENT = object()


def _show(value: Any) -> str:
    return "(unset)" if value is _ABSENT else json.dumps(value, default=str)


def compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[Change], list[Change]]:
    """(result_changes, resource_changes) from ``old`` to ``new`` config dicts.

    The consistency policy refuses a resume with result changes (naming them) and reports the
    others (``cluster.time_min 60 -> 240``); ``numerics`` changes are in the second list and say
    why the resumed run is no longer bitwise equal to an uninterrupted one.
    """
    a, b = flatten(old), flatten(new)
    result: list[Change] = []
    other: list[Change] = []
    for key in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if va == vb:
            continue
        k = kind(key)
        change = Change(key, va, vb, k, KEYS.get(".".join(key.split(".")[:2]), (k, ""))[1])
        (result if k == RESULT else other).append(change)
    da, db = derived(old), derived(new)
    named = {c.key for c in result}
    for key in list(da) + [k for k in db if k not in da]:
        va, vb = da.get(key, _ABSENT), db.get(key, _ABSENT)
        # A named change of train.amp ('auto' -> 'bf16') already says it.
        if va != vb and _DERIVED_FROM[key] not in named:
            result.append(Change(f"derived.{key}", va, vb, RESULT, _DERIVED_WHY[key]))
    return result, other


# The one result key a resume may change when the launch asks for it: the order of samples goes
# on from the sample reached (dist/sampler.py), in batches of the new size.
BATCH_SIZE, ALLOW_BATCH_SIZE_CHANGE = "train.batch_size", "train.allow_batch_size_change"
_REBATCH_WHY = (
    "train.allow_batch_size_change: the same sample order goes on from the sample reached, in "
    "batches of the new size"
)


def allowed_batch_size_change(
    result: list[Change], new: Mapping[str, Any]
) -> tuple[list[Change], list[Change]]:
    """(``result`` without a change of ``train.batch_size``, that change as a numerics change)
    when ``new`` sets ``train.allow_batch_size_change``; else (``result``, [])."""
    if _get(new, "train", "allow_batch_size_change", False) is not True:
        return result, []
    kept = [c for c in result if c.key != BATCH_SIZE]
    moved = [
        Change(c.key, c.old, c.new, NUMERICS, _REBATCH_WHY) for c in result if c.key == BATCH_SIZE
    ]
    return kept, moved


def summary(changes: list[Change], limit: int = 6) -> str:
    """``a 1 -> 2; b x -> y; and 3 more`` for one-line messages."""
    text = "; ".join(str(c) for c in changes[:limit])
    return text + (f"; and {len(changes) - limit} more" if len(changes) > limit else "")


def reference_markdown() -> str:
    """The table of docs/workflows.md, generated from :data:`KEYS`."""
    lines = ["| key | kind | why |", "|---|---|---|"]
    lines += [f"| `{k}` | {kd} | {why} |" for k, (kd, why) in KEYS.items()]
    return "\n".join(lines)
