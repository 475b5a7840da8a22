"""One file out of a committed checkpoint, sharded or not (``python -m clusterflow.export``).

The checkpoint is found the way a resume finds it (the run dir's ``config.yaml`` says where its
checkpoints live) and verified the same way (its manifest lists exactly the files of its folder,
each with its size and digest, and each carries the checkpoint's id: a damaged one is refused by
name). A one-file checkpoint's ``model.pt`` is the state_dict already; a sharded one
(``train.parallel=fsdp``) is read in this process, without a process group: DCP assembles every
parameter from all ranks' shards by the checkpoint's own metadata, so it needs neither the task
nor the world size it was written with. The output is a plain state_dict: ``torch.save``
(``.pt``: loads with ``torch.load(weights_only=True)``) or safetensors, by OUT's suffix or
``--format``.

OUT is checked before anything is read: never inside the run dir or its checkpoint dir (resolving
links and ``..``), never an existing file without ``--force``, never a folder, a path under a
file or on a filesystem this user cannot write. It is written atomically (a hidden sibling
renamed over OUT): a full disk, or any failed write, leaves no half file there.
"""

from __future__ import annotations

import argparse
import os
import re
import warnings
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from clusterflow.checkpoint import identity
from clusterflow.checkpoint.sharded import plain_errors
from clusterflow.config.job_config import Config
from clusterflow.config.paths import check_local_dir
from clusterflow.config.sections import is_url
from clusterflow.distributed import sharding
from clusterflow.errors import RunFailed, UserError, cli
from clusterflow.rundir import saved_config
from clusterflow.storage import diskfull, durable
from clusterflow.storage.names import DCP, MODEL, TRAIN_STATE
from clusterflow.storage.store import Checkpoint, CheckpointStore
from clusterflow.storage.tensors import TORCH

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FORMATS = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors"}  # by OUT's suffix
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def _config(run_dir: str) -> Config:
    cfg = saved_config.read(run_dir, set_aside=False)
    if cfg is None:
        raise UserError(
            f"{run_dir} is not a run dir (no readable config.yaml); "
            "give the RUN_DIR a run was submitted with"
        )
    return cfg


def open_store(root: str, keep_last: int = 2) -> CheckpointStore:
    """The checkpoints under ``root``, read as a resume reads them (``identity.check``)."""
    return CheckpointStore(root, keep_last, check=identity.check, codec=TORCH)


def _loadable(store: CheckpointStore, but: int | None = None) -> str:
    """The committed steps that verify, newest first, but ``but`` (for a message)."""
    good = []
    for step in reversed(store.steps()):
        if step == but:
            continue
        try:
            store.verify(step)
        except ValueError:
            continue
        good.append(str(step))
    return ", ".join(good) or "none"


def model_state(
    run_dir: str, step: int | None = None, weights: str = "model"
) -> tuple[dict[str, Any], int]:
    """(the whole model's state_dict, its step) from the newest committed checkpoint of
    ``run_dir`` that verifies, or from step ``step``; ``weights="ema"``: with the EMA weights in
    place of the parameters (``train.ema_decay``). UserError when there is none."""
    cfg = _config(run_dir)
    store = open_store(cfg.checkpoint_dir, cfg.checkpoint.keep_last)
    steps = store.steps()
    if step is None:
        damaged: dict[int, str] = {}
        ckpt = next(store.candidates(damaged=damaged), None)
        if ckpt is None:
            why = "; ".join(f"step-{s}: {w}" for s, w in sorted(damaged.items(), reverse=True))
            raise UserError(
                f"{run_dir} has no committed checkpoint that verifies "
                f"({'damaged: ' + why if why else 'none committed'}); run it until it saves one"
            )
    elif step not in steps:
        raise UserError(
            f"--step {step}: {run_dir} has no committed step {step}; "
            f"loadable steps: {_loadable(store)}"
        )
    else:
        try:
            ckpt = store.verify(step)
        except ValueError as exc:
            raise UserError(
                f"--step {step}: checkpoint {store.url_of(step)} is damaged ({exc}); "
                f"pick one of the loadable steps: {_loadable(store, but=step)}"
            ) from None
    return checkpoint_state(store, ckpt, weights, run_dir), ckpt.step


def checkpoint_state(
    store: CheckpointStore, ckpt: Checkpoint, weights: str = "model", where: str = ""
) -> dict[str, Any]:
    """The whole model's state_dict in the verified checkpoint ``ckpt`` (one file or sharded);
    ``weights="ema"``: the EMA weights in place of the parameters."""
    if ckpt.manifest.get("format") == DCP:
        folder = store.step_path(ckpt.step)
        try:
            state, ema = _gather_shards(folder, "model"), _gather_shards(folder, "ema")
        except Exception as exc:  # noqa: BLE001 - a shard intact by its manifest that DCP refuses
            detail = " ".join(str(exc).split())[:300]
            raise UserError(
                f"checkpoint step {ckpt.step} of {where or ckpt.path} verifies, but its shards "
                f"do not load ({type(exc).__name__}: {detail}); pick another step"
            ) from None
    else:
        state = dict(ckpt.load(MODEL))
        ema = dict((ckpt.load(TRAIN_STATE) or {}).get("ema") or {})
    if weights == "ema":
        if not ema:
            raise UserError(
                f"--weights ema: checkpoint step {ckpt.step} of {where or ckpt.path} holds no EMA "
                "weights (the run has train.ema_decay=0); export its weights without --weights ema"
            )
        state.update(ema)  # the model's buffers, the averaged parameters
    return state


