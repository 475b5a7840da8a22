"""How a task is trained, and the few keys a script's loop shares (``train.*``).

Read by the task trainer (``train/trainer.py``, ``train/builders.py``), all of them; a script's
loop sets its own batch, optimizer and schedule and reads only the keys not marked
``applies=TASK``:
``parallel`` (``train/models.py``), ``amp`` (``run.autocast``: ``train/builders.py``'s
``Precision``), ``log_every_steps``, ``profile`` and ``progress_bar`` (``observe/reporter.py``,
the mining round's bar) and ``on_nonfinite`` (``train/finite.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from clusterflow.config.sections.fields import NUMERICS, RESOURCE, RESULT, TASK, check, choice, doc


@dataclass
class TrainConfig:
    """The optimisation loop."""

    epochs: int = doc(
        4,
        "Number of epochs.",
        kind=RESULT,
        why="the cosine schedule spans all epochs, so every step's learning rate depends on it",
        applies=TASK,
    )
    batch_size: int = doc(
        128,
        "Global batch per optimizer step, over all ranks and accumulation steps.",
        kind=RESULT,
        why="the global batch",
        applies=TASK,
    )
    grad_accum: int = doc(
        1,
        "Micro-steps accumulated per optimizer step.",
        kind=RESULT,
        why="the micro-batch, hence in-batch negatives and BatchNorm statistics",
        applies=TASK,
    )
    lr: float = doc(
        1e-3,
        "Learning rate for one process (see lr_scaling).",
        kind=RESULT,
        why="optimisation",
        applies=TASK,
    )
    lr_scaling: str = doc(
        "none",
        "How lr grows with world size: none, linear or sqrt.",
        kind=RESULT,
        why="optimisation",
        applies=TASK,
    )
    warmup_steps: int = doc(
        0, "Linear warm-up steps.", kind=RESULT, why="optimisation", applies=TASK
    )
    schedule: str = doc(
        "cosine",
        "Learning-rate schedule after warm-up: cosine or constant.",
        kind=RESULT,
        why="optimisation",
        applies=TASK,
    )
    optimizer: str = doc(
        "adamw", "adamw or sgd (momentum 0.9).", kind=RESULT, why="optimisation", applies=TASK
    )
    weight_decay: float = doc(0.0, "Weight decay.", kind=RESULT, why="optimisation", applies=TASK)
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
        applies=TASK,
    )
    grad_clip: float = doc(
        0.0,
        "Clip the gradient norm to this value; 0 disables.",
        kind=RESULT,
        why="optimisation",
        applies=TASK,
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
        applies=TASK,
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
        applies=TASK,
    )
    ema_decay: float = doc(
        0.0,
        "Keep an exponential moving average of the weights (on every rank; sharded like the "
        "model under fsdp): after each optimizer step ema = decay * ema + (1 - decay) * "
        "weights; 0 turns it off. Saved in every checkpoint, evaluated beside the weights "
        "(eval_ema/...), written as model_ema.pt at the end (docs/sharded.md).",
        kind=RESULT,
        why="the EMA weights (and the labels when mining embeds with them)",
        applies=TASK,
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
        applies=TASK,
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
        check(
            not self.profile or re.fullmatch(r"\d+(-\d+)?(@\d+(,\d+)*)?", self.profile) is not None,
            "train.profile",
            self.profile,
            "must be FIRST-LAST@RANKS, e.g. 10-12@0,1 (global steps, 1-based; ranks default to 0)",
        )
        window = self.profile_window
        check(
            window is None or 1 <= window[0] <= window[1],
            "train.profile",
            self.profile,
            "the first step must be >= 1 and not after the last, e.g. 10-12",
        )
        check(self.epochs >= 1, "train.epochs", self.epochs, "must be >= 1")
        check(self.batch_size >= 1, "train.batch_size", self.batch_size, "must be >= 1")
        check(self.grad_accum >= 1, "train.grad_accum", self.grad_accum, "must be >= 1")
        check(
            self.lr > 0 and math.isfinite(self.lr), "train.lr", self.lr, "must be a positive number"
        )
        choice("train.lr_scaling", self.lr_scaling, ("none", "linear", "sqrt"))
        choice("train.schedule", self.schedule, ("cosine", "constant"))
        choice("train.optimizer", self.optimizer, ("adamw", "sgd"))
        choice("train.amp", self.amp, ("auto", "none", "bf16", "fp16"))
        check(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0")
        check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        check(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0")
        check(
            self.log_every_steps >= 1, "train.log_every_steps", self.log_every_steps, "must be >= 1"
        )
        check(
            self.eval_every_epochs >= 0,
            "train.eval_every_epochs",
            self.eval_every_epochs,
            "must be >= 0",
        )
        choice("train.on_nonfinite", self.on_nonfinite, ("fail", "skip_step"))
        choice("train.parallel", self.parallel, ("ddp", "fsdp"))
        check(
            0.0 <= self.ema_decay < 1.0,
            "train.ema_decay",
            self.ema_decay,
            "must be in [0, 1): 0 turns the EMA off, e.g. 0.999 averages over about 1000 steps",
        )
        check(
            not (self.parallel == "fsdp" and self.amp == "fp16"),
            "train.amp",
            self.amp,
            "fp16 loss scaling is not supported with train.parallel=fsdp; "
            "use train.amp=bf16 (FSDP's bf16 parameters with fp32 gradient reduction)",
        )
        check(
            self.max_consecutive_skips >= 0,
            "train.max_consecutive_skips",
            self.max_consecutive_skips,
            "must be >= 0",
        )
