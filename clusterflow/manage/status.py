"""python -m clusterflow.status RUN_DIR|SWEEP_DIR [--json] [--ranks]

What a run is doing, from its run directory (and squeue, when it answers within a few seconds).
A script's arguments and a sweep's values are shown with their secrets masked
(``config/masking.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import time
from collections.abc import Callable
from typing import Any

from clusterflow import rundir
from clusterflow.config import masking
from clusterflow.config.job_config import checkpoint_root as join_checkpoints
from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.manage import liveness, ranks, sweep_status, verdict
from clusterflow.observe import goodput
from clusterflow.observe.trackers.state import received_steps
from clusterflow.rundir import (
    cancel_marker,
    faults,
    first_error,
    frozen_code,
    records,
    restarts,
    saved_config,
    submissions,
    timeline,
    tries,
)
from clusterflow.rundir.states import State
from clusterflow.slurm import commands as slurm_commands
from clusterflow.slurm import jobids
from clusterflow.slurm import outcome as slurm_outcome
from clusterflow.slurm import steps as slurm_steps
from clusterflow.storage import confined
from clusterflow.storage.store import CheckpointStore
from clusterflow.sweeps import index as sweep_index

EXAMPLES = (
    "examples:\n"
    "  python -m clusterflow.status runs/demo\n"
    "  python -m clusterflow.status runs/demo --json | jq .state\n"
    "  python -m clusterflow.status runs/demo --ranks"
    "            # every rank: step, phase, heartbeat age, GPU\n"
    "  python -m clusterflow.status runs/sweep1            # a sweep dir: one row per member\n"
)


def _checkpoints(root: str) -> tuple[list[str], list[str], dict[str, Any]]:
    """Committed steps (oldest first), the damaged ones the store set aside, and the newest
    committed step's manifest ({} when none, or when it cannot be read)."""

    try:
        store = CheckpointStore(root)
        newest = store.newest_manifest() or {}
        return [store.url_of(s) for s in store.steps()], store.damaged(), newest
    except Exception:  # noqa: BLE001 - an unreachable remote store must not break status
        return [], [], {}


def _last_step_of_run(manifest: dict[str, Any]) -> bool:
    """Whether a committed checkpoint is the run's last one (``saved_config.ends_run``)."""
    return saved_config.ends_run(manifest)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _completed(paths: rundir.RunPaths, manifest: dict[str, Any]) -> bool:
    """What is committed says the run completed: the final model.pt (written only after the last
    checkpoint committed) next to a committed checkpoint of the run's last step."""
    return os.path.isfile(paths.model) and _last_step_of_run(manifest)


PROGRESS = ("epoch", "global_step", "step_in_epoch")


