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


def _checkpoints(run_dir: str, cfg_dir: str | None) -> tuple[list[str], list[str]]:
    """Committed steps (oldest first), and the damaged ones the store set aside."""
    from clusterflow.store import CheckpointStore

    try:
        store = CheckpointStore(cfg_dir or rundir.path(run_dir, "checkpoints"))
        return [store.url_of(s) for s in store.steps()], store.damaged()
    except Exception:  # noqa: BLE001 - an unreachable remote store must not break status
        return [], []


def collect(run_dir: str) -> dict[str, Any]:
    if not os.path.isdir(run_dir):
        raise UserError(f"run dir {run_dir!r} does not exist; pass the run.dir of a submitted run")
    if not os.path.exists(rundir.path(run_dir, rundir.CONFIG)):
        raise UserError(f"{run_dir!r} has no config.yaml, so it is not a clusterflow run dir")
    st = rundir.read_json(rundir.path(run_dir, "status.json"), {}) or {}
    attempts = rundir.read_jsonl(rundir.path(run_dir, "attempts.jsonl"))
    import yaml

    with open(rundir.path(run_dir, rundir.CONFIG), encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    ckdir = (cfg.get("checkpoint") or {}).get("dir") or None
    cks, damaged = _checkpoints(run_dir, ckdir)
    last = attempts[-1] if attempts else {}
    job_id = str(last.get("job_id") or st.get("job_id") or "")
    state = st.get("state") or ("pending" if not attempts else "running")
    queue = _squeue_state(job_id)
    if queue is not None:
        qstate = queue.split("|")[0] if queue else ""
        if qstate == "PENDING":
            state = "requeued" if attempts else "pending"
        elif qstate in ("RUNNING", "COMPLETING", "CONFIGURING"):
            state = "running"
        elif qstate == "" and state == "running":
            state = "failed"  # left the queue without writing an outcome: killed or crashed
    errors = []
    err_dir = rundir.path(run_dir, "errors")
    if os.path.isdir(err_dir):
        for name in sorted(os.listdir(err_dir)):
            e = rundir.read_json(os.path.join(err_dir, name))
            if e and e.get("time", 0) >= last.get("started_at", 0):
                errors.append({k: e[k] for k in ("rank", "host", "error")})
    latest = cks[-1] if cks else None
    age = None
    if latest and os.path.exists(latest):
        age = time.time() - os.path.getmtime(latest)
    return {
        "state": state,
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
        "latest_checkpoint_age_s": age,
        "checkpoints": cks,
        "damaged_checkpoints": damaged,
        "mining": [{k: m.get(k) for k in ("epoch", "num_clusters", "num_singletons", "largest_cluster", "nmi", "ari",
                                          "pairwise_f", "bcubed_f") if k in m} | {"seconds": (m.get("seconds") or {}).get("total")}
                   for m in st.get("mining", [])],
        "eval": st.get("eval", {}),
        "last_loss": st.get("last_loss"),
        "errors": errors,
        "error": st.get("error"),
        "logs": rundir.path(run_dir, "logs"),
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
        lines.append(f"damaged      {len(s['damaged_checkpoints'])} checkpoint(s) failed their sha256 check and were set aside: "
                     f"{', '.join(os.path.basename(p) for p in s['damaged_checkpoints'])} (inspect, then delete)")
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
