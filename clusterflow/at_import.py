"""What the process held when it imported clusterflow, before the script's own code after that
import ran: Python's global random stream, which ``clusterflow.start()`` compares with its state
then to tell a seed the script gave it (``train/seeds.py``). The package imports it first; it
imports nothing of clusterflow's."""

from __future__ import annotations

import random

RANDOM = random.getstate()
