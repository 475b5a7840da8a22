"""python -m clusterflow.logs RUN_DIR [-f] [--rank R]

Print one rank's log across every attempt of a run (``RUN_DIR/logs/rank<R>.attempt<A>.log``),
oldest first, each under a header naming the attempt, its job and hosts. With ``-f`` keep
following: new lines of the newest attempt, and each new attempt as it appears after a requeue,
until the run ends: its record says completed, failed, cancelled or stopped, or ``status``'s
verdict does (a job killed by SIGKILL writes no end; a cancelled job that still trains is
``running`` until it has stopped).
"""

from __future__ import annotations

import argparse
import codecs
import os
import re
import sys
import time
from collections.abc import Callable
from typing import IO

from clusterflow import rundir
from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.manage import status
from clusterflow.rundir import records, states
from clusterflow.storage import confined
from clusterflow.sweeps import index as sweep_index

EXAMPLES = (
    "examples:\n"
    "  python -m clusterflow.logs runs/exp1                # rank 0, every attempt\n"
    "  python -m clusterflow.logs runs/exp1 -f"
    "             # and follow, across requeues, until the run ends\n"
    "  python -m clusterflow.logs runs/exp1 --rank 3       # another rank\n"
)
_NAME = re.compile(r"^rank(\d+)\.attempt(\d+)\.log$")


def _names(paths: rundir.RunPaths) -> list[tuple[int, int]]:
    try:
        names = os.listdir(paths.logs)
    except OSError:  # missing, or a file where the folder should be
        return []
    return [(int(m.group(1)), int(m.group(2))) for m in map(_NAME.match, names) if m]


def attempts(paths: rundir.RunPaths, rank: int) -> list[int]:
    """The attempts that left a log for ``rank``, in order."""
    return sorted(a for r, a in _names(paths) if r == rank)


def ranks(paths: rundir.RunPaths) -> list[int]:
    return sorted({r for r, _ in _names(paths)})


def header(paths: rundir.RunPaths, rank: int, attempt: int) -> str:
    rec = next(
        (
            r
            for r in rundir.read_jsonl(paths.attempts, records.ATTEMPT)
            if r.get("attempt") == attempt
        ),
        {},
    )
    parts = [f"attempt {attempt}"]
    if rec.get("job_id"):
        parts.append(f"job {rec['job_id']}")
    if rec.get("started_at"):
        parts.append(
            "started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["started_at"]))
        )
    if rec.get("hosts"):
        parts.append("on " + ",".join(sorted(set(rec["hosts"]))))
    return f"==> {paths.log_file(rank, attempt)} ({', '.join(parts)}) <=="


# How often `-f` asks status's verdict (squeue, live processes) whether a run that has not
# recorded an end is still alive.
VERDICT_EVERY_S = 5.0


