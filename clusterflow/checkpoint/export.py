"""One file out of a committed checkpoint, sharded or not (``python -m clusterflow.export``).

The checkpoint is found the way a resume finds it (the run dir's ``config.yaml`` says where its
checkpoints live) and verified the same way (every file's size and digest, a damaged one is
refused by name). A one-file checkpoint's ``model.pt`` is the state_dict already; a sharded one
(``train.parallel=fsdp``) is read in this process, without a process group: DCP assembles every
parameter from all ranks' shards by the checkpoint's own metadata, so it needs neither the task
nor the world size it was written with. The output is a plain state_dict, written atomically:
``torch.save`` (``.pt``: loads with ``torch.load(weights_only=True)``) or safetensors.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as safetensors_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from clusterflow.checkpoint.sharded import FORMAT as SHARDED
from clusterflow.errors import UserError, cli
from clusterflow.rundir import saved_config
from clusterflow.storage import durable
from clusterflow.storage.store import CheckpointStore

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def model_state(
    run_dir: str, step: int | None = None, weights: str = "model"
) -> tuple[dict[str, Any], int]:
    """(the whole model's state_dict, its step) from the newest committed checkpoint of
    ``run_dir`` that verifies, or from step ``step``; ``weights="ema"``: with the EMA weights in
    place of the parameters (``train.ema_decay``). UserError when there is none."""
    cfg = saved_config.read(run_dir, set_aside=False)
    if cfg is None:
        raise UserError(
            f"{run_dir} is not a run dir (no readable config.yaml); "
            "give the RUN_DIR a run was submitted with"
        )
    store = CheckpointStore(cfg.checkpoint_dir, cfg.checkpoint.keep_last)
    steps = store.steps()
    if step is None:
        ckpt = store.latest()
        if ckpt is None:
            raise UserError(
                f"{run_dir} has no committed checkpoint that verifies "
                f"(committed: {', '.join(map(str, steps)) or 'none'}); "
                "run it until it saves one"
            )
    else:
        if step not in steps:
            raise UserError(
                f"--step {step}: {run_dir} has no committed step {step}; "
                f"committed: {', '.join(map(str, steps)) or 'none'}"
            )
        try:
            ckpt = store.verify(step)
        except ValueError as exc:
            raise UserError(
                f"--step {step}: checkpoint {store.url_of(step)} is damaged ({exc}); "
                f"pick another of {', '.join(map(str, steps))}"
            ) from None
    if ckpt.manifest.get("format") == SHARDED:
        folder = store.step_path(ckpt.step)
        state, ema = _gather_shards(folder, "model"), _gather_shards(folder, "ema")
    else:
        state = dict(ckpt.load("model.pt"))
        ema = dict((ckpt.load("train_state.pt") or {}).get("ema") or {})
    if weights == "ema":
        if not ema:
            raise UserError(
                f"--weights ema: checkpoint step {ckpt.step} of {run_dir} holds no EMA weights "
                "(the run has train.ema_decay=0); export its weights without --weights ema"
            )
        state.update(ema)  # the model's buffers, the averaged parameters
    return state, ckpt.step


def _gather_shards(folder: str, name: str) -> dict[str, Any]:
    """The ``name`` entries (``model``, ``ema``) of a DCP checkpoint as whole tensors, read in
    one process (empty when it has none)."""
    reader = dcp.FileSystemReader(folder)
    prefix = f"{name}."
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        return {}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len(prefix) :]: t for key, t in state.items()}


def export(
    run_dir: str,
    out: str,
    step: int | None = None,
    fmt: str = "pt",
    dtype: str | None = None,
    weights: str = "model",
) -> int:
    """Write the model of ``run_dir``'s checkpoint (newest, or ``step``) to ``out``; floating
    tensors cast to ``dtype`` ("bf16" or "fp32") when given; ``weights="ema"``: the EMA
    weights. Returns the step."""
    state, at = model_state(run_dir, step, weights)
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    if fmt == "safetensors":
        # safetensors takes contiguous tensors that share no storage.
        payload = safetensors_save({k: v.detach().contiguous().clone() for k, v in state.items()})
        durable.write_atomic(out, payload)
    else:
        durable.write_atomic(out, state)
    return at


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.export",
        description="Write the model of a committed checkpoint (sharded or not) as one file.",
        epilog="example: python -m clusterflow.export runs/vit --format safetensors model.st",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out", metavar="OUT", help="the file to write")
    p.add_argument("--step", type=int, help="this committed step (default: the newest)")
    p.add_argument("--format", choices=("pt", "safetensors"), default="pt", dest="fmt")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="cast floating tensors (default: keep)")
    p.add_argument(
        "--weights",
        choices=("model", "ema"),
        default="model",
        help="the trained weights or their moving average (train.ema_decay > 0)",
    )
    return p.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.isdir(args.run_dir):
        raise UserError(f"RUN_DIR {args.run_dir!r} is not a directory; give a run's run.dir")
    step = export(args.run_dir, args.out, args.step, args.fmt, args.dtype, args.weights)
    print(f"wrote the model of checkpoint step {step} of {args.run_dir} to {args.out}")
    return 0
