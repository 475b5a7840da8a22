"""Tasks the Slurm tests run: the demo task plus one misbehaviour each.

Each trains exactly like PseudoIDTask (same weights at every step), so their final ``model.pt``
can be compared bitwise with a plain run of the same config.
"""

import os
import time

import torch.distributed as tdist

from clusterflow import store
from clusterflow.tasks.pseudo_id import PseudoIDTask


class CrashOnRank1(PseudoIDTask):
    """Raises on rank 1 at its third step."""

    calls = 0

    def loss(self, model, batch, labels):
        self.calls += 1
        if tdist.is_initialized() and tdist.get_rank() == 1 and self.calls == 3:
            raise ValueError("deliberate failure in the test task")
        return super().loss(model, batch, labels)


class Slow(PseudoIDTask):
    """Sleeps ``step_sleep`` seconds per step, so a test can signal a run in mid-epoch."""

    def __init__(self, seed=0, step_sleep=0.5, **params):
        super().__init__(seed, **params)
        self.step_sleep = float(step_sleep)

    def loss(self, model, batch, labels):
        time.sleep(self.step_sleep)
        return super().loss(model, batch, labels)


class HangInSave(Slow):
    """Rank 0 writes half of ``model.pt`` for step ``hang_at_step``, then hangs until killed.

    The half-written folder is what a writer killed mid-checkpoint leaves behind; the test sees it
    appear, then SIGKILLs the whole job. It hangs once per run directory.
    """

    def __init__(self, seed=0, hang_at_step=12, **params):
        super().__init__(seed, **params)
        marker = f"{os.sep}.tmp-step-{int(hang_at_step)}-"
        plain_write = store.CheckpointStore._write

        def write(self_, path, data):
            # Hang once per run dir: the resubmitted run writes this step again and must get through.
            done = os.path.join(os.path.dirname(self_.root.rstrip("/")), "hang-in-save.done")
            if marker in path and path.endswith("model.pt") and not os.path.exists(done):
                open(done, "w").close()
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                time.sleep(3600)
            return plain_write(self_, path, data)

        store.CheckpointStore._write = write
