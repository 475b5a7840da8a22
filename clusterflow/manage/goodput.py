"""python -m clusterflow.goodput RUN_DIR|SWEEP_DIR [--json] [--plot OUT.png]

Where every allocated second of a run went (``observe/goodput.py`` computes the ledger from the
run's records; this module adds Slurm's times of each job, prints, and draws). docs/goodput.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from clusterflow import rundir
from clusterflow.errors import EXIT_OK, UserError, cli
from clusterflow.observe import goodput
from clusterflow.rundir import records
from clusterflow.slurm import commands as slurm_commands
from clusterflow.slurm.jobids import SLURM_SOURCES, is_slurm_id
from clusterflow.sweeps import index as sweep_index

EXAMPLES = (
    "examples:\n"
    "  python -m clusterflow.goodput runs/demo\n"
    "  python -m clusterflow.goodput runs/demo --json | jq .total.ratio\n"
    "  python -m clusterflow.goodput runs/demo --plot goodput.png   # needs matplotlib\n"
    "  python -m clusterflow.goodput runs/sweep1                   # every member\n"
)
COLOURS = {
    "queue_wait": "#bbbbbb",
    "startup": "#9ecae1",
    "restore": "#3182bd",
    "productive": "#31a354",
    "recomputed": "#fd8d3c",
    "eval": "#756bb1",
    "mining": "#bcbddc",
    "checkpoint_stall": "#e6550d",
    "stalls": "#de2d26",
    "shutdown": "#636363",
    "lost": "#a50f15",
    "other": "#f0f0f0",
}


def slurm_times(paths: rundir.RunPaths) -> dict[str, list[dict[str, Any]]]:
    """Slurm's runs of every job the run's attempts ran in (sacct, else scontrol; none for a
    local run)."""
    attempts, _ = records.read_records(paths.attempts, records.ATTEMPT)
    jobs = {
        str(a.get("job_id"))
        for a in attempts
        if a.get("source") in SLURM_SOURCES and is_slurm_id(str(a.get("job_id") or ""))
    }
    return {job: slurm_commands.job_runs(job)[0] for job in sorted(jobs)}


def book(paths: rundir.RunPaths) -> dict[str, Any]:
    if os.path.exists(paths.root) and not os.path.isdir(paths.root):
        raise UserError(
            f"{paths.root!r} is a file, not a run dir; pass the run.dir of a submitted run "
            "(the folder that holds its config.yaml) or a sweep dir"
        )
    if not os.path.isdir(paths.root):
        raise UserError(
            f"run dir {paths.root!r} does not exist; pass the run.dir of a submitted run"
        )
    if not os.path.exists(paths.config):
        raise UserError(
            f"{paths.root!r} has no config.yaml, so it is not a clusterflow run dir; pass a run.dir"
        )
    return goodput.ledger(paths, slurm_times(paths))


def plot(books: list[dict[str, Any]], out: str) -> None:
    """Each attempt as a bar on a time axis, its categories side by side in ledger order; the
    legend in a row of its own under the axis and its label."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(
            "--plot needs matplotlib, which is not installed; pip install 'clusterflow[plot]'"
        ) from None
    rows = [(b["run_dir"], r) for b in books for r in b["attempts"]]
    bars_in = 0.9 + 0.45 * max(1, len(rows))  # the bars, the ticks and the axis label
    legend_in = 0.6  # two rows of six entries
    fig = plt.figure(figsize=(10, bars_in + legend_in))
    grid = fig.add_gridspec(2, 1, height_ratios=(bars_in, legend_in))
    ax, key = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    t0 = min((r["queued_at"] for _, r in rows), default=0.0)
    for y, (run, r) in enumerate(rows):
        left = r["queued_at"] - t0
        for k in goodput.CATEGORIES:
            width = r["seconds"][k]
            if width > 0:
                ax.barh(y, width, left=left, color=COLOURS[k], edgecolor="none")
            left += width
    ax.set_yticks(range(len(rows)))
    names = [f"{os.path.basename(run.rstrip('/'))} #{r['attempt']}" for run, r in rows]
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first submission")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in goodput.CATEGORIES]
    key.axis("off")
    key.legend(
        handles,
        [goodput.LABELS[k] for k in goodput.CATEGORIES],
        ncol=6,
        fontsize=7,
        loc="center",
        frameon=False,
    )
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise UserError(
            f"--plot {out!r} cannot be written ({exc}); choose a writable path"
        ) from None
    finally:
        plt.close(fig)


def sweep_book(target: rundir.RunPaths) -> dict[str, Any]:
    """One object for a sweep dir: each member that started (has a config.yaml) and their total;
    the members not started yet by name."""
    index = sweep_index.read_index(target) or {}
    dirs = sweep_index.member_dirs(target, index)
    members = [book(d) for d in dirs.values() if os.path.exists(d.config)]
    return {
        "sweep_dir": target.root,
        "members": members,
        "not_started": [name for name, d in dirs.items() if not os.path.exists(d.config)],
        "total": goodput.total_of(members),
    }


def _warnings(b: dict[str, Any]) -> list[str]:
    """A run's damaged records, and the time they left unsplit (``other``)."""
    return [f"warning: {d}: ignored" for d in b["damaged_records"]] + [
        f"warning: {w}" for w in b["warnings"]
    ]


def _shown(b: dict[str, Any]) -> str:
    """One run's table, its warnings under it."""
    return "\n".join([b["run_dir"], goodput.render(b), *_warnings(b)])


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.goodput",
        description="Where every allocated GPU-second of a run went, per attempt and in total.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR|SWEEP_DIR")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object (for a sweep dir: its members and their total)",
    )
    p.add_argument("--plot", metavar="OUT.png", help="draw the attempts as a timeline")
    args = p.parse_args(argv)
    target = rundir.RunPaths(args.run_dir)
    sweep = sweep_book(target) if sweep_index.is_sweep_dir(target) else None
    books = sweep["members"] if sweep is not None else [book(target)]
    if args.plot:
        plot(books, args.plot)
    if args.json:
        print(json.dumps(sweep if sweep is not None else books[0], indent=1))
        for b in books:  # on stderr: stdout is the JSON
            for line in _warnings(b):
                print(line if sweep is None else f"{b['run_dir']}: {line}", file=sys.stderr)
        return EXIT_OK
    text = "\n\n".join(_shown(b) for b in books)
    if sweep is not None:
        text += "\n\n" + goodput.render_sweep(sweep)
    print(text)
    return EXIT_OK
