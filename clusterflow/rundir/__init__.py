"""The run directory: its file names, its records, who may use it, its saved config and code.

- ``paths.py``: :class:`RunPaths`, the name of every file in a run dir (the layout is there);
- ``states.py``: the run states and stop reasons, and which states are ended;
- ``transitions.py``: the one writer of status.json: the state's transitions and their table;
- ``records.py``: the records' schemas, attempts, stops, per-rank errors, damage-proof readers;
- ``first_error.py``: the attempt's first cause, recorded once;
- ``restarts.py``: restarts inside a job's allocation, and the time each took to train again;
- ``faults.py``: each attempt's fault (what ended it, when, the time to train again, from where);
- ``submissions.py``: which Slurm job holds the run now (submissions and attempts);
- ``cancel_marker.py``: a user cancelled the run, for good;
- ``lease.py``: one job per run dir;
- ``saved_config.py``: config.yaml (portable, resumed, replaced or refused);
- ``frozen_code.py``: the task's code frozen at submission;
- ``preflight.py``: are the run dir and the checkpoint dir usable, before anything is written.

``from clusterflow import rundir`` then ``rundir.RunPaths(...)``; the state changes only by
``transitions.mark_*`` (``from clusterflow.rundir import transitions``).
"""

from clusterflow.rundir.paths import RunPaths
from clusterflow.rundir.records import (
    NODE_FAILURE,
    append_jsonl,
    attempt_count,
    count_stops,
    current_attempt,
    excluded_nodes,
    open_jsonl,
    read_json,
    read_jsonl,
    read_object,
    record_attempt,
    record_stop,
    write_error,
    write_ledger,
)

__all__ = [
    "NODE_FAILURE",
    "RunPaths",
    "append_jsonl",
    "attempt_count",
    "count_stops",
    "current_attempt",
    "excluded_nodes",
    "open_jsonl",
    "read_json",
    "read_jsonl",
    "read_object",
    "record_attempt",
    "record_stop",
    "write_error",
    "write_ledger",
]
