"""A warm standby for restarts inside the allocation: processes that have imported what a rank
needs, waiting to become the next step's ranks.

Most of a cold restart is new processes importing torch (8-12 s on the loaded test machine, 2.3 s
idle) and the old step's ranks exiting (2.5-3 s): docs/restarts.md. The batch step's driver
(``job/restarts.py``) therefore starts, once the training step trains, one more srun step with
``--overlap`` on every usable node of the allocation, ``tasks_per_node`` processes each, that run
``python -m clusterflow.job.warm`` (``job/warm.py``): each imports torch, clusterflow's job, the
task's module and ``torch._dynamo``, connects to the driver over TCP and waits. At a restart the
driver hands the processes on the next step's nodes the rank each becomes, as variables (Slurm's
for a step on those nodes, :func:`clusterflow.slurm.steps.task_environment`, which ``DistEnv``
reads, and the driver's own per step) and the output files srun would have opened for that rank;
each then runs the step's own entry (``python -m clusterflow.run`` or submitit's) in-process, so no
code path of a rank changes. The others leave, and the standby step is the training step from
then on: srun's reports name its task ids, which :meth:`Standby.become` maps to ranks.

Protocol: JSON lines. A process sends ``{"token", "node", "local", "task", "step", "pid"}`` once
its imports are done; the driver sends ``{"do": "ping"}`` (answered ``{"pong": pid}``),
``{"do": "become", "env", "unset", "stdout", "stderr", "append"}`` (answered ``{"ack": pid}``) or
``{"do": "exit"}``. The token (in the processes' environment, which other users cannot read)
keeps strangers on the network out.

Anything short of every needed process answering at once (a process that died, hangs or is still
importing; the step gone) makes :meth:`Standby.check` say why, and the driver restarts cold, as
without a standby, with that reason in its one line about the restart. Login-node light: no
torch here (the driver runs on the batch node).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from clusterflow.distributed.env import address_toward
from clusterflow.slurm import steps

# The step entries a standby process can become, and what it imports ahead for each (the entry
# module itself runs fresh, as ``python -m`` runs it).
ENTRIES = {
    "clusterflow.run": "clusterflow.job.run",
    "submitit.core._submit": "submitit.core.submission",
}
TOKEN_ENV = "CLUSTERFLOW_STANDBY_TOKEN"
# Before each line srun writes for the standby step while it is one: its reports must not read as
# the training step's in the batch output (slurm/steps.py's first_failure).
PREFIX = "clusterflow: warm standby: "
# How long a process has to answer the driver at a restart: it waits on its socket and answers
# at once, so a process that does not is hung (or stopped).
ANSWER_S = 3.0


@dataclass(frozen=True)
class Program:
    """An srun line ``srun FLAGS PYTHON [PYFLAGS] -m MODULE ARGS`` taken apart."""

    srun: str
    flags: tuple[str, ...]  # srun's own, without those that name the tasks' output files
    files: Mapping[str, str]  # srun's --output/--error patterns ("output", "error")
    python: tuple[str, ...]  # the interpreter and its flags
    module: str
    args: tuple[str, ...]

    @property
    def append(self) -> bool:
        """Whether srun opens the tasks' output files to append (``--open-mode=append``, or the
        job's ``SLURM_OPEN_MODE``, as sbatch --open-mode sets it), else it truncates them."""
        flags = " ".join(self.flags)
        m = re.search(r"--open-mode[= ](\S+)", flags)
        mode = m.group(1) if m else os.environ.get("SLURM_OPEN_MODE", "")
        return mode.startswith("a")


def program(command: Sequence[str]) -> Program | str:
    """The step's srun line taken apart, or why a standby cannot run it: its program must be
    ``PYTHON [-FLAGS] -m ENTRY`` with one of :data:`ENTRIES`, and its output file names ones this
    module can expand for a rank."""
    words = list(command)
    at = next(
        (i for i in range(1, len(words) - 1) if words[i] == "-m" and words[i + 1] in ENTRIES),
        None,
    )
    if at is None:
        return f"the step's program is not python -m {' or '.join(ENTRIES)}"
    start = at
    while start > 1 and re.fullmatch(r"-[A-Za-z]+", words[start - 1]):
        start -= 1
    if start < 2:
        return "the step's srun line names no python before -m"
    flags, files = steps.output_flags(words[1 : start - 1])
    sample = {k: "1" for k in "AajJsNntux"}
    for pattern in files.values():
        if steps.expand_pattern(pattern, sample) is None:
            return f"srun's output file pattern {pattern!r} has a part this driver cannot expand"
    return Program(
        words[0],
        tuple(flags),
        files,
        tuple(words[start - 1 : at]),
        words[at + 1],
        tuple(words[at + 2 :]),
    )


