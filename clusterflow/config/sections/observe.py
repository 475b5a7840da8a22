"""What a job tells the outside while it runs (``observe.*``).

Read by ``observe/observer.py`` (the straggler watch) and ``observe/events.py`` (the command run
on the run's events). Every key applies to a task and to a
script.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.config.sections.fields import RESOURCE, YEAR_S, check, doc


@dataclass
class ObserveConfig:
    """Watching the ranks while they train (docs/goodput.md)."""

    straggler_ratio: float = doc(
        1.2,
        "Name a rank a straggler (in its log, status --ranks, the goodput ledger and "
        "RUN_DIR/stragglers.jsonl) when its own part of a training step stays above this many "
        "times the other ranks' median for observe.straggler_window_s; 0: off. Read from the "
        "heartbeats by rank 0's heartbeat thread (needs dist.heartbeat_s > 0): no collective.",
        kind=RESOURCE,
        why="which ranks are named slow; not what they compute",
    )
    straggler_window_s: float = doc(
        60.0,
        "How long a rank must stay above observe.straggler_ratio before it is named; at least "
        "dist.heartbeat_s, so that more than one heartbeat decides.",
        kind=RESOURCE,
        why="which ranks are named slow; not what they compute",
    )
    on_event: str = doc(
        "",
        "A shell command run when the run fails, stalls, is requeued (or restarted inside its "
        "allocation) or completes, with CLUSTERFLOW_EVENT (failed|stalled|requeued|completed), "
        "CLUSTERFLOW_RUN_DIR, CLUSTERFLOW_ATTEMPT and CLUSTERFLOW_MESSAGE in its environment "
        "(a mail or a chat webhook is a script of yours); run once per event by rank 0, the "
        "rank that saw it or the batch step's driver, never waited for by training; its output "
        "in RUN_DIR/logs/events.log. Empty: off.",
        kind=RESOURCE,
        why="a command run on the run's events; not what the run computes",
    )

    def __post_init__(self) -> None:
        check(
            "\0" not in self.on_event,
            "observe.on_event",
            self.on_event,
            "must be a shell command without NUL bytes, e.g. 'mail -s run me@example.org'",
        )
        check(
            self.straggler_ratio == 0 or 1 < self.straggler_ratio <= 100,
            "observe.straggler_ratio",
            self.straggler_ratio,
            "must be 0 (off) or above 1 and at most 100, e.g. 1.2 (20% slower than the median)",
        )
        check(
            0 <= self.straggler_window_s <= YEAR_S,
            "observe.straggler_window_s",
            self.straggler_window_s,
            f"must be between 0 and {YEAR_S} seconds, e.g. 60",
        )
