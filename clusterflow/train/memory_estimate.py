"""How much GPU memory one process of a run needs, by part, before it starts (``submit --local``
picks GPUs that fit it; ``launch/gpus.py``).

- parameters: the model's, as built (``task.build_model()`` on the CPU);
- gradients: one per trainable parameter, the parameter's size;
- optimizer state: AdamW keeps two moments per trainable parameter, SGD (momentum) one;
- activations of one batch: what autograd saves for the backward pass of one micro-batch
  (``train.batch_size / world / train.grad_accum`` samples), measured on a few real samples of
  the task's dataset through ``task.loss`` (``saved_tensors_hooks``), scaled to the micro-batch,
  and halved under bf16/fp16 autocast.

Under ``train.parallel=fsdp`` the first three are sharded over the ranks. The estimate leaves out
the CUDA context and the allocator's slack, which ``launch/gpus.py`` adds as a margin, and
temporary buffers of the kernels (workspace), which a tight fit may need on top.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import default_collate

from clusterflow.config.job_config import Config
from clusterflow.tasks import Task, load_task

PARTS = ("parameters", "gradients", "optimizer state", "activations of one batch")
# The optimizer's state per trainable parameter, in parameters' sizes.
STATE_PER_PARAMETER = {"adamw": 2, "sgd": 1}
# Samples run through the loss to measure the activations (then scaled to the micro-batch).
MEASURED = 4


def micro_batch(cfg: Config) -> int:
    """Samples one process runs forward at once."""
    world = cfg.cluster.nodes * cfg.cluster.tasks_per_node
    return max(1, math.ceil(cfg.train.batch_size / (world * cfg.train.grad_accum)))


def estimate(cfg: Config) -> dict[str, int]:
    """Bytes per process on its GPU, by part (:data:`PARTS`)."""
    task = load_task(cfg.task.target, cfg.run.seed, dict(cfg.task.params))
    model = task.build_model()
    params = list(model.parameters())
    size = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    shards = cfg.cluster.nodes * cfg.cluster.tasks_per_node if cfg.train.parallel == "fsdp" else 1
    state = STATE_PER_PARAMETER.get(cfg.train.optimizer, 2)
    return {
        "parameters": size // shards,
        "gradients": trainable // shards,
        "optimizer state": state * trainable // shards,
        "activations of one batch": _activations(cfg, task, model),
    }


def _activations(cfg: Config, task: Task, model: torch.nn.Module) -> int:
    """Bytes autograd keeps for the backward pass of one micro-batch (parameters excluded); 0
    for a dataset without a length (an iterable one: nothing to take samples from here)."""
    dataset = task.train_dataset()
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return 0
    micro = micro_batch(cfg)
    n = min(MEASURED, micro, length)
    if n <= 0:
        return 0
    batch = default_collate([dataset[i] for i in range(n)])
    weights = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task.loss(model, batch, None)
    half = cfg.train.amp in ("bf16", "fp16", "auto")  # auto: bf16 on a GPU
    return int(sum(seen.values()) * micro / n / (2 if half else 1))
