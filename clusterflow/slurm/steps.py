"""srun steps inside an allocation: the node flags of a step that runs on part of the job's
nodes, and one step run to its end with srun's own report of the task that failed first.

The batch step's driver (``clusterflow/job/restarts.py``) starts every training step through
:func:`run_step`, so that after a failure it can start another in the same allocation, on the
healthy nodes. Login-node light: no torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from clusterflow.distributed.env import parse_nodelist
from clusterflow.slurm import outcome

# The line :func:`run_step` writes before each step, so that a reader of the batch output can
# tell one step's srun messages from an earlier one's (:func:`last_step`).
STEP_MARK = "clusterflow: srun step on "


def last_step(text: str) -> str:
    """The part of a batch output that the newest srun step wrote (all of it without marks)."""
    at = text.rfind(STEP_MARK)
    return text if at < 0 else text[at:]


def allocation(environ: Mapping[str, str]) -> list[str]:
    """The job's nodes (SLURM_JOB_NODELIST), [] outside a job."""
    text = environ.get("SLURM_JOB_NODELIST", "")
    return parse_nodelist(text) if text else []


def tasks_per_node(environ: Mapping[str, str], default: int) -> int:
    """The tasks per node the job was given (``--ntasks-per-node``), else ``default``."""
    value = environ.get("SLURM_NTASKS_PER_NODE", "")
    return int(value) if value.isdigit() else default


def srun_argv(command: Sequence[str], nodes: Sequence[str], per_node: int) -> list[str]:
    """``command`` (an ``srun ...`` line) run on exactly ``nodes`` with ``per_node`` tasks each:
    ``--nodes``, ``--ntasks`` and ``--nodelist`` go right after ``srun``."""
    if not command or os.path.basename(command[0]) != "srun":
        # a programming error: the batch script hands over an srun line
        raise ValueError(f"expected an srun command line, got {list(command)[:3]}")
    flags = [
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes) * per_node}",
        f"--ntasks-per-node={per_node}",
        f"--nodelist={','.join(nodes)}",
    ]
    return [command[0], *flags, *command[1:]]


@dataclass(frozen=True)
class StepEnd:
    returncode: int
    # (rank, node, what) of the task srun reported as failed first, and when it said so
    first_failure: tuple[int, str, str] | None = None
    failed_at: float | None = None
    started_at: float = 0.0
    ended_at: float = 0.0
    # The driver ended every task at once with SIGKILL after that report (:meth:`Step.kill`):
    # no task wrote anything after it.
    killed: bool = False

    @property
    def exit_status(self) -> int:
        """What the batch step exits with after this step: the exit code srun reported for the
        task that failed first (bad input's 2 stays 2, although srun itself returns 128+15 when
        it ended a peer with SIGTERM), else srun's own status (a task ended by a signal)."""
        what = self.first_failure[2] if self.first_failure else ""
        code = re.fullmatch(r"Exited with exit code (\d+)", what)
        return int(code.group(1)) if code and self.returncode != 0 else self.returncode


def signalled(what: str) -> bool:
    """Whether srun's report of a failed task says a signal ended it (not an exit code)."""
    return not what.startswith("Exited with exit code")


# srun's flag that ends a step once one task fails, and its forms (``-K``, ``-K1``, ``=1``).
_KILL_ON_BAD_EXIT = re.compile(r"--kill-on-bad-exit(=\S*)?|-K\d?")
# What a step runs with when its driver ends it itself (Step.kill): srun's own ending of a step
# after a failed task SIGTERMs the others and waits up to KillWait (seconds of exits), and while
# it does, srun and scancel refuse a SIGKILL ("Kill job error"; measured on the test cluster).
DRIVER_ENDS_IT = "--kill-on-bad-exit=0"


def driver_ends_it(flags: Sequence[str]) -> list[str]:
    """srun ``flags`` with srun's own --kill-on-bad-exit turned off (also against a cluster's
    KillOnBadExit), for a step whose driver ends it on the first failed task itself."""
    return [DRIVER_ENDS_IT, *(f for f in flags if not _KILL_ON_BAD_EXIT.fullmatch(f))]


