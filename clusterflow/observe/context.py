"""What every part of one attempt of a job shares, handed to each part as one object.

The saves, the checkpointer, the reporter and the mining stage each read the run's config, its
folder, the attempt's number and the phase clock they mark their time on
(:class:`~clusterflow.observe.phases.Phases`). The run (``train/session.py``) builds one
:class:`JobContext` per attempt and hands the same one to each part, so a part's constructor
names what is its own and no part holds a different view of the job than another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusterflow.config.job_config import Config
from clusterflow.observe.phases import Phases
from clusterflow.rundir.paths import RunPaths


@dataclass(frozen=True)
class JobContext:
    """``cfg``: the run's config; ``paths``: its folder's files; ``attempt``: this attempt's
    number (0 for the first); ``phases``: the phase clock every part of the rank marks its
    stretches of work on (a fresh one where a part runs on its own, as in a test)."""

    cfg: Config
    paths: RunPaths
    attempt: int = 0
    phases: Phases = field(default_factory=Phases)
