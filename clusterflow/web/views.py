"""What each page gets, as JSON: chosen fields of what the owners of each fact returned
(``status.collect``, the goodput ledger, the sweep rows, NVML's snapshot), never a file read
here. Only the fields named below leave the server: the config, a script's arguments and a
sweep's values only with every secret masked by ``config/masking.py``'s rule (``configs.py``
shows the config), no environment.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterable
from typing import Any

from clusterflow.config import masking
from clusterflow.launch import gpus as gpu_choice
from clusterflow.manage import goodput as goodput_command
from clusterflow.manage import sweep_status
from clusterflow.observe import goodput
from clusterflow.rundir import faults
from clusterflow.sweeps import index as sweep_index
from clusterflow.sweeps import sweep as sweep_axes
from clusterflow.web import configs
from clusterflow.web.catalog import Catalog, RunEntry, Sweep
from clusterflow.web.discover import ident

# Runs one compare page shows at most (each one's metrics are followed while it is open).
MAX_COMPARED = 32
# Differing keys a run's legend names at most.
LEGEND_KEYS = 4

# A Runs page row's fields of status (a row is light: 200 of them make the page).
ROW = (
    "state",
    "note",
    "error",
    "job_id",
    "epoch",
    "current_epoch",
    "epochs",
    "global_step",
    "step_in_epoch",
    "steps_per_epoch",
    "max_steps",  # a loop of run.steps(max_steps): its unit is the step
    "attempts",
    "world_size",
    "last_loss",
)
# What a run's page adds.
SUMMARY = (
    "liveness",
    "alive",
    "hosts",
    "excluded_nodes",
    "updated_at",
    "checkpoint_error",
    "damaged_records",
    "stalled",
    "ranks_summary",
)
RANK = (
    "rank",
    "host",
    "pid",
    "step",
    "phase",
    "time",
    "progress_at",
    "heartbeat_s",
    "step_time_s",
    "busy_s",
    "busy_ratio",
    "median_busy_s",
    "gpu_index",
    "gpu_name",
    "gpu_mem_used_mb",
    "gpu_mem_total_mb",
    "gpu_util_pct",
    "gpu_temp_c",
    "cpu_percent",
    "rss_bytes",
    "data_wait_fraction",
    "silent",
    "straggler",
)
ATTEMPT = (
    "attempt",
    "job_id",
    "ranks",
    "outcome",
    "queued_at",
    "ended_at",
    "wall_s",
    "seconds",
    "ratio",
    "steps",
    "restart_in_job",
    "fault",
    "stragglers",
)
FIRST_ERROR = ("rank", "host", "error", "kind", "time", "step", "phase")
ERROR = ("rank", "host", "error")


def clean(value: object) -> object:
    """JSON the browser can parse: NaN and infinities (a diverged loss) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return cleaned(value)
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def cleaned(fields: dict[str, Any]) -> dict[str, Any]:
    """:func:`clean` of each value."""
    return {str(k): clean(v) for k, v in fields.items()}


