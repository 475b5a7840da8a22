"""One job per run dir: a lease file on the run dir's own storage, renewed by its holder.

POSIX locks are unreliable on NFS, so the lease is plain files, written whole and published with
``os.link`` (atomic on local filesystems and on NFS, and it fails when the name exists)::

    RUN_DIR/lease/gen-<N>.json
        {"token", "job_id", "slurm_job", "source", "host", "pid", "pid_start", "attempt",
         "started_at", "renewed_at", "renewals", "renew_s"}

The holder is the highest generation. Taking the run dir means linking generation N+1 while the
holder of N is judged gone: of two takers at once only one link succeeds, and the other finds a
live holder. The winner deletes the older generations. Rank 0 renews its generation every
``run.lease_s`` seconds on a background thread (rewritten whole, replaced atomically); a
holder that finds a newer generation (it was judged gone) has lost the run dir and stops at once.

Who is gone (:func:`judge`), without comparing clocks across machines where avoidable:

- on this host: its process no longer exists (pid and process start time, so a reused pid is not
  taken for it);
- a Slurm job: ``squeue`` no longer lists it; a requeued attempt of the same job takes its own
  lease;
- otherwise: not renewed for 4 x its renewal period, judged by the file's mtime against the
  storage's own clock (the mtime of a probe file written now), never against this host's clock.

Checked by ``submit`` on the login node (refuse early) and at job start on rank 0 before anything
is written to the run dir. ``submit --local`` takes the lease itself before it writes anything
(:func:`hold_for_launch`): of two submissions a second apart, the later one learns at once that
the run dir is taken, and the job it starts takes the lease over from it (the launcher's token
reaches the job in ``$CLUSTERFLOW_LAUNCHER_LEASE``). A lease file that cannot be replaced (a
directory, an immutable file) is refused in one line naming it. No torch here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from clusterflow.distributed import DistEnv
from clusterflow.errors import UserError
from clusterflow.rundir import records
from clusterflow.rundir.paths import RunPaths
from clusterflow.slurm import commands as slurm_commands
from clusterflow.storage import durable

log = logging.getLogger("clusterflow")
T = TypeVar("T")

STALE_RENEWALS = 4  # a lease not renewed for this many periods is abandoned
# The token of the lease a local launcher holds for the job it starts (inherited by the job).
LAUNCHER_ENV = "CLUSTERFLOW_LAUNCHER_LEASE"
_GEN = re.compile(r"^gen-(\d+)\.json$")
_held: dict[str, Lease] = {}  # run dir (real path) -> the lease this process holds


class RunDirBusy(UserError):
    """This job may not use the run dir (another live job holds it, or it is gone): nothing may be
    written to it, not even an error record."""


def gen_file(paths: RunPaths, gen: int) -> str:
    """The lease record of generation ``gen``: ``RUN_DIR/lease/gen-<gen>.json``."""
    return os.path.join(paths.lease, f"gen-{gen}.json")


def generation(name: str) -> int | None:
    """The generation of a file in the lease folder named by :func:`gen_file`, else None."""
    m = _GEN.match(name)
    return int(m.group(1)) if m else None


def process_start(pid: int) -> str | None:
    """The kernel's start time of a live process (``/proc/<pid>/stat`` field 22), None when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has exited


def identity(
    env: DistEnv | None = None, environ: dict[str, str] | None = None, renew_s: int = 30
) -> dict[str, Any]:
    """This process as a holder. ``env``: its DistEnv (job id, launcher, attempt); None for
    ``submit`` on a login node, which only checks."""
    environ = dict(os.environ if environ is None else environ)
    now = time.time()
    job = (
        {
            "job_id": str(env.job_id),
            "slurm_job": environ.get("SLURM_JOB_ID", ""),
            "source": env.source,
            "attempt": env.attempt,
        }
        if env is not None
        else {"job_id": "submit", "slurm_job": "", "source": "submit", "attempt": 0}
    )
    return {
        "token": uuid.uuid4().hex,
        "launcher": environ.get(LAUNCHER_ENV, "") if env is not None else "",
        **job,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": process_start(os.getpid()),
        "started_at": now,
        "renewed_at": now,
        "renewals": 0,
        "renew_s": renew_s,
    }