def _progress(st: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """epoch, global_step and step_in_epoch: status.json's, unless it lost them or is behind the
    newest committed checkpoint (a kill before its next write), which then says where the run
    is."""
    recorded = {k: st[k] for k in PROGRESS if _is_int(st.get(k))}
    committed = {k: manifest[k] for k in PROGRESS if _is_int(manifest.get(k))}
    behind = len(recorded) < len(PROGRESS) or recorded["global_step"] < committed.get(
        "global_step", -1
    )
    if behind and len(committed) == len(PROGRESS):
        return committed
    return {k: recorded.get(k, 0) for k in PROGRESS}


def _checkpoint_root(paths: rundir.RunPaths, data: dict[str, Any], problem: str) -> tuple[str, str]:
    """Where the checkpoints are, from config.yaml read as plain YAML (``data``; a damaged one,
    ``problem``, must not stop status: then the default place, and what is wrong)."""
    configured = (
        (data.get("checkpoint") or {}).get("dir")
        if isinstance(data.get("checkpoint"), dict)
        else None
    )
    if problem or not isinstance(configured or "", str):
        why = problem or "checkpoint.dir is not a string"
        return join_checkpoints(
            paths.root, ""
        ), f"config.yaml is damaged ({why}); the next launch sets it aside"
    return join_checkpoints(paths.root, configured or ""), ""


def _script(data: dict[str, Any]) -> dict[str, Any] | None:
    """The script of the user's own the run trains with (config.yaml's script section, ``data``
    read as plain YAML), its secrets masked (``masking``: ``--api-key VALUE``), or None for a
    task's run."""
    section = data.get("script") if isinstance(data.get("script"), dict) else {}
    path, args = section.get("path"), section.get("args")
    if not isinstance(path, str) or not path:
        return None
    return {
        "path": masking.mask_text(path),
        "args": masking.mask_args(args) if isinstance(args, list) else [],
    }


def _trackers(paths: rundir.RunPaths, data: dict[str, Any]) -> dict[str, int | None]:
    """Each configured tracker (config.yaml's trackers section, ``data`` read as plain YAML) and
    the last step it is known to have received (None: none)."""
    section = data.get("trackers") if isinstance(data.get("trackers"), dict) else {}
    names = [name for name in ("mlflow", "wandb") if section.get(name)]
    return received_steps(paths, names)


def _tracker_lines(s: dict[str, Any]) -> list[str]:
    """A warning for each tracker that received nothing although the run logged steps."""
    if not s["global_step"]:
        return []
    return [
        f"warning      tracker {name} received no step of the {s['global_step']} trained: "
        f"python -m clusterflow.logs {s['run_dir']} | grep 'tracker {name}' says why "
        "(metrics.jsonl holds every point; the next launch sends them once the tracker answers)"
        for name, step in s["trackers"].items()
        if step is None
    ]


def _errors(paths: rundir.RunPaths, since: float, damaged: list[str]) -> list[dict[str, Any]]:
    """What ended each rank of the last attempt (a damaged record is added to ``damaged``)."""
    errors = []
    try:
        names = sorted(n for n in os.listdir(paths.errors) if n.startswith("rank"))
    except OSError:
        names = []
    for name in names:
        e, said = records.read_checked(
            os.path.join(paths.errors, name), records.ERROR, f"errors/{name}", within=paths.root
        )
        damaged += said
        if e is not None and (e.get("time") or 0) >= since:
            errors.append({k: e.get(k) for k in ("rank", "host", "error")})
    return errors


# The end of a Slurm job's batch output that holds its newest srun step's report.
SRUN_TAIL_BYTES = 4 * 2**20


def _srun_first(paths: rundir.RunPaths, job_id: str) -> tuple[int, str, str] | None:
    """The task srun reported as failed first in a Slurm job's output (its last
    :data:`SRUN_TAIL_BYTES`), or None."""
    if not jobids.is_slurm_id(job_id):
        return None
    target = os.path.join(paths.slurm_logs, job_id, f"{job_id}_0_log.err")
    try:
        with confined.open_file(target, paths.root) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - SRUN_TAIL_BYTES))
            text = f.read(SRUN_TAIL_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    # a job that restarted inside its allocation: the newest srun step's report
    return slurm_steps.first_failure(text)


def _runs_known(attempts: list[dict[str, Any]], job_id: str) -> int:
    """How many runs of Slurm job ``job_id`` the run's attempts know: its highest restart count
    (SLURM_RESTART_COUNT) + 1, or 0 when none of them ran in it."""
    counts = [
        a["restart_count"]
        for a in attempts
        if str(a.get("job_id")) == job_id and isinstance(a.get("restart_count"), int)
    ]
    return max(counts) + 1 if counts else 0


def _mining(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = (
        "epoch",
        "num_clusters",
        "num_singletons",
        "largest_cluster",
        "nmi",
        "ari",
        "pairwise_f",
        "bcubed_f",
        "method",
        "threshold",
        "threshold_rule",
        "curve",
        "engine",
        "hooking_rounds",
        "size_histogram",
    )
    return [
        {k: m.get(k) for k in keys if k in m} | {"seconds": (m.get("seconds") or {}).get("total")}
        for m in rounds
    ]


def _curve_summary(m: dict[str, Any]) -> str:
    """Five evenly spaced points of the last round's curve and the threshold it used (marked *):
    threshold: clusters, largest[, NMI]."""
    curve = m.get("curve") or {}
    ts = curve.get("thresholds") or []
    if not ts:
        return ""
    chosen = m.get("threshold")
    rows = {round(i * (len(ts) - 1) / 4) for i in range(5)} | {
        i for i, t in enumerate(ts) if t == chosen
    }
    nmi = curve.get("nmi")
    out = " | ".join(
        f"{ts[i]:.4g}{'*' if ts[i] == chosen else ''}: "
        f"{curve['num_clusters'][i]} clusters, largest {curve['largest_cluster'][i]}"
        + (f", NMI {nmi[i]:.3f}" if nmi else "")
        for i in sorted(rows)
    )
    if chosen is not None and chosen < min(ts):
        out += f" ({chosen:.4g} keeps every mutual edge)"
    return out


def _samples(paths: rundir.RunPaths, notes: list[str]) -> dict[str, Any] | None:
    """The sample ledger (sample_ledger.json: which ranges of each epoch's order which attempt
    trained, as of the checkpoint the run continues from), or None before the first start."""
    ledger, said = records.read_checked(paths.sample_ledger, records.LEDGER)
    notes += said
    return ledger


def _ledger_lines(ledger: dict[str, Any] | None, shown: int = 2) -> list[str]:
    """The last ``shown`` epochs of the ledger, one line each: its ranges and who trained them;
    the earlier ones summed up in one line (shown in full when there is only one). A loop
    without a loader trains steps, not samples: the steps each attempt trained."""
    if ledger and ledger.get("steps"):
        runs = ", ".join(
            f"{r['start'] + 1}-{r['end']} attempt {r['attempt']} on {r['world_size']} rank(s)"
            for r in ledger["steps"]
        )
        return [
            f"steps        {sum(r['end'] - r['start'] for r in ledger['steps'])} trained: {runs}"
        ]
    if not ledger or not ledger["epochs"]:
        return []
    epochs = ledger["epochs"]
    lines = []

    def trained(e: dict[str, Any]) -> int:
        return sum(r["end"] - r["start"] for r in e["ranges"])

    if len(epochs) == shown + 1:
        shown += 1
    earlier = epochs[:-shown]
    if earlier:
        full = sum(trained(e) == e["samples"] for e in earlier)
        lines.append(
            f"samples      epochs {earlier[0]['epoch'] + 1}-{earlier[-1]['epoch'] + 1}: "
            f"{full} of {len(earlier)} trained in full (--json lists every range)"
        )
    for e in epochs[-shown:]:
        ranges = ", ".join(
            f"[{r['start']}, {r['end']}) attempt {r['attempt']} on {r['world_size']} rank(s)"
            for r in e["ranges"]
        )
        lines.append(
            f"samples      epoch {e['epoch'] + 1}: {trained(e)} of {e['samples']} trained: {ranges}"
        )
    return lines


def _goodput(
    paths: rundir.RunPaths, state: str, notes: list[str]
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The run's goodput from its own records (no Slurm query: ``clusterflow goodput`` adds
    Slurm's start and end times), None before any attempt recorded its time; and each attempt's
    fault with the time it cost (``rundir/faults.py``, charged by the ledger). The records it
    read that are damaged (its timelines) join ``notes``."""
    book = goodput.ledger(paths, running=state == State.RUNNING)
    notes += [d for d in book["damaged_records"] if d not in notes]
    if not book["attempts"]:
        return None, book["faults"]
    total = book["total"]
    return {
        "ratio": total["ratio"],
        "productive_gpu_s": total["gpu_seconds"]["productive"],
        "allocated_gpu_s": total["allocated_gpu_s"],
    }, book["faults"]


def collect(
    paths: rundir.RunPaths,
    queue_state: Callable[[str], str | None] | None = None,
    plain: tuple[dict[str, Any], str] | None = None,
    queued: Callable[[str], slurm_commands.QueuedJob | None] | None = None,
) -> dict[str, Any]:
    """What the run is doing, from its records. ``queue_state``: squeue's ``STATE|REASON`` for a
    job id, and ``queued``: its :class:`~clusterflow.slurm.commands.QueuedJob` with the job's
    times (the dashboard passes both, from one squeue call for all its runs; by default one
    squeue call per job asked about answers both); ``plain``: config.yaml as
    ``saved_config.read_plain`` returns it, when the caller has it already (the dashboard reads
    it again only when the file changes)."""
    if queue_state is None:
        asked = slurm_commands.Queue()
        queue_state, queued = asked.state, asked.job
    run_dir = paths.root
    if not os.path.isdir(run_dir):
        raise UserError(f"run dir {run_dir!r} does not exist; pass the run.dir of a submitted run")
    if not os.path.exists(paths.config):
        raise UserError(f"{run_dir!r} has no config.yaml, so it is not a clusterflow run dir")
    # Records are hints: each one that does not fit its schema is named in ``notes``.
    st, notes = rundir.read_object(paths.status, records.STATUS)
    attempts, said = records.read_records(paths.attempts, records.ATTEMPT)
    notes += said
    # config.yaml read once, as plain YAML
    config, problem = plain if plain is not None else saved_config.read_plain(paths)
    root, damaged_config = _checkpoint_root(paths, config, problem)
    notes += [damaged_config] if damaged_config else []
    cks, damaged, newest = _checkpoints(root)
    progress = _progress(st, newest)
    last = attempts[-1] if attempts else {}
    # A resubmission is newer than the last attempt.
    current = submissions.current_job_id(paths, notes)
    job_id = current or str(last.get("job_id") or st.get("job_id") or "")
    queue = (
        queue_state(job_id)
        if current or (last.get("source") or "slurm") in ("slurm", "torchrun")
        else None
    )
    evidence = verdict.Evidence(
        recorded_state=st.get("state"),
        recorded_error=st.get("error"),
        attempts=len(attempts),
        started=bool(cks),
        queue=queue,
        cancelled=cancel_marker.is_cancelled(paths),
        first_error=first_error.read(paths, rundir.current_attempt(paths), notes),
        srun_first=_srun_first(paths, job_id),
        completed=_completed(paths, newest),
        job_id=job_id,
        slurm_runs=_runs_known(attempts, job_id),
        resume=saved_config.how_to_resume(paths),
        gave_up=tries.gave_up(paths, rundir.current_attempt(paths)),
    )
    asked = None
    if verdict.needs_slurm(evidence):
        asked = slurm_outcome.ask(job_id)
        evidence = dataclasses.replace(evidence, slurm=asked)
    alive, note = None, None
    if verdict.needs_liveness(evidence):
        life = liveness.check(paths, last, queue, queue_state)
        alive = life.alive
        note = life.note(progress["global_step"]) if alive is False else None
        evidence = dataclasses.replace(evidence, alive=alive, liveness=note)
    decided = verdict.decide(evidence)
    latest = cks[-1] if cks else None
    tls = timeline.read_all(paths)
    out = {
        "state": decided.state,
        "note": decided.note,
        "alive": alive,
        "liveness": note,
        "run_dir": run_dir,
        "job_id": job_id,
        **progress,
        "steps_per_epoch": st.get("steps_per_epoch"),
        # A loop of run.steps(max_steps), without a loader: its unit is the step.
        "max_steps": _max_steps(st, newest),
        "attempts": len(attempts),
        "world_size": st.get("world_size", last.get("world_size")),
        "hosts": st.get("hosts") or sorted(set(last.get("hosts") or [])),
        "excluded_nodes": rundir.excluded_nodes(paths),
        "restarts": _restarts(paths, tls),
        "tries": tries.latest(paths),
        "restored_from": timeline.restored_from(tls, len(attempts)),
        "latest_checkpoint": latest,
        "latest_checkpoint_age_s": time.time() - os.path.getmtime(latest)
        if latest and os.path.exists(latest)
        else None,
        "checkpoints": cks,
        "damaged_checkpoints": damaged,
        "damaged_records": notes,
        "checkpoint_error": st.get("checkpoint_error"),
        "mining": _mining(st.get("mining") if isinstance(st.get("mining"), list) else []),
        "samples": _samples(paths, notes),
        "eval": st.get("eval", {}),
        "trackers": _trackers(paths, config),
        "last_loss": st.get("last_loss"),
        "errors": _errors(paths, last.get("started_at") or 0, notes),
        "error": decided.error,
        "logs": paths.logs,
        "code": frozen_code.describe(paths, notes),
        "script": _script(config),
        "updated_at": st.get("updated_at"),
    }
    out["goodput"], out["faults"] = _goodput(paths, decided.state, notes)
    if decided.stalled is not None:
        out["stalled"] = decided.stalled
    ranks.extend(
        out, paths, config, last, queue, damaged=notes, asked=asked
    )  # ranks, Slurm's verdict
    listed = queued(job_id) if queued is not None and queue else None
    out["job"] = _job(listed) if listed is not None else None
    epochs = _epochs(st, newest, config)
    out["epochs"] = epochs
    out["current_epoch"] = current_epoch(out["epoch"], epochs, decided.state == State.COMPLETED)
    out.update(_finish(out, epochs))
    return out


def _job(q: slurm_commands.QueuedJob) -> dict[str, Any]:
    """The Slurm job as squeue lists it now: state and why it waits, time limit, elapsed and left
    (as of ``asked_at``), when it started or is expected to start, its nodes."""
    job = q.to_dict()
    job["reason"] = "" if q.reason in ("None", "(null)") else q.reason
    return job


def _epochs(st: dict[str, Any], manifest: dict[str, Any], config: dict[str, Any]) -> int | None:
    """The epochs the run's loop trains (a script's ``run.epochs(n)``, not config.yaml's
    train.epochs): as its last status write and its checkpoints record them, else config.yaml's
    train.epochs."""
    for epochs in (st.get("epochs"), manifest.get("epochs")):
        if _is_int(epochs) and epochs > 0:
            return epochs
    train = config.get("train")
    epochs = train.get("epochs") if isinstance(train, dict) else None
    return epochs if _is_int(epochs) and epochs > 0 else None


def current_epoch(epoch: int, epochs: int | None, completed: bool) -> int:
    """The epoch a run is in, counted from 1 as its log lines count it (``epoch 2 step 3/6``),
    from ``epoch``, the epochs finished: the one being trained (or about to be), the last one
    once all ``epochs`` are done or the run ``completed``."""
    if completed:
        return max(epoch, 1)
    return min(epoch + 1, epochs) if epochs else epoch + 1


def _max_steps(st: dict[str, Any], manifest: dict[str, Any]) -> int | None:
    """The steps of a run whose loop counts steps (``run.steps(max_steps)``): status.json's, else
    its newest checkpoint's; None for a run of epochs."""
    for steps in (st.get("max_steps"), manifest.get("max_steps")):
        if _is_int(steps) and steps > 0:
            return steps
    return None


def _finish(s: dict[str, Any], epochs: int | None) -> dict[str, Any]:
    """The run's own estimate of what is left while it trains: ``steps_left`` of its epochs, and
    ``eta_s``, those steps at the training ranks' median step time of their heartbeats (steps
    only: eval, mining and checkpoints come on top)."""
    spe = s.get("steps_per_epoch")
    if s.get("max_steps"):
        left = max(0, s["max_steps"] - s["global_step"])
    elif epochs is None or not _is_int(spe) or not spe:
        return {"steps_left": None, "eta_s": None}
    else:
        left = max(0, (epochs - s["epoch"]) * spe - s["step_in_epoch"])
    times = sorted(
        r["step_time_s"]
        for r in s.get("ranks") or []
        if r.get("phase") == "train"
        and not r.get("silent")
        and isinstance(r.get("step_time_s"), (int, float))
        and r["step_time_s"] > 0
    )
    step_s = times[len(times) // 2] if times else None
    eta = left * step_s if step_s is not None and s["state"] == State.RUNNING else None
    return {"steps_left": left, "eta_s": eta}


def hms(seconds: float) -> str:
    """``[D-]H:MM:SS`` as Slurm writes a duration."""
    whole = round(max(0.0, seconds))
    days, rest = divmod(whole, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def _job_lines(s: dict[str, Any]) -> list[str]:
    """The job's time and place as Slurm gives them, and the run's own estimate of its end."""
    lines = []
    job = s.get("job")
    if job:
        why = f" ({job['reason']})" if job["reason"] else ""
        where = job["nodes"] or job["scheduled_nodes"]
        if job["state"] == "PENDING":
            start = (
                f"Slurm expects it to start at {_clock(job['start_at'])}"
                + (f" on {where}" if where else "")
                if job["start_at"]
                else "no expected start from Slurm yet"
            )
            lines.append(f"job          PENDING{why}: {start}")
        else:
            limit = hms(job["time_limit_s"]) if job["time_limit_s"] is not None else "no limit"
            spent = hms(job["elapsed_s"]) if job["elapsed_s"] is not None else "?"
            left = f", {hms(job['left_s'])} left" if job["left_s"] is not None else ""
            lines.append(
                f"job          {job['state']}{why} on {where or '?'}: {spent} of {limit}{left}"
            )
    if s.get("eta_s") is not None:
        lines.append(
            f"finish       {s['steps_left']} steps left, about {hms(s['eta_s'])} at the ranks' "
            "current step time (eval, mining and checkpoints come on top)"
        )
    return lines


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _restarts(paths: rundir.RunPaths, tls: timeline.Timelines) -> list[dict[str, Any]]:
    """Each restart inside the job (``restarts.read``), with where its attempt took its state
    (``restored_from``: memory, replica or shared; ``restored_where``; ``restored_step``), once
    that attempt has restored."""
    out = restarts.read(paths)
    for r in out:
        rec = tls.records.get(r.get("next_attempt"), {})
        if "restored_step" in rec:
            r["restored_from"] = rec.get("restored_from") or (
                "shared" if rec["restored_step"] else None
            )
            r["restored_where"] = rec.get("restored_where")
            r["restored_step"] = rec["restored_step"]
    return out


def _restarts_said(done: list[dict[str, Any]]) -> str:
    """What the attempts line adds about restarts inside the job (docs/restarts.md)."""
    if not done:
        return ""
    last = done[-1]
    again = (
        f", training again {last['recovery_s']:.1f} s after the fault"
        if "recovery_s" in last
        else ""
    )
    came = ""
    if last.get("restored_from") in ("memory", "replica") and last.get("restored_where"):
        came = f", step {last.get('restored_step')} from the {last['restored_where']}"
    elif last.get("restored_from") == "shared":
        came = f", step {last.get('restored_step')} from the shared filesystem"
    shrunk = (
        f", shrunk to {last.get('world_size')} rank(s) on {len(last.get('nodes') or [])} node(s): "
        "no spare node was left (cluster.shrink; the next requeue asks for cluster.nodes again)"
        if last.get("shrunk")
        else ""
    )
    return (
        f" ({len(done)} restart(s) inside the job; the last after rank {last.get('rank')} on "
        f"{last.get('host')}: {last.get('error')} ({last.get('cause')}), on "
        f"{', '.join(last.get('nodes') or [])}{shrunk}{came}{again})"
    )


# The faults `status` shows a line each (the newest); the rest are summed up by kind.
FAULT_LINES = 3


def _fault_lines(s: dict[str, Any]) -> list[str]:
    """Each of the newest faults in a line, after one that counts them all by kind and what
    they cost."""
    found = s.get("faults") or []
    if not found:
        return []
    counts: dict[str, int] = {}
    for f in found:
        label = faults.LABELS.get(f["kind"], str(f["kind"]))
        counts[label] = counts.get(label, 0) + 1
    lost = sum(f.get("lost_s") or 0.0 for f in found)
    lines = [
        f"faults       {len(found)}: "
        + ", ".join(f"{k} x{n}" for k, n in counts.items())
        + f"; {lost:.1f} s lost to them (clusterflow goodput {s['run_dir']} charges each)"
    ]
    for f in found[-FAULT_LINES:]:
        lines.append(f"fault        {faults.describe(f)}")
    return lines


def render(s: dict[str, Any]) -> str:
    lines = [
        f"state        {s['state']}" + (f"  (job {s['job_id']})" if s["job_id"] else ""),
        f"attempts     {s['attempts']}" + _restarts_said(s["restarts"]),
        (
            f"progress     step {s['global_step']} of {s['max_steps']}"
            if s.get("max_steps")
            else f"progress     epoch {s['current_epoch']}"
            + (f"/{s['epochs']}" if s.get("epochs") else "")
            + f", step {s['step_in_epoch']}/{s['steps_per_epoch']} of the epoch, global step "
            f"{s['global_step']}"
        ),
        f"world        {s['world_size']} rank(s) on {', '.join(s['hosts']) or '?'}",
        *_job_lines(s),
    ]
    if s.get("script"):
        lines.append(f"script       {shlex.join([s['script']['path'], *s['script']['args']])}")
    if s["excluded_nodes"]:
        lines.append(
            f"excluded     {', '.join(s['excluded_nodes'])} (left out of the job after a node "
            "failure: stops.jsonl says which rank and why)"
        )
    lines += _fault_lines(s)
    lines += _ledger_lines(s["samples"])
    if s["latest_checkpoint"]:
        age = (
            f" ({s['latest_checkpoint_age_s']:.0f} s old)"
            if s["latest_checkpoint_age_s"] is not None
            else ""
        )
        lines.append(f"checkpoint   {s['latest_checkpoint']}{age}; {len(s['checkpoints'])} kept")
    else:
        lines.append("checkpoint   none yet")
    if s["damaged_checkpoints"]:
        lines.append(
            f"damaged      {len(s['damaged_checkpoints'])} checkpoint(s) could not be loaded "
            "(digest, manifest or fit) and were set aside: "
            f"{', '.join(os.path.basename(p) for p in s['damaged_checkpoints'])} "
            "(inspect, then delete)"
        )
    if s["checkpoint_error"]:
        lines.append(f"checkpoint   last write FAILED: {s['checkpoint_error']}")
    if s["liveness"]:
        lines.append(f"liveness     {s['liveness']}")
    if s.get("note"):
        lines.append(f"note         {s['note']}")
    for d in s["damaged_records"]:
        lines.append(f"warning      {d}: ignored (the run carries on from its checkpoints)")
    lines += _tracker_lines(s)
    if s["mining"]:
        m = s["mining"][-1]
        q = "".join(
            f", {k} {m[k]:.3f}"
            for k in ("nmi", "ari", "pairwise_f", "bcubed_f")
            if m.get(k) is not None
        )
        lines.append(
            f"mining       {len(s['mining'])} round(s); last after epoch {m['epoch']}: "
            f"{m['num_clusters']} clusters, "
            f"{m['num_singletons']} singletons, largest {m['largest_cluster']}{q}"
        )
        if m.get("threshold") is not None:
            lines.append(
                f"threshold    {m['threshold']:.4g} ({m.get('threshold_rule', 'fixed')}); "
                "per round: "
                + ", ".join(
                    f"{r['threshold']:.4g}" for r in s["mining"] if r.get("threshold") is not None
                )
            )
        elif m.get("method"):
            lines.append(f"method       {m['method']}")
        if _curve_summary(m):
            lines.append(f"curve        {_curve_summary(m)}")
        if m.get("hooking_rounds") is not None:  # mining.search=sharded
            lines.append(
                f"graph        across ranks, {m['hooking_rounds']} hooking rounds; {m['engine']}"
            )
    lines += ranks.render(s)
    g = s.get("goodput")
    if g and g["ratio"] is not None:
        lines.append(
            f"goodput      {g['ratio']:.1%} of {g['allocated_gpu_s'] / 3600:.2f} GPU-h allocated "
            f"went into training progress (clusterflow goodput {s['run_dir']})"
        )
    if s["last_loss"] is not None:
        lines.append(f"loss         {s['last_loss']:.4f}")
    if s["error"]:
        lines.append(f"cause        {s['error']}")  # the first cause; then what each rank recorded
    for e in s["errors"]:
        lines.append(f"error        rank {e['rank']} on {e['host']}: {e['error']}")
    if s.get("code"):
        c = s["code"]
        lines.append(
            f"code         {c['module']} frozen at commit {c['commit'] or '(no git)'}"
            + (" with uncommitted changes" if c["dirty"] else "")
            + f" ({c['path']})"
        )
    lines.append(f"logs         {s['logs']}")
    return "\n".join(lines)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.status",
        description="Show what a run is doing.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR|SWEEP_DIR")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (fields in docs/status.md); "
        "for a sweep dir a list, one object per member",
    )
    p.add_argument(
        "--ranks",
        action="store_true",
        help="one row per rank from its heartbeat: step, phase, ages, step time, GPU",
    )
    args = p.parse_args(argv)
    target = rundir.RunPaths(args.run_dir)
    if sweep_index.is_sweep_dir(target):
        rows = sweep_status.collect(target, collect)
        print(
            json.dumps(rows, indent=1)
            if args.json
            else sweep_status.render(rows, sweep_status.keys_of(target))
        )
        return EXIT_OK
    s = collect(target)
    print(json.dumps(s, indent=1) if args.json else ranks.table(s) if args.ranks else render(s))
    return EXIT_OK