@dataclass
class _Process:
    """One standby process, as it introduced itself."""

    conn: socket.socket
    reader: TextIO  # the connection's lines
    node: str
    local: int
    task: int
    step: str
    pid: int

    def send(self, message: Mapping[str, object]) -> None:
        self.conn.sendall((json.dumps(message) + "\n").encode())

    def answer(self) -> dict[str, Any] | None:
        """The process's answer, ``{}`` when none came within ANSWER_S, None when its
        connection ended (the process did)."""
        self.conn.settimeout(ANSWER_S)
        try:
            line = self.reader.readline()
            if not line:
                return None
            said = json.loads(line)
        except (OSError, ValueError):
            return {}
        return said if isinstance(said, dict) else {}


class Standby:
    """One standby step and its processes, from their start until they became a training step
    (:meth:`become`) or were sent away (:meth:`close`)."""

    def __init__(
        self,
        prog: Program,
        nodes: Sequence[str],
        per_node: int,
        environ: Mapping[str, str],
        *,
        preload: str,
        run_dir: str,
        say: Callable[[str], None],
    ) -> None:
        self.prog, self.nodes, self.per_node = prog, tuple(nodes), per_node
        self.environ, self.say = dict(environ), say
        self.token = secrets.token_hex(16)
        self.server = socket.create_server(("", 0), backlog=max(64, len(nodes) * per_node))
        self.server.settimeout(1.0)  # before the accepting thread starts: close may come first
        here = environ.get("SLURMD_NODENAME") or socket.gethostname()
        toward = next((n for n in nodes if n != here), nodes[0])
        address = f"{address_toward(toward)}:{self.server.getsockname()[1]}"
        self.procs: dict[tuple[str, int], _Process] = {}
        self._lock = threading.Lock()
        self.ready_at: float | None = None
        self.started_at = time.time()
        warm = [
            "-m",
            "clusterflow.job.warm",
            "--driver",
            address,
            *(["--preload", preload] if preload else []),
            "--run-dir",
            run_dir,
            "--",
            "-m",
            prog.module,
            *prog.args,
        ]
        flags = steps.driver_ends_it(prog.flags)
        line = [prog.srun, "--overlap", *flags, *prog.python, *warm]
        self.step = steps.Step(
            steps.srun_argv(line, nodes, per_node),
            {**environ, TOKEN_ENV: self.token},
            prefix=PREFIX,
        )
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def expected(self) -> int:
        return len(self.nodes) * self.per_node

    def ready(self) -> bool:
        return self.ready_at is not None and self.step.alive()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                if not self.step.alive():
                    return
                continue
            except OSError:  # closed
                return
            proc = self._hello(conn)
            if proc is None:
                continue
            with self._lock:
                self.procs[(proc.node, proc.local)] = proc
                if len(self.procs) == self.expected and self.ready_at is None:
                    self.ready_at = time.time()
                    pids = {
                        n: ", ".join(str(self.procs[(n, i)].pid) for i in range(self.per_node))
                        for n in self.nodes
                    }
                    where = ", ".join(f"{n} (pid {pid})" for n, pid in pids.items())
                    self.say(
                        f"warm standby ready: {self.expected} process(es) on {where}, "
                        f"{self.ready_at - self.started_at:.1f} s after its start (srun step "
                        f"{proc.step})"
                    )

    def _hello(self, conn: socket.socket) -> _Process | None:
        conn.settimeout(10.0)
        reader = conn.makefile("r", encoding="utf-8")
        try:
            hello = json.loads(reader.readline() or "{}")
            if not secrets.compare_digest(str(hello.get("token", "")), self.token):
                raise ValueError("wrong token")
            return _Process(
                conn,
                reader,
                str(hello["node"]),
                int(hello["local"]),
                int(hello["task"]),
                str(hello["step"]),
                int(hello["pid"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return None

    def check(self, nodes: Sequence[str]) -> str | None:
        """Why the processes on ``nodes`` cannot become the next step's ranks now, or None: the
        standby's step ended, a process has not finished importing, or one does not answer."""
        if not self.step.alive():
            return f"its srun step ended (exit status {self.step.proc.returncode})"
        with self._lock:
            procs = dict(self.procs)
        for node in nodes:
            for local in range(self.per_node):
                p = procs.get((node, local))
                if p is None:
                    return (
                        f"its process {local} on {node} is not ready ({len(procs)} of "
                        f"{self.expected} had imported, {time.time() - self.started_at:.0f} s "
                        "after its start)"
                    )
                with contextlib.suppress(OSError):
                    p.send({"do": "ping"})
                said = p.answer()
                if said is None:
                    return f"its process {local} on {node} (pid {p.pid}) ended"
                if "pong" not in said:
                    return (
                        f"its process {local} on {node} (pid {p.pid}) did not answer within "
                        f"{ANSWER_S:.0f} s (hung or stopped)"
                    )
        return None

    def become(
        self,
        nodes: Sequence[str],
        env: Mapping[str, str],
        on_failure: Callable[[steps.Step, tuple[int, str, str]], None] | None = None,
    ) -> steps.Step | str:
        """The standby's processes on ``nodes`` (:meth:`check` them first) become the next
        step's ranks, with the variables ``env`` besides Slurm's for their place in the step, and
        the others leave; returns the standby's step, now the training step (``on_failure``: as
        :class:`~clusterflow.slurm.steps.Step` takes it). Or why not, as a phrase."""
        with self._lock:
            procs = dict(self.procs)
        needed = [(n, i) for n in nodes for i in range(self.per_node)]
        if any(k not in procs for k in needed):
            return "a process it needs is gone"
        tasks = {}
        for rank, key in enumerate(needed):
            p = procs[key]
            tasks[p.task] = rank
            values = self._pattern_values(p, nodes, rank)
            files = {k: steps.expand_pattern(v, values) for k, v in self.prog.files.items()}
            message = {
                "do": "become",
                "env": {**env, **steps.task_environment(nodes, self.per_node, rank)},
                "unset": [TOKEN_ENV],
                "stdout": files.get("output"),
                "stderr": files.get("error"),
                "append": self.prog.append,
            }
            try:
                p.send(message)
            except OSError as exc:
                return f"its process {key[1]} on {key[0]} could not be reached ({exc})"
        for rank, key in enumerate(needed):
            said = procs[key].answer() or {}
            if "ack" not in said:
                why = said.get("refused", "no answer")
                return f"its process {key[1]} on {key[0]} did not take rank {rank} ({why})"
        for key, p in procs.items():
            if key not in needed:
                with contextlib.suppress(OSError):
                    p.send({"do": "exit"})
        self.step.became(nodes, tasks, on_failure)
        self._forget()
        return self.step

    def _pattern_values(self, p: _Process, nodes: Sequence[str], rank: int) -> dict[str, str | int]:
        job = self.environ.get("SLURM_JOB_ID", "")
        values: dict[str, str | int] = {
            "j": job,
            "s": p.step,
            "J": f"{job}.{p.step}",
            "t": rank,
            "n": rank // self.per_node,
            "N": nodes[rank // self.per_node],
            "u": self.environ.get("SLURM_JOB_USER") or getpass.getuser(),
            "x": self.environ.get("SLURM_JOB_NAME", ""),
        }
        for key, name in (("A", "SLURM_ARRAY_JOB_ID"), ("a", "SLURM_ARRAY_TASK_ID")):
            if name in self.environ:
                values[key] = self.environ[name]
        return values

    def _forget(self) -> None:
        """Close the driver's side: the server and every connection (a process that became a rank
        closed its own already; one that was sent away leaves)."""
        with contextlib.suppress(OSError):
            self.server.close()
        with self._lock:
            for p in self.procs.values():
                with contextlib.suppress(OSError):
                    p.conn.close()
            self.procs.clear()

    def close(self, wait_s: float = 10.0) -> None:
        """Send every process away and end the step (with SIGKILL to every task where they have
        not left within ``wait_s``; 0: at once, not waiting for srun's end): the standby never
        outlives the job's training. A process still importing (it has not said hello) cannot be
        sent away and holds nothing: the step is then ended at once, so that a job whose training
        ends while its standby imports does not wait for those imports (seconds at every end of a
        short job)."""
        with self._lock:
            procs = list(self.procs.values())
        for p in procs:
            with contextlib.suppress(OSError):
                p.send({"do": "exit"})
        self._forget()
        importing = len(procs) < self.expected
        if importing or self.step.wait(wait_s) is None:
            self.step.kill()
            self.step.wait(wait_s)
