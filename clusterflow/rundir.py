"""The run directory: its layout, and the small JSON records that `status` reads.

    RUN_DIR/config.yaml            resolved config, written once by the submitting process
    RUN_DIR/checkpoints/step-<N>/  committed checkpoints (see store.py)
    RUN_DIR/tb/                    TensorBoard events, a new file per attempt
    RUN_DIR/logs/                  rank<R>.attempt<A>.log per rank and attempt; slurm/ for Slurm's own output
    RUN_DIR/attempts.jsonl         one line per job start (requeues included), appended by rank 0
    RUN_DIR/status.json            the latest progress, rewritten atomically by rank 0
    RUN_DIR/errors/rank<R>.json    the exception that ended a rank, written by that rank
    RUN_DIR/model.pt               the final weights (plain state_dict), written when the run completes

Only local paths are supported for the run dir itself (logs and status need a POSIX filesystem);
checkpoints may live elsewhere through `checkpoint.dir`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

CONFIG = "config.yaml"


def path(run_dir: str, *parts: str) -> str:
    return os.path.join(run_dir, *parts)


def write_atomic(target: str, text: str) -> None:
    """Write a small file so readers see the old or the new content, never half of it."""
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target) or ".", prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read_json(target: str, default: Any = None) -> Any:
    try:
        with open(target, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def read_jsonl(target: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(target, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by a kill mid-write; the rest is still good
    except FileNotFoundError:
        pass
    return out


def append_jsonl(target: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    with open(target, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def record_attempt(run_dir: str, **fields: Any) -> int:
    """Append this job start to attempts.jsonl; returns its 0-based attempt number."""
    target = path(run_dir, "attempts.jsonl")
    n = len(read_jsonl(target))
    append_jsonl(target, {"attempt": n, "started_at": time.time(), **fields})
    return n


def write_status(run_dir: str, **fields: Any) -> None:
    current = read_json(path(run_dir, "status.json"), {}) or {}
    current.update(fields, updated_at=time.time())
    write_atomic(path(run_dir, "status.json"), json.dumps(current, indent=1, sort_keys=True))


def write_error(run_dir: str, rank: int, host: str, error: str, trace: str) -> None:
    write_atomic(
        path(run_dir, "errors", f"rank{rank}.json"),
        json.dumps({"rank": rank, "host": host, "error": error, "traceback": trace, "time": time.time()}, indent=1),
    )


def log_file(run_dir: str, rank: int, attempt: int) -> str:
    return path(run_dir, "logs", f"rank{rank}.attempt{attempt}.log")