def describe(rec: dict[str, Any]) -> str:
    job = (
        f"Slurm job {rec['slurm_job']}"
        if rec.get("slurm_job")
        else f"{rec.get('source', '?')} job {rec.get('job_id', '?')}"
    )
    since = time.strftime("%H:%M:%S", time.localtime(rec.get("started_at") or 0))
    return (
        f"{job} (pid {rec.get('pid')} on {rec.get('host')}, "
        f"attempt {rec.get('attempt')}, since {since})"
    )


# -- reading ------------------------------------------------------------------------------------


def _read(paths: RunPaths) -> tuple[int, dict[str, Any] | None, str]:
    """(generation, holder record, its path); (0, None, "") when nobody holds the run dir. An
    unreadable record is {} (records are published whole, so it is damage, not a write in
    progress)."""
    try:
        gens = [g for g in map(generation, os.listdir(paths.lease)) if g is not None]
    except OSError:
        return 0, None, ""
    if not gens:
        return 0, None, ""
    path = gen_file(paths, max(gens))
    rec = records.read_json(path, {}, within=paths.root)  # a link or a FIFO is damage too
    return max(gens), rec if isinstance(rec, dict) else {}, path


def current(paths: RunPaths) -> tuple[int, dict[str, Any] | None, float]:
    """(generation, holder record or None, seconds since its last renewal by the storage's
    clock)."""
    gen, rec, path = _read(paths)
    if not gen:
        return 0, None, 0.0
    try:
        return gen, rec, max(0.0, storage_now(paths) - os.stat(path).st_mtime)
    except OSError:
        return gen, rec, float("inf")


def storage_now(paths: RunPaths) -> float:
    """The storage's clock: the mtime of a file written now (NFS servers set it), so a lease age
    never mixes two machines' clocks."""
    probe = os.path.join(paths.lease, f".probe-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb"):
            pass
        return os.stat(probe).st_mtime
    except OSError:
        return time.time()
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def judge(
    rec: dict[str, Any], age_s: float, me: dict[str, Any], queue: Callable[[str], str | None]
) -> tuple[bool, str]:
    """(alive, why) for the holder ``rec`` as seen by ``me``. ``queue(job)``: squeue's state of a
    Slurm job, "" when it is no longer queued, None when squeue does not answer."""
    if not rec:
        return False, "its lease record is unreadable"
    if rec.get("token") == me.get("token") or (
        rec.get("host"),
        rec.get("pid"),
        rec.get("pid_start"),
    ) == (me.get("host"), me.get("pid"), me.get("pid_start")):
        return False, "it is this process"
    if rec.get("token") and rec.get("token") == me.get("launcher"):
        return False, LAUNCHED_BY_IT
    if rec.get("slurm_job") and rec["slurm_job"] == me.get("slurm_job"):
        return False, "it is an earlier attempt of this same Slurm job"
    if rec.get("host") == me.get("host"):
        pid = rec.get("pid")
        if (
            isinstance(pid, int)
            and process_start(pid) is not None
            and process_start(pid) == rec.get("pid_start")
        ):
            return True, f"its process {pid} is alive on this host"
        return False, f"its process {pid} on {rec.get('host')} is gone"
    if rec.get("slurm_job"):
        state = queue(rec["slurm_job"])
        if state == "":
            return False, f"Slurm job {rec['slurm_job']} is no longer queued"
        if state:
            return True, f"Slurm job {rec['slurm_job']} is {state.split('|')[0]}"
    stale = STALE_RENEWALS * float(rec.get("renew_s") or 30)
    if age_s > stale:
        return False, f"its lease was not renewed for {age_s:.0f} s (more than {stale:.0f} s)"
    return True, f"its lease was renewed {age_s:.0f} s ago"