def step_folder_state(folder: str) -> tuple[dict[str, Any], int]:
    """(the whole model's state_dict, the step) of one ``checkpoints/step-N`` folder (a path or
    URL), verified as a resume verifies it; ValueError naming what is wrong."""
    parent, _, name = folder.rstrip("/").rpartition("/")
    match = _STEP_FOLDER.match(name)
    if not match:
        raise ValueError(f"{name!r} is not a step-N folder")
    store = open_store(parent or ".")
    ckpt = store.verify(int(match.group(1)))
    return checkpoint_state(store, ckpt), ckpt.step


def _gather_shards(folder: str, name: str) -> dict[str, Any]:
    """The ``name`` entries (``model``, ``ema``) of a DCP checkpoint as whole tensors, read in
    one process (empty when it has none)."""
    prefix = f"{name}."
    return {key[len(prefix) :]: t for key, t in shard_tensors(folder, prefix).items()}


def shard_tensors(folder: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint whose key starts with ``prefix``, whole, by its key, read
    in one process (empty when it has none)."""
    dcp = sharding.dcp()
    reader = dcp.FileSystemReader(folder)
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, dcp.metadata.TensorStorageMetadata)
    }
    if not state:
        return {}
    with warnings.catch_warnings(), plain_errors():  # "... to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def out_format(out: str, fmt: str | None) -> str:
    """The format OUT is written in: ``--format``, else its suffix (``.safetensors``, ``.pt``),
    else pt. UserError when they contradict each other."""
    suffix = os.path.splitext(out)[1].lower()
    implied = FORMATS.get(suffix)
    if fmt and implied and fmt != implied:
        wanted = next(s for s, f in FORMATS.items() if f == fmt)
        raise UserError(
            f"--format {fmt} contradicts OUT's suffix {suffix} ({out!r}); drop --format "
            f"(the suffix decides), or name OUT with {wanted}"
        )
    return fmt or implied or "pt"


def _inside(path: str, folder: str) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(folder)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def check_out(out: str, run_dir: str, checkpoint_dir: str, force: bool) -> None:
    """UserError unless OUT can be written without harm: outside the run dir and its checkpoint
    dir, not a folder, not an existing file (unless ``force``), in a folder this user can write
    (or create)."""
    for top, what in ((run_dir, "the run dir"), (checkpoint_dir, "the run's checkpoint dir")):
        if not is_url(top) and _inside(out, top.removeprefix("file://")):
            raise UserError(
                f"OUT {out!r} is inside {what} {top} (it resolves to {os.path.realpath(out)}): "
                "an export must not touch the run's checkpoints or its model.pt; write it "
                "outside, e.g. exports/model.pt"
            )
    if not os.path.basename(out):
        raise UserError(f"OUT {out!r} names no file; give a file name, e.g. exports/model.pt")
    if os.path.isdir(out):
        raise UserError(
            f"OUT {out!r} is a folder; name the file to write, e.g. {os.path.join(out, MODEL)}"
        )
    if os.path.lexists(out) and not force:
        raise UserError(f"OUT {out!r} exists; pass --force to replace it, or pick another path")
    check_local_dir("OUT's folder", os.path.dirname(os.path.abspath(out)))


def _write(out: str, payload: dict[str, torch.Tensor] | bytes) -> None:
    """Write OUT atomically; any failure is one line (UserError) and leaves nothing at OUT."""
    try:
        durable.write_atomic(out, payload, codec=TORCH)
    except (OSError, RunFailed) as exc:
        full = diskfull.describe(exc, "the export", out, diskfull.payload_bytes(payload))
        if full:
            raise UserError(
                f"{full}; free space there or pick another OUT (nothing was written at {out})"
            ) from None
        raise UserError(
            f"OUT {out!r} could not be written ({type(exc).__name__}: {exc}); nothing was "
            "written there; pick another path"
        ) from None


def export(
    run_dir: str,
    out: str,
    *,
    step: int | None = None,
    fmt: str | None = None,
    dtype: str | None = None,
    weights: str = "model",
    force: bool = False,
) -> int:
    """Write the model of ``run_dir``'s checkpoint (newest, or ``step``) to ``out``, in ``fmt``
    (None: by OUT's suffix); floating tensors cast to ``dtype`` ("bf16" or "fp32") when given;
    ``weights="ema"``: the EMA weights; ``force``: replace an existing OUT. Returns the step."""
    fmt = out_format(out, fmt)
    cfg = _config(run_dir)
    check_out(out, run_dir, cfg.checkpoint_dir, force)
    state, at = model_state(run_dir, step, weights)
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    if fmt == "safetensors":
        # safetensors takes contiguous tensors that share no storage.
        _write(
            out, safetensors_save({k: v.detach().contiguous().clone() for k, v in state.items()})
        )
    else:
        _write(out, state)
    return at


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.export",
        description="Write the model of a committed checkpoint (sharded or not) as one file.",
        epilog="example: python -m clusterflow.export runs/vit model.safetensors --step 400",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out", metavar="OUT", help="the file to write")
    p.add_argument("--step", type=int, help="this committed step (default: the newest)")
    p.add_argument(
        "--format",
        choices=("pt", "safetensors"),
        dest="fmt",
        help="default: by OUT's suffix (.safetensors, .pt), else pt",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), help="cast floating tensors (default: keep)")
    p.add_argument(
        "--weights",
        choices=("model", "ema"),
        default="model",
        help="the trained weights or their moving average (train.ema_decay > 0)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return p.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(args.run_dir):
        raise UserError(f"RUN_DIR {args.run_dir!r} is not a directory; give a run's run.dir")
    step = export(
        args.run_dir,
        args.out,
        step=args.step,
        fmt=args.fmt,
        dtype=args.dtype,
        weights=args.weights,
        force=args.force,
    )
    print(f"wrote the model of checkpoint step {step} of {args.run_dir} to {args.out}")
    return 0
