"""A task that raises on rank 1 at its third step: the crash test for Slurm jobs."""

import torch.distributed as tdist

from clusterflow.tasks.pseudo_id import PseudoIDTask


class CrashOnRank1(PseudoIDTask):
    calls = 0

    def loss(self, model, batch, labels):
        self.calls += 1
        if tdist.is_initialized() and tdist.get_rank() == 1 and self.calls == 3:
            raise ValueError("deliberate failure in the test task")
        return super().loss(model, batch, labels)
