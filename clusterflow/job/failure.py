"""What a failed job says: one line for every cause clusterflow can name, and the traceback where
it helps (the user's own task code).

| raised                                            | exit | printed and recorded                 |
|---------------------------------------------------|------|--------------------------------------|
| the process out of file descriptors (EMFILE,      | 1    | one line: the limit, how many are    |
| wherever it happens: a checkpoint, TensorBoard,   |      | held, the fix, and where it happened |
| a DataLoader worker)                              |      |                                      |
| ``UserError``: bad input (config, task.target     | 2    | one line                             |
| that does not exist, task.params, batch size)     |      |                                      |
| DDP: parameters that got no gradient in a step    | 2    | one line naming                      |
| (``dist.find_unused_parameters`` is false)        |      | dist.find_unused_parameters          |
| ``RunFailed``: a full disk, a diverged loss       | 1    | one line                             |
| anything raised in the task's module (importing   | 1    | one line naming task.target and      |
| it, ``__init__``, ``build_model``, ``loss``, ...) |      | where, then the task's traceback     |
| or in a script of the user's own (``--script``)   |      | (the script's: naming the script)    |
| anything else (a clusterflow defect)              | 1    | the traceback, as Python prints it   |

``submit --local`` and ``run`` give the same exit status for the same failure: the job records it
in ``status.json`` (``exit_code``) and ``submit`` exits with it.
"""

from __future__ import annotations

import errno
import os
import re
import resource
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
    """The frame of ``exc``'s traceback to name: in the task's module, its outermost (the Task
    method clusterflow called: ``build_model``, ``loss``, ...); in ``script`` (a script of the
    user's own), its innermost (the script's line that raised, or that called what raised); else
    None."""
    path = os.path.realpath(script) if script else _task_file(target)
    if path is None:
        return None
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if os.path.realpath(f.filename) == path
    ]
    if not frames:
        return None
    return frames[-1] if script else frames[0]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _out_of_descriptors(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that says the process has no file descriptor left: an
    OSError with errno EMFILE, or one whose message names it (a DataLoader worker's error is
    rebuilt in the main process from its text, without the errno; a failed checkpoint write
    keeps its cause's text)."""
    named = f"[Errno {errno.EMFILE}]"
    seen: set[int] = set()
    here: BaseException | None = exc
    while here is not None and id(here) not in seen:
        seen.add(id(here))
        if (isinstance(here, OSError) and here.errno == errno.EMFILE) or named in str(here):
            return here
        here = here.__cause__ or here.__context__
    return None


def _descriptors_sentence(exc: BaseException) -> str:
    """One line for a process out of file descriptors: what it holds, its limit, the fix, and
    the error where it ran out (which blames whatever file it was opening then)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        held = f"{len(os.listdir('/proc/self/fd'))} open files"
    except OSError:  # no descriptor left to list them with, or no /proc
        held = "all it may"
    lines = str(exc).strip().splitlines()
    where = " ".join(lines[-1].split()) if lines else ""
    if not where.startswith(f"{type(exc).__name__}:"):  # a worker's rebuilt error names it
        where = f"{type(exc).__name__}: {where}"
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return (
        f"too many open files (EMFILE): the process holds {held}, its limit (ulimit -n) is "
        f"{soft}, the hard limit {hard_text}; raise it where the job starts (ulimit -n in the "
        "batch script or the shell, up to the hard limit), or have fewer files open at once "
        "(fewer data.num_workers; a task's own open files); it ran out at: "
        f"{where}"
    )


# DDP's words when a step leaves some parameter without a gradient and DDP does not look for
# such parameters (dist.find_unused_parameters: false, the default).
_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"


def _unused_parameters(exc: BaseException) -> str | None:
    """One line for a model whose loss leaves parameters without a gradient under DDP: DDP's own
    message names its constructor's argument, not the key that sets it."""
    if not (isinstance(exc, RuntimeError) and _DDP_UNUSED in str(exc)):
        return None
    which = re.search(
        r"Parameter indices which did not receive grad for (rank \d+): ([\d ]+)", str(exc)
    )
    seen = (
        f" (DDP's parameter indices on {which.group(1)}: {which.group(2).strip()})" if which else ""
    )
    return (
        f"the model has parameters that got no gradient in a step{seen}: DDP needs "
        "dist.find_unused_parameters=true for such a model (it then looks for them at every "
        "step), or leave them out of the model, or freeze them (requires_grad=False)"
    )


def describe(exc: BaseException, target: str, script: str | None = None) -> Failure:
    """How the job reports ``exc``, raised while running the task ``target`` (``module:Class``) or,
    with ``script``, that script (the file it runs from)."""
    emfile = _out_of_descriptors(exc)
    if emfile is not None:
        return Failure(_descriptors_sentence(emfile), "", EXIT_JOB_FAILED, True)
    if isinstance(exc, UserError):
        return Failure(str(exc), "", EXIT_BAD_INPUT, True)
    unused = _unused_parameters(exc)
    if unused is not None:
        return Failure(unused, "", EXIT_BAD_INPUT, True)
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
