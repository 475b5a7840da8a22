"""Tasks the Slurm tests run: the demo task plus one misbehaviour each.

Each trains exactly like PseudoIDTask (same weights at every step), so their final ``model.pt``
can be compared bitwise with a plain run of the same config.
"""

import os
import signal
import time

import torch.distributed as tdist

from clusterflow import durable
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
        plain_write = durable.write_file

        def write(path, payload, fsync=True, fs=None):
            # Hang once per run dir: the resubmitted run writes this step again and must get through.
            run_dir = os.path.dirname(os.path.dirname(os.path.dirname(path)))  # RUN/checkpoints/.tmp-step-N-*/model.pt
            done = os.path.join(run_dir, "hang-in-save.done")
            if marker in path and path.endswith("model.pt") and not os.path.exists(done):
                open(done, "w").close()
                data = payload if isinstance(payload, bytes) else durable.serialize(payload)
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                time.sleep(3600)
            return plain_write(path, payload, fsync, fs)

        durable.write_file = write


class Signals(PseudoIDTask):
    """Sends itself signals at chosen loss calls of chosen attempts, like a scheduler would.

    ``signals``: ``"ATTEMPT:CALL:SIG,..."``, e.g. ``"0:6:TERM,1:1:KILL"``: SIGTERM during the 6th
    loss call of attempt 0, SIGKILL at the 1st of attempt 1. Calls are counted per process (one per
    optimizer step with grad_accum 1), attempts from ``RUN_DIR/attempts.jsonl``.
    """

    def __init__(self, seed=0, run_dir="", signals="", **params):
        super().__init__(seed, **params)
        self.run_dir, self.calls, self.plan = run_dir, 0, {}
        for item in filter(None, signals.split(",")):
            attempt, call, sig = item.split(":")
            self.plan[(int(attempt), int(call))] = getattr(signal, f"SIG{sig}")

    def loss(self, model, batch, labels):
        self.calls += 1
        with open(os.path.join(self.run_dir, "attempts.jsonl")) as f:
            attempt = len(f.readlines()) - 1
        sig = self.plan.get((attempt, self.calls))
        if sig is not None:
            os.kill(os.getpid(), sig)
        return super().loss(model, batch, labels)


class DropoutSignals(Signals):
    """Signals, with dropout on the input: training draws from the global torch random stream, so
    a resume is exact only if that stream continues exactly where the checkpoint left it."""

    def build_model(self):
        import torch

        return torch.nn.Sequential(torch.nn.Dropout(0.2), super().build_model())