def _pick(source: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {k: source.get(k) for k in keys if k in source}


def _last_heartbeat(ranks: list[dict[str, Any]]) -> float | None:
    times = [r["time"] for r in ranks if isinstance(r.get("time"), (int, float))]
    return max(times) if times else None


def row(run: RunEntry) -> dict[str, Any]:
    """One line of the Runs page."""
    s = run.status or {}
    good = s.get("goodput") or {}
    ranks = s.get("ranks") or []
    return cleaned(
        {
            "id": run.id,
            "name": run.name,
            "sweep": None if run.found.sweep is None else ident(run.found.sweep),
            "problem": run.problem,
            **_pick(s, ROW),
            "goodput": good.get("ratio"),
            "last_heartbeat": _last_heartbeat(ranks),
            "stragglers": sum(1 for r in ranks if r.get("straggler")),
            "silent": sum(1 for r in ranks if r.get("silent")),
            "stalled": bool(s.get("stalled")),
        }
    )


def sweep(entry: Sweep, runs: dict[str, RunEntry]) -> dict[str, Any]:
    """A sweep's group on the Runs page: its keys and one row per member
    (``manage.sweep_status.rows``), with the member's run id when it has a run dir."""
    index = entry.index
    if index is None:
        return {"id": entry.id, "name": entry.name, "problem": entry.problem, "members": []}
    dirs = sweep_index.member_dirs(entry.paths, index)
    by_root = {os.path.realpath(r.paths.root): r for r in runs.values() if r.found.sweep}
    statuses = {}
    ids = {}
    for name, paths in dirs.items():
        run = by_root.get(os.path.realpath(paths.root))
        statuses[name] = run.status if run is not None else None
        ids[name] = run.id if run is not None else None
    members = sweep_status.rows(dirs, index, statuses)
    shown = []
    for m in members:
        values = {k: m.get(k) for k in index.get("keys", [])}
        shown.append(
            {
                "member": m["member"],
                "id": ids.get(m["member"]),
                "values": {k: sweep_status.show(v) for k, v in values.items()},
                **_pick(
                    m,
                    ("state", "current_epoch", "global_step", "last_loss", "nmi", "ari", "job_id"),
                ),
            }
        )
    return cleaned(
        {
            "id": entry.id,
            "name": entry.name,
            "keys": list(index.get("keys", [])),
            "problem": entry.problem,
            "members": shown,
        }
    )


def runs_page(catalog: Catalog) -> dict[str, Any]:
    """Everything the Runs page shows."""
    runs = dict(catalog.runs)
    return {
        "runs": [row(r) for r in sorted(runs.values(), key=lambda r: r.name)],
        "sweeps": [sweep(s, runs) for s in sorted(catalog.sweeps.values(), key=lambda s: s.name)],
        "gpus": gpus(catalog),
        "truncated": catalog.finder.truncated,
        # What was searched, for a page that found nothing (0 folders: not searched yet).
        "paths": list(catalog.finder.roots),
        "searched": catalog.finder.searched,
    }


def detail(run: RunEntry) -> dict[str, Any]:
    """A run's page, but for its feeds (metrics and logs, sent as they grow)."""
    s = run.status or {}
    ledger = run.ledger or {}
    attempts = []
    for a in ledger.get("attempts", []):
        shown = _pick(a, ATTEMPT)
        first = run.first_errors.get(a["attempt"])
        shown["first_error"] = _pick(first, FIRST_ERROR) if first else None
        attempts.append(shown)
    code = s.get("code") or {}
    return cleaned(
        {
            **row(run),
            **_pick(s, SUMMARY),
            "run_dir": run.paths.root,
            "ranks": [_pick(r, RANK) for r in s.get("ranks") or []],
            "stragglers_named": s.get("stragglers") or [],
            "restarts": s.get("restarts") or [],
            "errors": [_pick(e, ERROR) for e in s.get("errors") or []],
            "attempts_detail": attempts,
            "goodput_total": _pick(ledger.get("total") or {}, ("seconds", "ratio", "wall_s")),
            "goodput_warnings": ledger.get("warnings") or [],
            "fault_labels": {str(k): v for k, v in faults.LABELS.items()},
            "categories": list(goodput.CATEGORIES),
            "labels": goodput.LABELS,
            "colours": goodput_command.COLOURS,
            "mining": [_round(m) for m in s.get("mining") or []],
            "samples": s.get("samples"),
            "checkpoints": [os.path.basename(c) for c in s.get("checkpoints") or []],
            "damaged_checkpoints": [
                os.path.basename(c) for c in s.get("damaged_checkpoints") or []
            ],
            "code": _pick(code, ("module", "commit", "dirty")),
            "eval": s.get("eval") or {},
            "job": s.get("job"),
            "steps_left": s.get("steps_left"),
            "eta_s": s.get("eta_s"),
            "config": configs.rows(run.config),
            "script": _script(s.get("script")),
        }
    )


def _script(script: dict[str, Any] | None) -> dict[str, Any] | None:
    """A script's path and arguments (status's), secrets in them masked."""
    if not script:
        return None
    return {
        "path": masking.mask_text(str(script.get("path") or "")),
        "args": masking.mask_args(script.get("args") or []),
    }


def compare(catalog: Catalog, ids: Iterable[str], sweep_id: str | None = None) -> dict[str, Any]:
    """The compare page: the runs ``ids`` (those under the dashboard's paths, in the order
    given, at most :data:`MAX_COMPARED`), or the members of the sweep ``sweep_id``; the config
    keys that tell them apart, each run's values of them (its legend), and for a sweep its swept
    keys with each member's value."""
    runs = dict(catalog.runs)
    entry = catalog.sweeps.get(sweep_id) if sweep_id else None
    swept: dict[str, Any] | None = None
    if entry is not None and entry.index is not None:
        by_root = {os.path.realpath(r.paths.root): r.id for r in runs.values() if r.found.sweep}
        members = sweep_index.member_dirs(entry.paths, entry.index)
        wanted = [
            by_root[k] for k in (os.path.realpath(p.root) for p in members.values()) if k in by_root
        ]
        keys = list(entry.index.get("keys", []))
        names = {by_root.get(os.path.realpath(p.root)): n for n, p in members.items()}
        given = {
            m.get("name"): m.get("values") or {}
            for m in entry.index.get("members", [])
            if isinstance(m, dict)
        }
        swept = {"id": entry.id, "name": entry.name, "keys": keys, "values": {}}
        for key in keys:
            swept["values"][key] = {
                i: _swept(key, given.get(names[i], {}).get(key)) for i in wanted if i in names
            }
    else:
        wanted = list(dict.fromkeys(i for i in ids if i in runs))
    shown = wanted[:MAX_COMPARED]
    differ = configs.differing({i: runs[i].config for i in shown})
    out = []
    for i in shown:
        run = runs[i]
        flat = configs.flatten(run.config)
        out.append(
            {
                "id": run.id,
                "name": run.name,
                **_pick(run.status or {}, ("state", "epoch", "global_step", "last_loss")),
                "legend": configs.legend(
                    run.config, (swept or {}).get("keys") or differ[:LEGEND_KEYS]
                ),
                "values": {k: _value(k, flat.get(k)) for k in differ},
            }
        )
    return cleaned(
        {
            "runs": out,
            "keys": differ,
            "sweep": swept,
            "left_out": len(wanted) - len(shown),
        }
    )


def _value(key: str, value: object) -> object:
    """A config value a chart can place: a number as it is, anything else as the page shows it
    (a secret masked)."""
    if _number(value) and not masking.is_secret(key):
        return value
    return None if value is None else configs.shown(key, value)


def _swept(key: str, value: object) -> object:
    """A sweep member's value of its swept ``key`` (a config key, or ``arg:NAME``) as a chart
    places it: a number as it is, anything else as the Runs page shows it (a secret masked)."""
    if value is None:
        return None
    masked = sweep_axes.shown_value(key, value)
    return masked if _number(masked) else configs.text(masked)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _round(m: dict[str, Any]) -> dict[str, Any]:
    """A mining round; its cluster-size histogram as [bin, count] pairs, smallest clusters first
    (status.json keeps its keys sorted as text: "10-19" before "2")."""
    hist = m.get("size_histogram")
    pairs = [[str(k), v] for k, v in hist.items()] if isinstance(hist, dict) else []
    return {**m, "size_histogram": sorted(pairs, key=_lower_bound)}


def _lower_bound(pair: list[Any]) -> int:
    """The smallest size of a histogram bin named "5-9" or "1" (unnamed ones last)."""
    head = pair[0].split("-", 1)[0]
    return int(head) if head.isdigit() else 2**62


def gpus(catalog: Catalog) -> list[dict[str, Any]] | None:
    """Every GPU NVML sees on this machine: memory, utilisation, whether ``submit --local``
    would take it (``launch.gpus.classify``), and the run and rank holding it (its heartbeats name
    their process); None without NVML."""
    snapshot = catalog.gpus
    if snapshot is None:
        return None
    host = socket.gethostname()
    holders: dict[int, tuple[RunEntry, int]] = {}
    for run in list(catalog.runs.values()):
        for r in (run.status or {}).get("ranks") or []:
            if r.get("host") == host and isinstance(r.get("pid"), int) and not r.get("silent"):
                holders[r["pid"]] = (run, r["rank"])
    out = []
    for g in snapshot:
        usable, why = gpu_choice.classify(g, gpu_choice.MIN_FREE_MB)
        procs = []
        for p in g.get("processes") or []:
            held = holders.get(p.get("pid"))
            procs.append(
                {
                    "pid": p.get("pid"),
                    "name": p.get("name"),
                    "used_mb": p.get("used_mb"),
                    "run": held[0].name if held else None,
                    "run_id": held[0].id if held else None,
                    "rank": held[1] if held else None,
                }
            )
        out.append(
            {
                **_pick(
                    g,
                    (
                        "index",
                        "name",
                        "memory_total_mb",
                        "memory_used_mb",
                        "util_pct",
                        "temp_c",
                    ),
                ),
                "free": usable,
                "why": why,
                "processes": procs,
            }
        )
    return [cleaned(g) for g in out]
