"""Which task a job trains and its parameters (``task.*``).

Read by ``tasks.load_task`` through ``job/job.py`` and ``launch/submit.py``, by
``train/builders.py`` (``init_from``) and ``train/trainer.py``. A task's keys: a script has no
task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterflow.config.sections.fields import RESULT, TASK, check, doc


@dataclass
class TaskConfig:
    """What is trained."""

    target: str = doc(
        "clusterflow.tasks.pseudo_id:PseudoIDTask",
        "The task class, as package.module:Class.",
        kind=RESULT,
        why="the task",
        applies=TASK,
    )
    params: dict[str, Any] = doc(
        factory=dict,
        help="Keyword arguments of the task (validated by the task).",
        kind=RESULT,
        why="the task",
        applies=TASK,
    )
    init_from: str = doc(
        "",
        "Start from these weights (matched by name and shape): a model.pt or safetensors file, "
        "a run dir (its model.pt, else its newest checkpoint that verifies) or one "
        "checkpoints/step-N folder (verified like a resume).",
        kind=RESULT,
        why="the initial weights",
        applies=TASK,
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
        check(
            named,
            "task.target",
            self.target,
            "must look like package.module:ClassName, "
            "e.g. clusterflow.tasks.pseudo_id:PseudoIDTask",
        )
