"""User-facing errors: one exception type, one way to print it.

Anything a user can get wrong (a YAML typo, an impossible resource request, a bad
environment) raises :class:`UserError`. The command-line entry points catch it, print
the message and exit with status 2, so a tired researcher sees a sentence, not a traceback.
A job that fails while running exits 1 (see ``failure.py`` for what it prints).
"""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2


class UserError(Exception):
    """A mistake in input the user controls. The message names the cause, the value and the fix."""


class RunFailed(Exception):
    """The run cannot go on, for a reason its message states in full (the loss diverged, a full
    disk): the job records the message, prints it without a traceback (which would add nothing)
    and exits 1."""


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def cli(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap a CLI ``main`` so that a :class:`UserError` becomes one line on stderr and exit 2."""

    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UserError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    wrapped.__doc__ = main.__doc__
    return wrapped