class EndWatch:
    """Whether a followed run has ended: its own record when it says so, else, at most every
    ``every_s`` seconds, ``status``'s verdict (which sees a killed job, and a cancelled job that
    still trains)."""

    def __init__(
        self,
        paths: rundir.RunPaths,
        every_s: float = VERDICT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.paths, self.every_s, self.clock = paths, every_s, clock
        self.asked_at: float | None = None
        self.why = ""  # the verdict's word, when it differs from the record

    def ended(self) -> bool:
        recorded = rundir.read_object(self.paths.status, records.STATUS)[0].get("state")
        if states.ended(recorded):
            return True
        now = self.clock()
        if self.asked_at is not None and now - self.asked_at < self.every_s:
            return False
        self.asked_at = now
        seen = status.collect(self.paths)
        if not states.ended(seen["state"]):
            return False
        said = seen.get("error") or seen.get("liveness")
        self.why = f"status says {seen['state']}" + (f": {said}" if said else "")
        return True


class Tail:
    """One log file read incrementally (a UTF-8 character cut between two reads stays whole); also
    what `submit --local` echoes to the terminal and what the dashboard shows of each rank. The
    file is opened as every record is (``storage/confined.py``, below ``within``: the run dir):
    a link or a FIFO is not read, and ``refused`` says why."""

    def __init__(self, path: str, within: str | None = None) -> None:
        self.path, self.within, self.pos = path, within, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.skipped = 0  # bytes passed over unread (``read(limit)``)
        self.refused = ""

    def read(self, limit: int | None = None) -> str:
        """The text written since the last read. With ``limit``, at most its last ``limit``
        bytes, from the first line that starts within them (a 2 GB log costs a seek, not 2 GB);
        ``skipped`` counts what was passed over."""
        try:
            with confined.open_file(self.path, self.within) as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.pos:  # truncated or replaced: read it again from the start
                    self.pos = 0
                cut = limit is not None and size - self.pos > limit
                if cut:
                    self.skipped += size - limit - self.pos
                    self.pos = size - limit
                    self.decoder.reset()
                f.seek(self.pos)
                data = f.read(size - self.pos)
                self.pos += len(data)
            self.refused = ""
        except confined.Refused as exc:
            self.refused = exc.why
            return ""
        except OSError:  # not there (yet)
            return ""
        if cut:
            data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
        return self.decoder.decode(data)

    def drain(self, out: IO[str]) -> None:
        said = self.refused
        text = self.read()
        if self.refused and self.refused != said:
            text += f"[{self.path} {self.refused}: not shown]\n"
        if text:
            out.write(text)
            out.flush()


def _check(paths: rundir.RunPaths, rank: int) -> None:
    run_dir = paths.root
    if not os.path.isdir(run_dir):
        raise UserError(f"run dir {run_dir!r} does not exist; pass the run.dir of a submitted run")
    if sweep_index.is_sweep_dir(paths):
        raise UserError(
            f"{run_dir!r} is a sweep; logs follows one run: pass a member's dir "
            f"(python -m clusterflow.status {run_dir} lists them)"
        )
    if not os.path.exists(paths.config):
        raise UserError(f"{run_dir!r} has no config.yaml, so it is not a clusterflow run dir")
    if rank < 0:
        raise UserError(f"--rank {rank}: ranks are numbered from 0")
    have = ranks(paths)
    if have and rank not in have:
        raise UserError(
            f"rank {rank} has no logs in {paths.logs}; ranks with logs: {', '.join(map(str, have))}"
        )


def show(
    paths: rundir.RunPaths,
    rank: int,
    out: IO[str],
    follow: bool = False,
    poll_s: float = 0.5,
    grace_s: float = 1.0,
) -> None:
    """Print every attempt of ``rank``; with ``follow``, keep going until the run ends."""
    tail: Tail | None = None
    current = -1
    watch = EndWatch(paths)
    while True:
        # Read before draining: lines written before the end are then printed.
        done = follow and watch.ended()
        for attempt in [a for a in attempts(paths, rank) if a > current]:
            if tail is not None:
                tail.drain(out)  # finish the previous attempt before the next header
            out.write(("\n" if tail is not None else "") + header(paths, rank, attempt) + "\n")
            tail, current = Tail(paths.log_file(rank, attempt), paths.root), attempt
        if tail is not None:
            tail.drain(out)
        if not follow:
            return
        if done:
            time.sleep(grace_s)  # the job logs its last lines just after writing its final state
            if tail is not None:
                tail.drain(out)
            if watch.why:
                print(f"logs: the run ended without recording it; {watch.why}", file=sys.stderr)
            return
        time.sleep(poll_s)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.logs",
        description="Print a rank's log across attempts.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir")
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="follow new lines and new attempts until the run ends",
    )
    p.add_argument("--rank", type=int, default=0, help="which rank's log (default 0)")
    args = p.parse_args(argv)
    paths = rundir.RunPaths(args.run_dir)
    _check(paths, args.rank)
    if not attempts(paths, args.rank) and not args.follow:
        print(
            f"no log yet in {paths.logs} (the job has not started); "
            f"python -m clusterflow.logs {args.run_dir} -f waits for it",
            file=sys.stderr,
        )
        return EXIT_OK
    try:
        show(paths, args.rank, sys.stdout, follow=args.follow)
    except BrokenPipeError:  # | head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK
