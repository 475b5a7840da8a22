"""``RUN_DIR/metrics.jsonl`` read back: one value per (step, tag), as TensorBoard shows them.

The writer (``metrics.py``'s ``TensorBoardWriter``, rank 0) appends one row per log call,
``{"step": 12, "attempt": 1, "time": 1795308219.7, "train/loss": 0.41, ...}`` (``time``: when it
was logged, seconds since 1970; rows of older versions have none), and at the start of each
attempt a marker
``{"step": S, "attempt": A, "purge_step": S}``: what earlier attempts logged at or after ``S`` is
dropped, since the attempt logs those steps again (TensorBoard's purge_step does the same with
the event files). A later row wins over an earlier one at the same (step, tag). :func:`fold` is
that rule for one row, so a reader that follows the file as it grows (the dashboard) and one that
reads it whole (:func:`read`) agree. Torch-free: the login side reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from clusterflow.rundir import records
from clusterflow.rundir.paths import RunPaths

# The fields of a row that are no scalar.
ROW_KEYS = ("step", "attempt", "purge_step", "time")


def _is_step(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def fold(
    table: MutableMapping[int, dict[str, float]],
    row: Mapping[str, object],
    times: MutableMapping[int, float] | None = None,
) -> bool | None:
    """Apply one row to ``{step: {tag: value}}`` (and, with ``times``, ``{step: when it was last
    logged}``): True when it dropped steps (an attempt's purge marker), False otherwise, None
    when the row is not a metrics row (no step, or a step that is no integer) and changed
    nothing. A value that is no number is left out."""
    purge = row.get("purge_step")
    if purge is not None:
        if not _is_step(purge):
            return None
        dropped = [s for s in table if s >= purge]
        for s in dropped:
            del table[s]
            if times is not None:
                times.pop(s, None)
        return bool(dropped)
    step = row.get("step")
    if not _is_step(step):
        return None
    when = row.get("time")
    if times is not None and isinstance(when, (int, float)) and not isinstance(when, bool):
        times[step] = float(when)
    values = {
        k: float(v)
        for k, v in row.items()
        if k not in ROW_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    table.setdefault(step, {}).update(values)
    return False


def read(paths: RunPaths) -> dict[int, dict[str, float]]:
    """The whole file by :func:`fold`, steps in order."""
    out: dict[int, dict[str, float]] = {}
    for row in records.read_jsonl(paths.metrics):
        fold(out, row)
    return dict(sorted(out.items()))