class Step:
    """One srun step, running. srun's own stderr is passed on line by line (to the batch output)
    and read for the first task it reports as failed; ``on_failure`` is called with that report
    (in the reading thread, as soon as srun says it).

    ``prefix`` goes before each line passed on while the step is not (yet) a training step: a
    warm standby's (``job/standby.py``), whose srun reports must not read as the training step's
    in the batch output. Once it becomes one, :meth:`became` names which of its tasks are which
    ranks, and its reports are read in ranks from then on."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        on_failure: Callable[[Step, tuple[int, str, str]], None] | None = None,
        prefix: str = "",
    ) -> None:
        self.started_at = time.time()
        self.on_failure, self.prefix = on_failure, prefix
        self.ranks: dict[int, int] | None = None  # srun's task id -> rank, where they differ
        self.killed = False
        self._first: tuple[tuple[int, str, str], float] | None = None
        self._lock = threading.Lock()
        if not prefix:
            _mark(_nodes_of(argv))
        self.proc = subprocess.Popen(
            list(argv), env=dict(env), stderr=subprocess.PIPE, text=True, errors="replace"
        )
        self._reader = threading.Thread(target=self._forward, daemon=True)
        self._reader.start()

    def became(
        self,
        nodes: Sequence[str],
        ranks: Mapping[int, int],
        on_failure: Callable[[Step, tuple[int, str, str]], None] | None = None,
    ) -> None:
        """From now on a training step on ``nodes``, whose srun task ``t`` is rank
        ``ranks[t]``; the other tasks are not ranks (their reports are passed on, never read as
        a rank's failure). ``on_failure``: as the constructor takes it."""
        with self._lock:
            self.on_failure = on_failure
            self.ranks = dict(ranks)
            self.prefix = ""
            self.started_at = time.time()
            pairs = sorted(ranks.items(), key=lambda tr: tr[1])
            _mark(
                ",".join(nodes),
                TASKS_MARK.format(
                    tasks=",".join(str(t) for t, _ in pairs),
                    ranks=",".join(str(r) for _, r in pairs),
                ),
            )

    def _forward(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                sys.stderr.write(self.prefix + line)
                sys.stderr.flush()
                if self.prefix or self._first is not None:
                    continue
                failed = outcome.first_task_failure(line)
                if failed is not None and self.ranks is not None:
                    rank = self.ranks.get(failed[0])
                    failed = None if rank is None else (rank, failed[1], failed[2])
                if failed is None:
                    continue
                self._first = (failed, time.time())
            if self.on_failure is not None:
                self.on_failure(self, failed)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """End every task of the step at once: srun, sent SIGTERM, sends them SIGKILL ("forcing
        job termination") and returns once they ended (0.03 s on the test cluster, against 3 s
        for srun's own --kill-on-bad-exit: :data:`DRIVER_ENDS_IT`). Tasks write nothing after
        it (a checkpoint store keeps what it had committed)."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()

    def wait(self, timeout: float | None = None) -> StepEnd | None:
        """The step's end, once srun returned (None while it runs after ``timeout`` seconds)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=5)
        first, at = self._first if self._first else (None, None)
        return StepEnd(code, first, at, self.started_at, time.time(), self.killed)


def run_step(argv: Sequence[str], env: Mapping[str, str]) -> StepEnd:
    """Run one srun step to its end (:class:`Step`)."""
    step = Step(argv, env)
    while True:
        end = step.wait()
        if end is not None:
            return end


def _nodes_of(argv: Sequence[str]) -> str:
    return next((a.split("=", 1)[1] for a in argv if a.startswith("--nodelist=")), "?")


def _mark(nodes: str, more: str = "") -> None:
    sys.stderr.write(f"{STEP_MARK}{nodes} at {time.strftime('%H:%M:%S')}{more}\n")
    sys.stderr.flush()


# After STEP_MARK, for a step whose srun task ids are not its ranks (a warm standby's step, which
# runs on every node of the allocation, became the training step on some of them).
TASKS_MARK = " (srun's tasks {tasks} are ranks {ranks})"
_TASKS = re.compile(
    r"^" + re.escape(STEP_MARK) + r".*\(srun's tasks ([\d,]+) are ranks ([\d,]+)\)$", re.MULTILINE
)


def first_failure(text: str) -> tuple[int, str, str] | None:
    """(rank, node, what) of the task srun reported as failed first in the newest step of a batch
    output (:func:`last_step`), its srun task id read as a rank where the step's mark maps
    them."""
    last = last_step(text)
    failed = outcome.first_task_failure(last)
    m = _TASKS.search(last)
    if failed is None or m is None:
        return failed
    ranks = dict(
        zip((int(t) for t in m.group(1).split(",")), (int(r) for r in m.group(2).split(",")))
    )
    rank = ranks.get(failed[0])
    return None if rank is None else (rank, failed[1], failed[2])


# -- a step that runs the same program as another -----------------------------------------------

# srun's flags that name where the tasks' output goes, with a value (``--output=X``, ``-o X``).
_OUTPUT_FLAGS = {"--output": "output", "-o": "output", "--error": "error", "-e": "error"}


def output_flags(flags: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """srun ``flags`` without those naming the tasks' output files, and those files' patterns
    (``output``, ``error``; srun's stderr follows ``output`` when ``error`` is not given)."""
    rest: list[str] = []
    files: dict[str, str] = {}
    words = iter(flags)
    for word in words:
        name, eq, value = word.partition("=")
        if name in _OUTPUT_FLAGS and name.startswith("--") and eq:
            files[_OUTPUT_FLAGS[name]] = value
        elif word in _OUTPUT_FLAGS:
            files[_OUTPUT_FLAGS[word]] = next(words, "")
        elif word[:2] in ("-o", "-e") and len(word) > 2 and not word.startswith("--"):
            files[_OUTPUT_FLAGS[word[:2]]] = word[2:]
        else:
            rest.append(word)
    if "output" in files and "error" not in files:
        files["error"] = files["output"]
    return rest, files


_PATTERN = re.compile(r"%(\d*)(.?)")


def expand_pattern(pattern: str, values: Mapping[str, str | int]) -> str | None:
    """A file name pattern of srun's ``--output`` for one task: ``%j`` the job id, ``%t`` the
    task's rank, ``%n`` its node's index in the step, ``%N`` its node, ``%s`` the step id,
    ``%J`` job.step, ``%u`` the user, ``%x`` the job's name, ``%A``/``%a`` the array job and
    task, ``%%``; a number after ``%`` pads with zeros (``%3t``). None when the pattern holds
    anything else (a backslash, which turns srun's expansion off) or ``values`` lacks one."""
    if "\\" in pattern:
        return None
    out, at = [], 0
    for m in _PATTERN.finditer(pattern):
        width, key = m.group(1), m.group(2)
        if key != "%" and key not in values:
            return None
        text = "%" if key == "%" else str(values[key])
        out += [pattern[at : m.start()], text.zfill(int(width)) if width else text]
        at = m.end()
    return "".join(out) + pattern[at:]


def task_environment(nodes: Sequence[str], per_node: int, rank: int) -> dict[str, str]:
    """What srun sets for task ``rank`` of a step of ``per_node`` tasks on each of ``nodes``,
    of the variables that differ between steps of one job on the same node (besides the step's
    own id, srun's ports and the task's pid): the task's place, the step's nodes (a list Slurm
    would write ``node[1,3]``) and counts. ``SLURM_NODELIST`` stays the job's."""
    world, node = len(nodes) * per_node, rank // per_node
    counts = f"{per_node}(x{len(nodes)})" if len(nodes) > 1 else str(per_node)
    names = ",".join(nodes)
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(world),
        "SLURM_NPROCS": str(world),
        "SLURM_NNODES": str(len(nodes)),
        "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_STEP_NODELIST": names,
        "SLURM_TASKS_PER_NODE": counts,
        "SLURM_STEP_TASKS_PER_NODE": counts,
        "SLURM_GTIDS": ",".join(str(node * per_node + i) for i in range(per_node)),
    }


def run_on(nodes: Sequence[str], argv: Sequence[str], env: Mapping[str, str], srun: str) -> int:
    """Run ``argv`` once on each of ``nodes`` of the allocation, beside any step that runs there
    (``--overlap``), and wait for it (a minute at most); srun's exit status, or 124."""
    line = [
        srun,
        "--overlap",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        *argv,
    ]
    try:
        return subprocess.run(line, env=dict(env), check=False, timeout=60).returncode
    except subprocess.TimeoutExpired:
        return 124


def check_on(
    nodes: Sequence[str],
    argv: Sequence[str],
    env: Mapping[str, str],
    srun: str,
    timeout_s: float,
) -> tuple[str, bool]:
    """Run ``argv`` once on each of ``nodes`` beside any step there (``--overlap``), for at most
    ``timeout_s`` (a hung node must not hold a restart): what the tasks printed, and whether the
    step ended in time. The step runs without srun's --kill-on-bad-exit, so one node's failure
    leaves the others' answers."""
    line = [
        srun,
        "--overlap",
        "--kill-on-bad-exit=0",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        *argv,
    ]
    try:
        out = subprocess.run(
            line, env=dict(env), check=False, timeout=timeout_s, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return text, False
    except OSError as exc:
        return f"srun could not start: {exc}", True
    return out.stdout, True
