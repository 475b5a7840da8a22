"""What a job tells the outside while it runs (``observe.*``).

Read by ``observe/observer.py`` (the straggler watch). Every key applies to a task and to a
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

    def __post_init__(self) -> None:
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