LAUNCHED_BY_IT = "it is the launcher of this job, which hands the run dir over"


def check(paths: RunPaths, me: dict[str, Any]) -> str:
    """Raise RunDirBusy when a live job holds ``run_dir``; else a note on a holder that is gone
    ("" if none)."""
    return _judge_holder(paths, me)[1]


def _judge_holder(paths: RunPaths, me: dict[str, Any]) -> tuple[int, str]:
    """(the holder's generation, a note when it is gone); raises RunDirBusy while it lives."""
    gen, rec, age = current(paths)
    if gen == 0:
        return 0, ""
    path = gen_file(paths, gen)
    if os.path.isdir(path):
        raise _unusable(path, "Is a directory")
    alive, why = judge(rec or {}, age, me, slurm_commands.queue_state)
    if why == LAUNCHED_BY_IT:
        return gen, ""
    who = describe(rec) if rec else f"an unreadable lease ({path})"
    if alive:
        raise RunDirBusy(
            f"run dir {paths.root!r} is held by {who}: {why}. "
            "One job per run dir: wait for it to end, cancel it (python -m clusterflow.cancel "
            f"{paths.root}: a Slurm job is scancelled, a local one stops at its next step), or "
            "choose another run.dir"
        )
    return gen, f"run dir {paths.root!r} was held by {who}, but {why}; taking it over"


def hold(
    paths: RunPaths, env: DistEnv, renew_s: int, environ: dict[str, str] | None = None
) -> Lease:
    """Rank 0 at job start, before anything is written to ``run_dir``. A relaunch (a requeued
    attempt) never recreates a run dir that is gone: it was moved or deleted since the job began."""
    if (env.attempt > 0 or getattr(env, "restart_in_job", 0) > 0) and not os.path.isdir(paths.root):
        raise RunDirBusy(
            f"run dir {paths.root!r} is gone, but this is attempt {env.attempt} of job "
            f"{env.job_id}, which ran there before: it was moved or deleted. "
            "This job writes nothing; resubmit with run.dir=<where it is now>"
        )
    return acquire(paths, identity(env, environ, renew_s))


@dataclass
class Lease:
    paths: RunPaths
    gen: int
    rec: dict[str, Any]
    thread: threading.Thread | None = None
    stop: threading.Event | None = None


