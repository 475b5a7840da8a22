"""User-facing errors: one exception type, one way to print it.

Anything a user can get wrong (a YAML typo, an impossible resource request, a bad
environment) raises :class:`UserError`. The command-line entry points catch it, print
the message and exit with status 2, so a tired researcher sees a sentence, not a traceback.
A job that fails while running exits 1 (see ``job/failure.py`` for what it prints). A command
whose reader goes away early (``python -m clusterflow.status RUN_DIR | head -1``) stops quietly.
"""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
# 128 + SIGPIPE: what a shell reports for any writer whose reader went away (``yes | head -1``).
# Not 0: the command stopped before it finished (a `run` or `submit --wait` cut short that way
# has not succeeded), and `set -o pipefail` scripts treat it as they treat coreutils.
EXIT_BROKEN_PIPE = 141
# 128 + SIGINT and 128 + SIGTERM: `submit --local` (and `run`) stopped by Ctrl-C or by SIGTERM,
# after saving a checkpoint at the step reached; running the same command again resumes.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
# A rank the stall watchdog ended: distinct from 1 and 2, so `sacct` shows ExitCode 86:0.
EXIT_STALLED = 86
# Saved and stopped to be requeued, but this job could not run `scontrol requeue` itself (a
# container without Slurm's commands): the batch script outside requeues it on this status
# (slurm_templates/*.sbatch do). 75 is EX_TEMPFAIL: "try again later".
EXIT_REQUEUE_OUTSIDE = 75


class UserError(Exception):
    """A mistake in input the user controls. The message names the cause, the value and the fix."""


class RunFailed(Exception):
    """The run cannot go on, for a reason its message states in full (the loss diverged, a full
    disk): the job records the message, prints it without a traceback (which would add nothing)
    and exits 1."""


class TaskError(Exception):
    """The user's task code raised while clusterflow imported or constructed it; the original is
    ``__cause__`` and the message names task.target (``job/failure.py`` prints its traceback)."""


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (poll reports an error on
    it), so that a BrokenPipeError from another pipe, a child's stdin say, is not hidden."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is no file
        return False


def _stdout_to_devnull() -> None:
    """Point the stdout file descriptor at /dev/null: what is still buffered, and Python's own
    flush at exit, then go nowhere instead of raising BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _flush_stdout() -> bool:
    """Flush stdout now, inside the wrapper, so that a reader gone early is seen here rather than
    at interpreter exit (after ``sys.exit(main())``, where nothing could catch it). False when
    that reader is gone."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
        return True
    except BrokenPipeError:
        _stdout_to_devnull()
        return False


def cli(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI ``main`` so that a :class:`UserError` becomes one line on stderr and exit 2, and
    a closed stdout (``| head -1``) ends the command quietly with :data:`EXIT_BROKEN_PIPE`."""

    def wrapped(argv: list[str] | None = None) -> int:
        try:
            code = main(argv)
        except BrokenPipeError:
            if not _stdout_reader_gone():
                _flush_stdout()
                raise
            _stdout_to_devnull()
            return EXIT_BROKEN_PIPE
        except UserError as exc:
            _flush_stdout()
            fail(str(exc))
        except KeyboardInterrupt:
            _flush_stdout()
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BaseException:  # argparse's --help and its errors; a crash, whose traceback stays
            _flush_stdout()
            raise
        return code if _flush_stdout() else EXIT_BROKEN_PIPE

    wrapped.__doc__ = main.__doc__
    return wrapped
