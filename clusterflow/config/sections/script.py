"""The script a job runs as its program (``script.*``).

Read by ``job/script.py`` (``run_script``), ``job/run.py``, ``launch/submit.py``,
``launch/jobs.py``, ``launch/sweep.py`` and ``rundir/saved_config.py`` (``script.files``: the
files the arguments name, checked at every launch and attempt by ``rundir/script_files.py``); set
by ``submit --script``. A script's keys: a task's job has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.config.sections.fields import RESULT, SCRIPT, check, doc


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
        applies=SCRIPT,
    )
    args: list[str] = doc(
        factory=list,
        help="The script's own command-line arguments, passed to it untouched (the words after "
        "-- on the submit command line).",
        kind=RESULT,
        why="a script's arguments choose its model, data and optimisation",
        applies=SCRIPT,
    )
    files: dict[str, str] = doc(
        factory=dict,
        help="The files the script's arguments name (a word, or the value of --name=VALUE or "
        "name=VALUE, that is an existing file of at most 16 MiB), by path as written, with a "
        "digest of each: recorded when the run starts (submit --script, or the first start by "
        "hand); every later launch and attempt of the run refuses to go on once one of them "
        "changed (docs/own-loop.md#files-the-script-reads). Set it to {} to record none.",
        kind=RESULT,
        why="a file the script reads (its config) chooses its model, data and optimisation",
        applies=SCRIPT,
    )

    def __post_init__(self) -> None:
        check(
            not self.path or self.path.endswith(".py"),
            "script.path",
            self.path,
            "must be a Python file (train.py); a module or a task is task.target's",
        )
        check(
            not self.args or bool(self.path),
            "script.args",
            self.args,
            "are the arguments of a script: give its path too (submit --script train.py -- ARGS)",
        )
        check(
            all(isinstance(v, str) for v in self.files.values()),
            "script.files",
            self.files,
            "maps each file the script's arguments name to its digest (a string); "
            "submit records it, or give {} to record none",
        )
