"""The fork server of tests/launch.py: a process that has imported torch and nothing of the
project, and forks each rank from there instead of starting a fresh interpreter that imports torch
again (seconds of CPU a rank on a busy machine).

Run as ``python rankserver.py FD``: FD is one end of a SOCK_SEQPACKET socket pair. Each message
on it is one rank to start: JSON ``{"argv", "env", "cwd"}`` (``argv`` as after the interpreter:
``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``) with two file descriptors attached: a SOCK_SEQPACKET
socket on which this server answers the rank's pid, then its exit status once it has ended (as
``subprocess.Popen.returncode`` reads: ``-N`` for signal N), and the file the rank's stdout and
stderr go to. The server ends when the other end of FD closes (its test process has ended).

The server stays single-threaded and runs nothing of torch's but its import, so that no thread
pool or lock of torch's can be caught mid-use by a fork; it sets no signal handler or mask, so a
rank inherits the dispositions a fresh interpreter started by the test process would have. Each
rank then gets, before it runs its module or script, what ``subprocess.Popen(argv, env=env,
cwd=cwd, start_new_session=True)`` would give it: a session and process group of its own, the
environment, the working directory, ``sys.argv``, ``sys.path`` (built from its own PYTHONPATH),
and an interpreter's exit (non-daemon threads joined, atexit run, stdio flushed; exit 1 with the
traceback on an exception, death by SIGINT on an uncaught KeyboardInterrupt).
"""

import atexit
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import types

# This file's folder, put first by the interpreter: a rank's sys.path is built from its own
# PYTHONPATH and module or script, before what the interpreter and site put after it.
del sys.path[0]
_BASE_PATH = list(sys.path)

import torch  # noqa: F401  the import every rank pays; paid here once, nothing run


def _exit_code(exc):
    """The interpreter's status for an uncaught SystemExit (printing a non-int code)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _rank(request, out_fd):
    """In the forked child: become the rank, run it, and leave as an interpreter leaves."""
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    module = argv[1] if argv[0] == "-m" else None
    first = os.getcwd() if module else os.path.dirname(os.path.realpath(argv[0]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    importlib.invalidate_caches()
    if "numpy.random" in sys.modules:  # seeded per process, as a fresh interpreter seeds it
        sys.modules["numpy.random"].seed()
    sys.orig_argv = [sys.executable, *argv]
    sys.modules["__main__"] = types.ModuleType("__main__")
    code, interrupted = 0, False
    try:
        if module:
            sys.argv = argv[1:]
            runpy._run_module_as_main(module)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001  printed and turned into a status, as Python does
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def main(fd):
    control = socket.socket(fileno=fd)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    running = {}  # pidfd: (pid, the socket its status goes to)
    while True:
        for key, _ in selector.select():
            if key.fileobj is not control:
                pid, status = running.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, wait_status = os.waitpid(pid, 0)
                status.send(str(os.waitstatus_to_exitcode(wait_status)).encode())
                status.close()
                continue
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
            if not message:
                return
            status = socket.socket(fileno=fds[0])
            pid = os.fork()
            if pid == 0:
                try:
                    selector.close()
                    control.close()
                    status.close()
                    for pidfd, (_, other) in running.items():
                        os.close(pidfd)
                        other.close()
                    _rank(json.loads(message), fds[1])
                finally:
                    os._exit(70)
            os.close(fds[1])
            status.send(str(pid).encode())
            pidfd = os.pidfd_open(pid)
            running[pidfd] = (pid, status)
            selector.register(pidfd, selectors.EVENT_READ)


if __name__ == "__main__":
    main(int(sys.argv[1]))
