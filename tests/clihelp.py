"""Call a CLI ``main`` in this process as ``python -m`` would run it, to feed it thousands of inputs
without a process start each (tests/test_fuzz_cli.py checks that this matches real processes)."""

import contextlib
import io
import traceback


def call(main, argv):
    """(exit status, stdout, stderr) of ``sys.exit(main(argv))``: an uncaught exception prints its
    traceback and exits 1, a SystemExit with a message prints it and exits 1, as Python does."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
            if code is not None and not isinstance(code, int):
                print(code, file=err)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter would do with it
            traceback.print_exc(file=err)
            code = 1
    return (0 if code is None else code), out.getvalue(), err.getvalue()


def one_error_line(stderr):
    """The single ``error: ...`` line of a refusal; fails when there is none or more than one."""
    lines = [
        line for line in stderr.splitlines() if line.startswith("error: ") or ": error: " in line
    ]
    assert len(lines) == 1, stderr
    return lines[0]
