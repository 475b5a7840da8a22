"""What a failed job says: one line for every cause clusterflow can name, and the traceback where
it helps (the user's own task code).

| raised                                            | exit | printed and recorded                 |
|---------------------------------------------------|------|--------------------------------------|
| ``UserError``: bad input (config, task.target     | 2    | one line                             |
| that does not exist, task.params, batch size)     |      |                                      |
| ``RunFailed``: a full disk, a diverged loss       | 1    | one line                             |
| anything raised in the task's module (importing   | 1    | one line naming task.target and      |
| it, ``__init__``, ``build_model``, ``loss``, ...) |      | where, then the task's traceback     |
| or in a script of the user's own (``--script``)   |      | (the script's: naming the script)    |
| anything else (a clusterflow defect)              | 1    | the traceback, as Python prints it   |

``submit --local`` and ``run`` give the same exit status for the same failure: the job records it
in ``status.json`` (``exit_code``) and ``submit`` exits with it.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass

from clusterflow.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, RunFailed, TaskError, UserError


@dataclass(frozen=True)
class Failure:
    message: str  # one line: status.json's error, errors/rank<R>.json's error
    trace: str  # the traceback worth keeping ("" for a failure the message says all about)
    code: int  # the exit status
    # True: clusterflow explains it and exits with ``code``; False: Python's own traceback and
    # exit status
    named: bool


def _task_file(target: str) -> str | None:
    module = sys.modules.get(target.partition(":")[0])
    path = getattr(module, "__file__", None)
    return os.path.realpath(path) if path else None


def task_frame(
    exc: BaseException, target: str, script: str | None = None
) -> traceback.FrameSummary | None:
    """The outermost frame of ``exc``'s traceback in the task's module (the Task method clusterflow
    called: ``build_model``, ``loss``, ...), or in ``script`` (a script of the user's own), or
    None."""
    path = os.path.realpath(script) if script else _task_file(target)
    if path is None:
        return None
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == path
    ]
    return frames[0] if frames else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe(exc: BaseException, target: str, script: str | None = None) -> Failure:
    """How the job reports ``exc``, raised while running the task ``target`` (``module:Class``) or,
    with ``script``, that script (the file it runs from)."""
    if isinstance(exc, UserError):
        return Failure(str(exc), "", EXIT_BAD_INPUT, True)
    if isinstance(exc, RunFailed):
        return Failure(str(exc), "", EXIT_JOB_FAILED, True)
    if isinstance(exc, TaskError) and exc.__cause__ is not None:
        return Failure(
            str(exc), "".join(traceback.format_exception(exc.__cause__)), EXIT_JOB_FAILED, True
        )
    frame = task_frame(exc, target, script) if isinstance(exc, Exception) else None
    if frame is not None:
        where = f"{frame.name} ({frame.filename}:{frame.lineno})"
        what = f"script {os.path.basename(script)!r}" if script else f"task.target {target!r}"
        return Failure(
            f"{what} failed in {where}: {_one_line(exc)}",
            "".join(traceback.format_exception(exc)),
            EXIT_JOB_FAILED,
            True,
        )
    return Failure(_one_line(exc), "".join(traceback.format_exception(exc)), EXIT_JOB_FAILED, False)
