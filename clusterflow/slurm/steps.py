"""srun steps inside an allocation: the node flags of a step that runs on part of the job's
nodes, and one step run to its end with srun's own report of the task that failed first.

The batch step's driver (``clusterflow/job/restarts.py``) starts every training step through
:func:`run_step`, so that after a failure it can start another in the same allocation, on the
healthy nodes. Login-node light: no torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
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

    @property
    def exit_status(self) -> int:
        """What the batch step exits with after this step: the exit code srun reported for the
        task that failed first (bad input's 2 stays 2, although srun itself returns 128+15 when
        it ended a peer with SIGTERM), else srun's own status (a task ended by a signal)."""
        what = self.first_failure[2] if self.first_failure else ""
        code = re.fullmatch(r"Exited with exit code (\d+)", what)
        return int(code.group(1)) if code and self.returncode != 0 else self.returncode


def run_step(argv: Sequence[str], env: Mapping[str, str]) -> StepEnd:
    """Run one srun step to its end. srun's own stderr is passed on line by line (to the batch
    output, where it went before) and read for the first task it reports as failed."""
    started = time.time()
    nodes = next((a.split("=", 1)[1] for a in argv if a.startswith("--nodelist=")), "?")
    sys.stderr.write(f"{STEP_MARK}{nodes} at {time.strftime('%H:%M:%S')}\n")
    sys.stderr.flush()
    proc = subprocess.Popen(
        list(argv), env=dict(env), stderr=subprocess.PIPE, text=True, errors="replace"
    )
    seen: list[tuple[tuple[int, str, str], float]] = []

    def forward() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if not seen:
                failed = outcome.first_task_failure(line)
                if failed is not None:
                    seen.append((failed, time.time()))

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    while True:
        try:
            code = proc.wait()
            break
        except InterruptedError:  # a signal the driver handles: keep waiting for the step
            continue
    reader.join(timeout=5)
    first, at = seen[0] if seen else (None, None)
    return StepEnd(code, first, at, started, time.time())


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
