"""python -m clusterflow.status RUN_DIR [--json]

What a run is doing, from its run directory (and squeue, when it answers within a few seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from clusterflow import rundir
from clusterflow.errors import EXIT_OK, UserError, cli

EXAMPLES = """examples:
  python -m clusterflow.status runs/demo
  python -m clusterflow.status runs/demo --json | jq .state
"""


def _squeue_state(job_id: str) -> str | None:
    if not job_id or not job_id.isdigit() or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True, timeout=5)
    except (subprocess.TimeoutExpired, OSError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or ""  # "" means: not in the queue any more


def _checkpoints(paths: rundir.RunPaths, cfg_dir: str | None) -> tuple[list[str], list[str]]:
    """Committed steps (oldest first), and the damaged ones the store set aside."""
    from clusterflow.store import CheckpointStore

    try:
        store = CheckpointStore(cfg_dir or paths.checkpoints)
        return [store.url_of(s) for s in store.steps()], store.damaged()
    except Exception:  # noqa: BLE001 - an unreachable remote store must not break status
        return [], []


def _state(st: dict[str, Any], attempts: list[dict[str, Any]], job_id: str) -> str:
    """The run's state from status.json, corrected by what squeue says (when it answers)."""
    state = st.get("state") or ("pending" if not attempts else "running")
    queue = _squeue_state(job_id)
    if queue is None:
        return state
    qstate = queue.split("|")[0] if queue else ""
    if qstate == "PENDING":
        return "requeued" if attempts else "pending"
    if qstate in ("RUNNING", "COMPLETING", "CONFIGURING"):
        return "running"
    if qstate == "" and state == "running":
        return "failed"  # left the queue without writing an outcome: killed or crashed
    return state


def _errors(paths: rundir.RunPaths, since: float) -> list[dict[str, Any]]:
    """What ended each rank of the last attempt."""
    errors = []
    if os.path.isdir(paths.errors):
        for name in sorted(os.listdir(paths.errors)):
            e = rundir.read_json(os.path.join(paths.errors, name))
            if e and e.get("time", 0) >= since:
                errors.append({k: e[k] for k in ("rank", "host", "error")})
    return errors


def _mining(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("epoch", "num_clusters", "num_singletons", "largest_cluster", "nmi", "ari", "pairwise_f", "bcubed_f")
    return [{k: m.get(k) for k in keys if k in m} | {"seconds": (m.get("seconds") or {}).get("total")} for m in rounds]


def collect(run_dir: str) -> dict[str, Any]:
    paths = rundir.RunPaths(run_dir)
    if not os.path.isdir(run_dir):
        raise UserError(f"run dir {run_dir!r} does not exist; pass the run.dir of a submitted run")
    if not os.path.exists(paths.config):
        raise UserError(f"{run_dir!r} has no config.yaml, so it is not a clusterflow run dir")
    st = rundir.read_json(paths.status, {}) or {}
    attempts = rundir.read_jsonl(paths.attempts)
    import yaml

    with open(paths.config, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    cks, damaged = _checkpoints(paths, (cfg.get("checkpoint") or {}).get("dir") or None)
    last = attempts[-1] if attempts else {}
    job_id = str(last.get("job_id") or st.get("job_id") or "")
    latest = cks[-1] if cks else None
    return {
        "state": _state(st, attempts, job_id),
        "run_dir": run_dir,
        "job_id": job_id,
        "epoch": st.get("epoch", 0),
        "global_step": st.get("global_step", 0),
        "step_in_epoch": st.get("step_in_epoch", 0),
        "steps_per_epoch": st.get("steps_per_epoch"),
        "attempts": len(attempts),
        "world_size": st.get("world_size", last.get("world_size")),
        "hosts": st.get("hosts") or sorted(set(last.get("hosts") or [])),
        "latest_checkpoint": latest,
        "latest_checkpoint_age_s": time.time() - os.path.getmtime(latest) if latest and os.path.exists(latest) else None,
        "checkpoints": cks,
        "damaged_checkpoints": damaged,
        "checkpoint_error": st.get("checkpoint_error"),
        "mining": _mining(st.get("mining", [])),
        "eval": st.get("eval", {}),
        "last_loss": st.get("last_loss"),
        "errors": _errors(paths, last.get("started_at", 0)),
        "error": st.get("error"),
        "logs": paths.logs,
        "updated_at": st.get("updated_at"),
    }


def render(s: dict[str, Any]) -> str:
    lines = [f"state        {s['state']}" + (f"  (job {s['job_id']})" if s["job_id"] else ""),
             f"attempts     {s['attempts']}",
             f"progress     epoch {s['epoch']}, step {s['step_in_epoch']}/{s['steps_per_epoch']} of the epoch, global step {s['global_step']}",
             f"world        {s['world_size']} rank(s) on {', '.join(s['hosts']) or '?'}"]
    if s["latest_checkpoint"]:
        age = f" ({s['latest_checkpoint_age_s']:.0f} s old)" if s["latest_checkpoint_age_s"] is not None else ""
        lines.append(f"checkpoint   {s['latest_checkpoint']}{age}; {len(s['checkpoints'])} kept")
    else:
        lines.append("checkpoint   none yet")
    if s["damaged_checkpoints"]:
        lines.append(f"damaged      {len(s['damaged_checkpoints'])} checkpoint(s) failed their digest check and were set aside: "
                     f"{', '.join(os.path.basename(p) for p in s['damaged_checkpoints'])} (inspect, then delete)")
    if s["checkpoint_error"]:
        lines.append(f"checkpoint   last write FAILED: {s['checkpoint_error']}")
    if s["mining"]:
        m = s["mining"][-1]
        q = "".join(f", {k} {m[k]:.3f}" for k in ("nmi", "ari", "pairwise_f", "bcubed_f") if m.get(k) is not None)
        lines.append(f"mining       {len(s['mining'])} round(s); last after epoch {m['epoch']}: {m['num_clusters']} clusters, "
                     f"{m['num_singletons']} singletons, largest {m['largest_cluster']}{q}")
    if s["last_loss"] is not None:
        lines.append(f"loss         {s['last_loss']:.4f}")
    for e in s["errors"]:
        lines.append(f"error        rank {e['rank']} on {e['host']}: {e['error']}")
    if s["error"] and not s["errors"]:
        lines.append(f"error        {s['error']}")
    lines.append(f"logs         {s['logs']}")
    return "\n".join(lines)


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clusterflow.status", description="Show what a run is doing.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print one JSON object (fields in docs/status.md)")
    args = p.parse_args(argv)
    s = collect(args.run_dir)
    print(json.dumps(s, indent=1) if args.json else render(s))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