def acquire(
    paths: RunPaths,
    me: dict[str, Any],
    on_lost: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> Lease:
    """Hold ``run_dir`` for this process (re-entrant), renewing it every ``me["renew_s"]`` seconds
    until :func:`release`. Raises RunDirBusy while another live job holds it, or when the lease
    cannot be written or an older one removed. ``on_note``: what is said of a holder that is
    gone (a log warning by default)."""
    key = os.path.realpath(paths.root)
    if key in _held:
        return _held[key]
    _unusable_unless(lambda: os.makedirs(paths.lease, exist_ok=True), paths.lease)
    for _ in range(10):  # each turn: someone else linked first; judge the new holder
        gen, note = _judge_holder(paths, me)
        target = gen_file(paths, gen + 1)
        if _unusable_unless(functools.partial(_publish, paths, gen + 1, me), target):
            try:
                _drop_older(paths, gen + 1)
            except RunDirBusy:
                os.unlink(target)  # ours, just published: the run dir stays as it was
                raise
            if note:  # said once the run dir is taken, not before a refusal
                (on_note or _warn)(note)
            lease = _held[key] = Lease(paths, gen + 1, me)
            _start_renewing(lease, on_lost or _abort)
            return lease
    raise RunDirBusy(
        f"run dir {paths.root!r}: could not take the lease (other jobs keep taking it); "
        "one job per run dir"
    )


def _publish(paths: RunPaths, gen: int, rec: dict[str, Any]) -> bool:
    """Link generation ``gen`` into place; False when that name already exists."""
    target = gen_file(paths, gen)
    return durable.publish_once(target, json.dumps(rec, indent=1))


def _warn(note: str) -> None:
    log.warning("%s", note)


def _unusable_unless(action: Callable[[], T], path: str) -> T:
    """``action()``, or RunDirBusy naming ``path`` when the storage refuses it."""
    try:
        return action()
    except OSError as exc:
        raise _unusable(path, exc.strerror or str(exc)) from None


def _unusable(path: str, why: str) -> RunDirBusy:
    what = "a directory" if os.path.isdir(path) else "not writable or not removable"
    return RunDirBusy(
        f"run dir lease {path} is {what} ({why}): it cannot be taken over. "
        f"If no job uses this run dir, remove it (rm -r {path}) and submit again"
    )


def _drop_older(paths: RunPaths, gen: int) -> None:
    for name in os.listdir(paths.lease):
        g = generation(name)
        if g is not None and g < gen:
            path = os.path.join(paths.lease, name)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _unusable(path, exc.strerror or str(exc)) from None


def _still_mine(lease: Lease) -> bool:
    gen, rec, _ = _read(lease.paths)
    return gen == lease.gen and (rec or {}).get("token") == lease.rec["token"]


def renew(lease: Lease) -> bool:
    """Rewrite the lease whole with a fresh mtime; False (and nothing written) when it was taken
    over."""
    if not _still_mine(lease):
        return False
    lease.rec.update(renewed_at=time.time(), renewals=lease.rec["renewals"] + 1)
    target = gen_file(lease.paths, lease.gen)
    durable.write_atomic(target, json.dumps(lease.rec, indent=1), make_folder=False)
    return True


def _start_renewing(lease: Lease, on_lost: Callable[[str], None]) -> None:
    lease.stop = threading.Event()

    def loop() -> None:
        while not lease.stop.wait(float(lease.rec["renew_s"])):
            try:
                if not renew(lease):
                    _, rec, _ = _read(lease.paths)
                    on_lost(
                        f"this job lost run dir {lease.paths.root!r} to "
                        f"{describe(rec) if rec else 'another job'}"
                    )
                    return
            # A storage hiccup: try again next period; a long outage ends in takeover.
            except OSError as exc:
                log.warning("could not renew the lease of %s: %s", lease.paths.root, exc)

    lease.thread = threading.Thread(target=loop, name="clusterflow-lease", daemon=True)
    lease.thread.start()


def _abort(why: str) -> None:
    """Another job now owns the run dir: writing on would interleave two runs. Stop at once."""
    log.error("%s (it judged this job gone); stopping now without writing anything more", why)
    logging.shutdown()
    os._exit(1)


def hold_for_launch(paths: RunPaths, on_note: Callable[[str], None]) -> Lease:
    """``submit --local``: hold ``run_dir`` from before anything is written until the job this
    process starts takes it over (the job finds this lease's token in ``LAUNCHER_ENV`` and takes
    the next generation; this process then stops renewing, quietly)."""
    me = identity()
    me.update(source="submit --local", job_id=str(os.getpid()))
    held = acquire(paths, me, on_lost=_handed_over, on_note=on_note)
    os.environ[LAUNCHER_ENV] = held.rec["token"]
    return held


def _handed_over(why: str) -> None:
    """The launcher's lease, taken over by its job (or judged gone): nothing to stop."""


def release(paths: RunPaths) -> None:
    """Stop renewing and remove this process's generation, if it still holds it."""
    lease = _held.pop(os.path.realpath(paths.root), None)
    if lease is None:
        return
    if lease.stop is not None:
        lease.stop.set()
        lease.thread.join()
    if _still_mine(lease):
        try:
            os.unlink(gen_file(paths, lease.gen))
        except FileNotFoundError:
            pass
