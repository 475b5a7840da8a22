"""The pieces a trainer is built from: model, optimizer, schedule, precision, and
``task.init_from`` weights (``Run.setup`` places and wraps the model). Each builder is small;
``Trainer.__init__`` calls them in an order that keeps every random draw where it was (same seed,
same weights).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from collections.abc import Callable
from typing import Any

import fsspec
import torch
from safetensors.torch import load as safetensors_load

from clusterflow.checkpoint import export
from clusterflow.config.job_config import Config
from clusterflow.config.sections import TrainConfig
from clusterflow.errors import UserError
from clusterflow.rundir.records import RunPaths
from clusterflow.storage.store import MANIFEST
from clusterflow.tasks import Task

log = logging.getLogger("clusterflow.trainer")


def lr_multiplier(rule: str, world: int) -> float:
    return {"none": 1.0, "linear": float(world), "sqrt": math.sqrt(world)}[rule]


def amp_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[setting]


class Precision:
    """``train.amp`` on a device, built once by the run (``RunInternals.precision``) and used by
    whatever loop trains on it, a script's or the task trainer: the dtype of the autocast around
    a forward and its loss, and the one GradScaler that fp16 needs (a pass-through otherwise),
    which the loop steps and every checkpoint saves."""

    def __init__(self, setting: str, device: torch.device) -> None:
        self.device_type = device.type
        self.dtype = amp_dtype(setting, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Around a forward and its loss: autocast to ``dtype`` (nothing when it is None)."""
        dtype = self.dtype
        return torch.autocast(self.device_type, dtype=dtype, enabled=dtype is not None)


def build_model(cfg: Config, task: Task, device: torch.device) -> torch.nn.Module:
    """The task's model with ``task.init_from``'s weights, unwrapped and where the task built it
    (``Run.setup`` places and wraps it). Seed before calling it."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    model = task.build_model()
    if cfg.task.init_from:
        init_weights(model, cfg.task.init_from)
    return model


def build_optimizer(t: TrainConfig, module: torch.nn.Module, world: int) -> torch.optim.Optimizer:
    lr = t.lr * lr_multiplier(t.lr_scaling, world)
    params = [p for p in module.parameters() if p.requires_grad]
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=t.weight_decay)


def lr_schedule(
    t: TrainConfig, total_samples: int, trained: Callable[[], int]
) -> Callable[[int], float]:
    """Warm-up over ``train.warmup_steps`` steps, then constant or cosine to zero at the end of
    the run: the multiplier of step ``step``. The cosine's progress counts samples
    (``trained()`` of ``total_samples``), so a resume with another ``train.batch_size`` continues
    the same curve; with a batch size that divides the dataset it is the step count's progress,
    exactly."""

    def multiplier(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        warm = t.warmup_steps * t.batch_size
        # Integers divided once: the correctly rounded quotient of the same ratio as
        # (step - warmup) / (total_steps - warmup).
        progress = (trained() - warm) / max(1, total_samples - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return multiplier


def init_weights(model: torch.nn.Module, where: str) -> None:
    """Start from another run's weights (``task.init_from``): a model.pt or a safetensors file
    (``clusterflow.export``), a finished run dir (its model.pt), an unfinished one (its newest
    committed checkpoint that verifies, sharded by ``train.parallel=fsdp`` or not), one
    ``checkpoints/step-N`` folder, or a folder of such steps. A checkpoint is verified as a resume
    verifies it (its manifest, every file's size and digest, the checkpoint id each carries).

    Tensors are matched by name and shape; the rest of the model keeps its fresh initialisation
    (a new classifier head, say). A file that matches nothing is an error, not a silent no-op.
    """
    fs, path = fsspec.core.url_to_fs(where)
    path = path.rstrip("/")
    if fs.isdir(path):
        sd, source = _folder_weights(fs, path, where)
    else:
        sd, source = _file_weights(fs, path, where), path
    _load_matching(model, sd, where, source)


def _folder_weights(
    fs: fsspec.AbstractFileSystem, path: str, where: str
) -> tuple[dict[str, Any], str]:
    """(state_dict, where it came from) of a folder named by ``task.init_from``."""
    run = RunPaths(path)
    if fs.exists(f"{path}/{MANIFEST}"):  # one checkpoints/step-N folder
        try:
            sd, step = export.step_folder_state(where.rstrip("/"))
        except ValueError as exc:
            raise UserError(
                f"task.init_from={where!r}: checkpoint {path} is damaged ({exc}); point it at "
                "another checkpoints/step-N folder, or at the run dir (its newest that verifies)"
            ) from None
        return sd, f"{path} (checkpoint step {step})"
    if fs.exists(run.model):
        return _file_weights(fs, run.model, where), run.model
    if fs.exists(run.config):
        # An unfinished run: its newest committed checkpoint, sharded (fsdp) or not, verified.
        sd, step = export.model_state(path)
        return sd, f"{path} (checkpoint step {step})"
    for root in (run.checkpoints, path):  # a run dir without config.yaml, or its checkpoints
        store = export.open_store(root)
        damaged: dict[int, str] = {}
        ckpt = next(store.candidates(damaged=damaged), None)
        if ckpt is not None:
            sd = export.checkpoint_state(store, ckpt)
            return sd, f"{ckpt.path} (checkpoint step {ckpt.step})"
        if damaged:
            raise UserError(
                f"task.init_from={where!r}: no checkpoint in {root} verifies ("
                + "; ".join(f"step-{s}: {w}" for s, w in sorted(damaged.items(), reverse=True))
                + "); point it at a model.pt or a sound checkpoints/step-N folder"
            )
    raise UserError(
        f"task.init_from={where!r} is a folder without model.pt or committed "
        "checkpoints; point it at a finished run dir, a checkpoints/step-N folder or "
        "a model.pt file"
    )


def _file_weights(fs: fsspec.AbstractFileSystem, path: str, where: str) -> dict[str, Any]:
    """The state_dict in a model.pt (``torch.save``) or a safetensors file."""
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
        sd = (
            safetensors_load(data)
            if _is_safetensors(data)
            else torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        )
    except FileNotFoundError:
        raise UserError(
            f"task.init_from={where!r} does not exist; point it at a model.pt, "
            "e.g. RUN_DIR/model.pt of stage 1"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        detail = " ".join(str(exc).split())[:300]
        raise UserError(
            f"task.init_from={where!r}: {path} is not a readable state_dict "
            f"({type(exc).__name__}: {detail})"
        ) from None
    if not isinstance(sd, dict):
        raise UserError(
            f"task.init_from={where!r}: {path} holds a {type(sd).__name__}, not a state_dict"
        )
    return sd


def _is_safetensors(data: bytes) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then that much JSON."""
    if len(data) < 10:
        return False
    size = int.from_bytes(data[:8], "little")
    return 2 <= size <= len(data) - 8 and data[8:9] == b"{"


def _load_matching(model: torch.nn.Module, sd: dict[str, Any], where: str, path: str) -> None:
    """Load the tensors of ``sd`` whose name and shape the model has; none is an error."""
    own = model.state_dict()
    matched = {k: v for k, v in sd.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    if not matched:
        raise UserError(
            f"task.init_from={where!r}: none of its {len(sd)} tensors "
            f"({', '.join(list(sd)[:3])}, ...) match the model's names and shapes "
            f"({', '.join(list(own)[:3])}, ...); was it written by a different model?"
        )
    model.load_state_dict(matched, strict=False)
    fresh = [k for k in own if k not in matched]
    skipped = [k for k in sd if k not in matched]
    log.info(
        "initialised %d of %d tensors from %s; fresh: %s; not used: %s",
        len(matched),
        len(own),
        path,
        ", ".join(fresh) or "none",
        ", ".join(skipped) or "none",
    )
