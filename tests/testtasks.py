"""Tasks the Slurm tests run: the demo task plus one misbehaviour each.

Each trains exactly like PseudoIDTask (same weights at every step), so their final ``model.pt``
can be compared bitwise with a plain run of the same config.
"""

import ctypes
import hashlib
import json
import os
import signal
import socket
import threading
import time

import torch
import torch.distributed as tdist

from clusterflow.mining import knn
from clusterflow.storage import durable, tensors
from clusterflow.tasks import images
from clusterflow.tasks.images import ImageFolderTask, ImageShardsTask
from clusterflow.tasks.pseudo_id import PseudoIDTask, SyntheticIdentities


class CrashOnRank1(PseudoIDTask):
    """Raises on rank 1 at its third step."""

    calls = 0

    def loss(self, model, batch, labels):
        self.calls += 1
        if tdist.is_initialized() and tdist.get_rank() == 1 and self.calls == 3:
            raise ValueError("deliberate failure in the test task")
        return super().loss(model, batch, labels)


class KilledThenCrashOnRank1(CrashOnRank1):
    """Rank 1 SIGKILLs itself at its second step in the run's first attempt (``run_dir``), as a
    rank killed from outside dies; in every later attempt it raises at its third step as
    CrashOnRank1 does: one job restarts after the kill, then fails on the task's own error."""

    def __init__(self, seed=0, run_dir="", **params):
        super().__init__(seed, **params)
        self.run_dir = run_dir

    def loss(self, model, batch, labels):
        rank1 = tdist.is_initialized() and tdist.get_rank() == 1
        # the second call: CrashOnRank1 counts this one next
        if rank1 and self.calls == 1 and attempt_of(self.run_dir) == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch, labels)


class AbortInLoss(PseudoIDTask):
    """Aborts (SIGABRT, as a library's failed assertion in native code does) at its second
    step."""

    calls = 0

    def loss(self, model, batch, labels):
        self.calls += 1
        if self.calls == 2:
            os.abort()
        return super().loss(model, batch, labels)


def attempt_of(run_dir):
    """The attempt this process runs: one line of ``RUN_DIR/attempts.jsonl`` per attempt begun
    (its own is there before its first step)."""
    with open(os.path.join(run_dir, "attempts.jsonl")) as f:
        return len(f.readlines()) - 1


class Slow(PseudoIDTask):
    """Sleeps ``step_sleep`` seconds per step, so a test can signal a run in mid-epoch. With
    ``slow_attempts`` N >= 0 (and ``run_dir``), only attempts 0..N-1 are slow: the attempts after
    the test's last signal train at full speed."""

    def __init__(self, seed=0, step_sleep=0.5, run_dir="", slow_attempts=-1, **params):
        super().__init__(seed, **params)
        self.step_sleep = float(step_sleep)
        self._slow_run_dir, self._slow_attempts = run_dir, int(slow_attempts)
        self._slow = None

    def slow(self):
        """Whether this attempt is slowed (asked at its first step, then remembered)."""
        if self._slow is None:
            self._slow = self._slow_attempts < 0 or (
                attempt_of(self._slow_run_dir) < self._slow_attempts
            )
        return self._slow

    def loss(self, model, batch, labels):
        if self.slow():
            time.sleep(self.step_sleep)
        return super().loss(model, batch, labels)


class Gated(Slow):
    """Slow, and every loss call waits while the file ``gate`` exists (at most ``hold_s``): a test
    keeps the run in training for as long as its checks take, whatever the machine's load, then
    removes the file and lets it finish. Waiting changes no number the run computes."""

    def __init__(self, seed=0, step_sleep=0.0, gate="", hold_s=300.0, **params):
        super().__init__(seed, step_sleep, **params)
        self.gate, self.hold_s = gate, float(hold_s)

    def loss(self, model, batch, labels):
        until = time.monotonic() + self.hold_s
        while self.gate and os.path.exists(self.gate) and time.monotonic() < until:
            time.sleep(0.1)
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

        def write(path, payload, fsync=True, fs=None, codec=None, **options):
            # Hang once per run dir: the resubmitted run writes this step again and must get
            # through.
            run_dir = os.path.dirname(
                os.path.dirname(os.path.dirname(path))
            )  # RUN/checkpoints/.tmp-step-N-*/model.pt
            done = os.path.join(run_dir, "hang-in-save.done")
            if marker in path and path.endswith("model.pt") and not os.path.exists(done):
                open(done, "w").close()
                data = payload if isinstance(payload, bytes) else tensors.serialize(payload)
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                time.sleep(3600)
            return plain_write(path, payload, fsync, fs, codec, **options)

        durable.write_file = write


class SlowSave(Slow):
    """Slow, and every checkpoint write of ``model.pt`` takes ``save_sleep`` seconds longer (a
    large state on a slow filesystem): a save longer than Slurm's --signal lead; in the slowed
    attempts only (``slow_attempts``). Sleeping changes no byte written."""

    def __init__(self, seed=0, save_sleep=2.0, **params):
        super().__init__(seed, **params)
        delay = float(save_sleep)
        plain_write = durable.write_file

        def write(path, payload, fsync=True, fs=None, codec=None, **options):
            if f"{os.sep}.tmp-step-" in path and path.endswith("model.pt") and self.slow():
                time.sleep(delay)
            return plain_write(path, payload, fsync, fs, codec, **options)

        durable.write_file = write


class HangInShardedSave(Slow):
    """train.parallel=fsdp: rank 1 writes its shards of step ``hang_at_step`` into the staging
    folder, then hangs until killed (rank 0 waits for it before committing); with
    checkpoint.async the hang is on the writer's thread and both ranks train on. Once per run
    dir."""

    def __init__(self, seed=0, hang_at_step=8, **params):
        super().__init__(seed, **params)
        from clusterflow.checkpoint import sharded

        marker = f"{os.sep}.tmp-step-{int(hang_at_step)}-"
        plain_write = sharded.ShardedState.write

        def write(state, folder, fsync, *rest):
            listed = plain_write(state, folder, fsync, *rest)
            done = os.path.join(os.path.dirname(os.path.dirname(folder)), "hang-in-save.done")
            if marker in folder and tdist.get_rank() == 1 and not os.path.exists(done):
                open(done, "w").close()
                time.sleep(3600)
            return listed

        sharded.ShardedState.write = write


class NoShard(PseudoIDTask):
    """A task whose model cannot be sharded."""

    shard_units = None


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


class SignalInMining(PseudoIDTask):
    """Sends itself a signal inside a mining round, like a scheduler would.

    ``at``: ``"ATTEMPT:RANK:WHERE:N:SIG,..."``; RANK a number or ``*``; WHERE ``embed`` (during the
    N-th embedding batch of the process) or ``block`` (after the N-th k-NN query block the process
    computed, once it is handed to the round's files). E.g. ``"0:*:embed:1:TERM,1:0:block:3:TERM"``.
    ``commit_every_s`` (>= 0): the round's files commit finished blocks at that interval.
    """

    def __init__(self, seed=0, run_dir="", at="", commit_every_s=-1.0, **params):
        super().__init__(seed, **params)
        self.run_dir, self.counts, self.plan = run_dir, {"embed": 0, "block": 0}, {}
        for item in filter(None, at.split(",")):
            attempt, rank, where, n, sig = item.split(":")
            self.plan[(int(attempt), rank, where, int(n))] = getattr(signal, f"SIG{sig}")
        from clusterflow.mining import rounds as mining_rounds

        task, put = self, mining_rounds.SearchBlocks.put

        def counted_put(blocks, start, sims, ids):
            put(blocks, start, sims, ids)
            task._tick("block")

        mining_rounds.SearchBlocks.put = counted_put
        if float(commit_every_s) >= 0:  # blocks on disk before a SIGKILL can flush them
            blocks_of = mining_rounds.RoundFiles.search_blocks
            mining_rounds.RoundFiles.search_blocks = lambda files: blocks_of(
                files, float(commit_every_s)
            )

    def _tick(self, where):
        self.counts[where] += 1
        with open(os.path.join(self.run_dir, "attempts.jsonl")) as f:
            attempt = len(f.readlines()) - 1
        rank = str(tdist.get_rank() if tdist.is_initialized() else 0)
        for who in (rank, "*"):
            sig = self.plan.get((attempt, who, where, self.counts[where]))
            if sig is not None:
                os.kill(os.getpid(), sig)

    def embed(self, model, batch):
        self._tick("embed")
        return super().embed(model, batch)


class NanAt(PseudoIDTask):
    """A corrupt batch: the loss is NaN at the chosen optimizer steps (``nan_at``: "4" or "4,9",
    counted per process and attempt, one loss call per step with grad_accum 1); SIGTERM to itself
    at call ``term_at`` (0: never), like a preemption right after the bad step."""

    def __init__(self, seed=0, nan_at="", term_at=0, **params):
        super().__init__(seed, **params)
        self.nan_at = {int(s) for s in str(nan_at).split(",") if s}
        self.term_at, self.calls = int(term_at), 0

    def loss(self, model, batch, labels):
        self.calls += 1
        loss, metrics = super().loss(model, batch, labels)
        if self.calls == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return (loss * float("nan") if self.calls in self.nan_at else loss), metrics


class KillAtEnv(PseudoIDTask):
    """SIGKILLs itself at loss call ``$CLUSTERFLOW_TEST_KILL_AT`` (counted per process) when that is
    set in its environment, and otherwise trains as PseudoIDTask: a test kills one launch at an
    exact step and resumes with another launch of the very same config.
    ``$CLUSTERFLOW_TEST_KILL_RANK`` limits it to one rank (e.g. 1: a rank that dies while its peers
    wait). ``$CLUSTERFLOW_TEST_KILL_AFTER`` (paths joined by ``os.pathsep``): the kill waits until
    each exists (a replica that must have arrived before the rank dies)."""

    calls = 0

    def loss(self, model, batch, labels):
        self.calls += 1
        at, rank = (
            os.environ.get("CLUSTERFLOW_TEST_KILL_AT"),
            os.environ.get("CLUSTERFLOW_TEST_KILL_RANK"),
        )
        me = tdist.get_rank() if tdist.is_initialized() else 0
        if at and self.calls == int(at) and (rank is None or int(rank) == me):
            after = [
                p for p in os.environ.get("CLUSTERFLOW_TEST_KILL_AFTER", "").split(os.pathsep) if p
            ]
            deadline = time.monotonic() + 300
            while not all(os.path.exists(p) for p in after) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch, labels)


class Tiny(PseudoIDTask):
    """``size`` samples of 8 numbers and a two-layer model: a run of a few steps takes well under a
    second. ``fail_in`` names a method that raises (the user's code failing); ``size`` is checked
    the way a task should check its parameters (a UserError, exit 2)."""

    def __init__(self, seed: int = 0, size: int = 16, fail_in: str = "", hidden: int = 8) -> None:
        from clusterflow.errors import UserError

        if not 4 <= size <= 256:
            raise UserError(f"task.params.size = {size}: must be between 4 and 256")
        super().__init__(
            seed,
            identities=2,
            samples_per_identity=size // 2,
            input_dim=8,
            hidden=hidden,
            embed_dim=4,
        )
        self.fail_in = fail_in
        self._fail("__init__")

    def _fail(self, where):
        if self.fail_in == where:
            raise ValueError(f"deliberate failure in {where}")

    def build_model(self):
        self._fail("build_model")
        return super().build_model()

    def train_dataset(self):
        self._fail("train_dataset")
        return super().train_dataset()

    def loss(self, model, batch, labels):
        self._fail("loss")
        return super().loss(model, batch, labels)


class FillDisk(Tiny):
    """At its ``at_call``-th loss call, fills the filesystem of ``path`` (another program using the
    disk), leaving ``leave_kb`` free: the next checkpoint cannot be written. Once per ``path``
    (a marker beside it remembers), so the same command can resume after the user frees space."""

    def __init__(
        self, seed: int = 0, path: str = "", at_call: int = 3, leave_kb: int = 64, **params
    ) -> None:
        super().__init__(seed, **params)
        self.path, self.at_call, self.leave, self.calls = path, at_call, leave_kb << 10, 0

    def loss(self, model, batch, labels):
        self.calls += 1
        if self.calls == self.at_call and not os.path.exists(self.path + ".filled"):
            import shutil

            open(self.path + ".filled", "w").close()

            free = shutil.disk_usage(os.path.dirname(self.path)).free
            with open(self.path, "wb") as f:
                f.write(b"\0" * max(0, free - self.leave))
        return super().loss(model, batch, labels)


class DropoutSignals(Signals):
    """Signals, with dropout on the input: training draws from the global torch random stream, so
    a resume is exact only if that stream continues exactly where the checkpoint left it."""

    def build_model(self):
        import torch

        return torch.nn.Sequential(torch.nn.Dropout(0.2), super().build_model())


def sleeping_in_loss():
    """Where a stalled rank sleeps: the watchdog's stack must name this function."""
    time.sleep(3600)


def sleeping_in_embed():
    time.sleep(3600)


def hanging_in_knn_search():
    """Where rank 0's k-NN search hangs (a FAISS call that never returns, a dead filesystem)."""
    time.sleep(3600)


class HangInSearchOnRank0(PseudoIDTask):
    """Trains like PseudoIDTask; rank 0's first k-NN search never returns, while the other ranks
    wait for its labels."""

    def __init__(self, seed=0, **params):
        super().__init__(seed, **params)
        search = knn.search

        def hanging(*args, **kwargs):
            if tdist.is_initialized() and tdist.get_rank() == 0:
                hanging_in_knn_search()
            return search(*args, **kwargs)

        knn.search = hanging


class StallOnRank1(PseudoIDTask):
    """Rank ``rank`` sleeps forever in ``sleeping_in_loss`` at its loss call ``at`` (1-based, per
    process), or, with ``in_embed``, in ``sleeping_in_embed`` at its first embedding batch; the
    others wait for it in the next collective. Optional ``step_sleep`` slows every step (a running
    job to look at)."""

    calls = 0

    def __init__(self, seed=0, at=3, rank=1, in_embed=False, step_sleep=0.0, **params):
        super().__init__(seed, **params)
        self.at, self.rank, self.in_embed, self.step_sleep = (
            int(at),
            int(rank),
            bool(in_embed),
            float(step_sleep),
        )

    def _me(self):
        return tdist.get_rank() if tdist.is_initialized() else 0

    def loss(self, model, batch, labels):
        self.calls += 1
        if not self.in_embed and self.calls == self.at and self._me() == self.rank:
            sleeping_in_loss()
        time.sleep(self.step_sleep)
        return super().loss(model, batch, labels)

    def embed(self, model, batch):
        if self.in_embed and self._me() == self.rank:
            sleeping_in_embed()
        return super().embed(model, batch)


class TermDuringScan(ImageFolderTask):
    """An ImageFolderTask that receives SIGTERM while it scans ``task.params.root``, as a job
    stopped during a long dataset scan does: the signal arrives when the scan enters the first
    class folder."""

    def __init__(self, seed=0, **params):
        walk = images._images_under

        def signalled(folder, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            images._images_under = walk
            return walk(folder, *args, **kwargs)

        images._images_under = signalled
        super().__init__(seed, **params)


class DumpRestored(Signals):
    """Signals, and at the first loss call of every attempt after the first, before any step:
    the whole model's parameters, gathered by every rank (``full_tensor`` of each shard), saved
    by rank 0 as ``RUN_DIR/restored-attempt<N>.pt``: what the resume restored."""

    def loss(self, model, batch, labels):
        if self.calls == 0:
            with open(os.path.join(self.run_dir, "attempts.jsonl")) as f:
                attempt = len(f.readlines()) - 1
            if attempt > 0:
                full = {
                    n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for n, p in model.named_parameters()
                }
                if tdist.get_rank() == 0:
                    torch.save(full, os.path.join(self.run_dir, f"restored-attempt{attempt}.pt"))
        return super().loss(model, batch, labels)


class KillWhenFileAppears(PseudoIDTask):
    """At loss call ``at`` of the first attempt (counted per process), waits until ``kill_file``
    exists, then SIGKILLs itself: a test kills a run at an exact step once something outside it
    has happened (e.g. a tracker received the previous steps)."""

    def __init__(self, seed=0, run_dir="", kill_file="", at=10, **params):
        super().__init__(seed, **params)
        self.run_dir, self.kill_file, self.at, self.calls = run_dir, kill_file, int(at), 0

    def loss(self, model, batch, labels):
        self.calls += 1
        with open(os.path.join(self.run_dir, "attempts.jsonl")) as f:
            first = len(f.readlines()) == 1
        if first and self.calls == self.at:
            while not os.path.exists(self.kill_file):
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch, labels)


def ecc_error():
    """The error PyTorch raises for a GPU's uncorrectable ECC error."""
    return RuntimeError(
        "CUDA error: uncorrectable ECC error encountered\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so "
        "the stacktrace below might be incorrect."
    )


class StallOnHost(StallOnRank1):
    """StallOnRank1 on the node ``host`` only: elsewhere it trains like PseudoIDTask."""

    def __init__(self, seed=0, host="", **params):
        super().__init__(seed, **params)
        self.host = str(host)

    def _me(self):
        return super()._me() if socket.gethostname() == self.host else -1


class DeviceErrorThenStall(StallOnHost):
    """Two bad nodes for one run: at the loss call ``at`` (1-based, per process) every process on
    ``device_host`` raises a GPU's uncorrectable ECC error (as DeviceErrorOnHost), and rank 1 on
    ``host`` sleeps forever (StallOnHost); elsewhere it trains like PseudoIDTask."""

    def __init__(self, seed=0, device_host="", **params):
        super().__init__(seed, **params)
        self.device_host = str(device_host)

    def loss(self, model, batch, labels):
        if self.calls + 1 == self.at and socket.gethostname() == self.device_host:
            raise ecc_error()
        return super().loss(model, batch, labels)


class _Seen:
    """Records every batch the task trains on, and SIGKILLs itself at chosen loss calls.

    Each loss call appends ``{"attempt", "epoch", "call", "index"}`` to
    ``RUN_DIR/seen/rank<R>.jsonl`` (before training on it: a batch of a step killed in mid-air is
    recorded too). ``kill``: ``"ATTEMPT@CALL,..."``, SIGKILL at loss call CALL (counted per
    process) of attempt ATTEMPT, on every rank; ``"ATTEMPT@CALL/RANK"``: on that rank only (after
    the task's ``step_sleep``, if it has one: what the previous step started has finished).
    ``gates``: a folder; a kill in attempt A then waits until the file ``gates/A`` exists, and so
    does every rank at the loss calls ``hold`` names (``"ATTEMPT@CALL,..."``): the test decides
    when (after a standby is ready, after it froze one, after it signalled the job)."""

    def _seen_setup(self, run_dir, kill, gates="", hold=""):
        self.run_dir, self.calls, self.epoch_now = run_dir, 0, 0
        self.gates = str(gates)
        self.kill_at = {}
        for item in str(kill).split(","):
            if item:
                at, _, rank = item.partition("/")
                attempt, call = (int(x) for x in at.split("@"))
                self.kill_at[(attempt, call)] = int(rank) if rank else None
        self.hold_at = {tuple(int(x) for x in i.split("@")) for i in str(hold).split(",") if i}

    def _gate(self, attempt):
        while self.gates and not os.path.exists(os.path.join(self.gates, str(attempt))):
            time.sleep(0.05)

    def set_epoch(self, epoch):
        self.epoch_now = epoch
        super().set_epoch(epoch)

    def loss(self, model, batch, labels):
        self.calls += 1
        with open(os.path.join(self.run_dir, "attempts.jsonl")) as f:
            attempt = len(f.readlines()) - 1
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        os.makedirs(os.path.join(self.run_dir, "seen"), exist_ok=True)
        with open(os.path.join(self.run_dir, "seen", f"rank{rank}.jsonl"), "a") as f:
            record = {
                "attempt": attempt,
                "epoch": self.epoch_now,
                "call": self.calls,
                "index": batch["index"].tolist(),
            }
            f.write(json.dumps(record) + "\n")
        if (attempt, self.calls) in self.hold_at:
            self._gate(attempt)
        if (attempt, self.calls) in self.kill_at and self.kill_at[(attempt, self.calls)] in (
            None,
            rank,
        ):
            time.sleep(getattr(self, "step_sleep", 0.0))
            self._gate(attempt)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch, labels)


class SeenPseudoID(_Seen, PseudoIDTask):
    """PseudoIDTask (data in memory) that records its batches (``_Seen``)."""

    def __init__(self, seed=0, run_dir="", kill="", **params):
        super().__init__(seed, **params)
        self._seen_setup(run_dir, kill)


class SeenSlow(_Seen, Slow):
    """Slow (``step_sleep`` per step) and recording its batches (``_Seen``)."""

    def __init__(self, seed=0, run_dir="", kill="", step_sleep=0.3, gates="", hold="", **params):
        super().__init__(seed, step_sleep, run_dir, **params)
        self._seen_setup(run_dir, kill, gates, hold)


class SeenShards(_Seen, ImageShardsTask):
    """ImageShardsTask that records its batches (``_Seen``)."""

    def __init__(self, seed=0, run_dir="", kill="", **params):
        super().__init__(seed, **params)
        self._seen_setup(run_dir, kill)


class SeenFolder(_Seen, ImageFolderTask):
    """ImageFolderTask that records its batches (``_Seen``)."""

    def __init__(self, seed=0, run_dir="", kill="", **params):
        super().__init__(seed, **params)
        self._seen_setup(run_dir, kill)


class SeenFromFile(_Seen, PseudoIDTask):
    """A user's task whose data is whatever a file says now: ``identities`` is read from
    ``data_file`` (so the dataset's length can change without a change of config); its dataset
    offers no digest, only its length."""

    def __init__(self, seed=0, run_dir="", kill="", data_file="", **params):
        with open(data_file) as f:
            identities = int(f.read())
        super().__init__(seed, identities=identities, **params)
        self._seen_setup(run_dir, kill)


class LeakFiles(PseudoIDTask):
    """At its second loss call, opens /dev/null until the process has no file descriptor left
    (and keeps them): whatever opens a file next (a checkpoint, TensorBoard) fails with EMFILE."""

    calls = 0

    def loss(self, model, batch, labels):
        self.calls += 1
        if self.calls == 2:
            self.held = []
            try:
                while True:
                    self.held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
        return super().loss(model, batch, labels)


class KillAtEnvThenSignalInMining(KillAtEnv, SignalInMining):
    """KillAtEnv's SIGKILL in training (the launch whose environment asks for it), and
    SignalInMining's signals inside the mining rounds of the attempts ``at`` names."""


class WarnsInBuild(Tiny):
    """Raises a warning of many lines while building its model, as torch's internals do."""

    def build_model(self):
        import warnings

        warnings.warn(
            "first line of a long warning\nsecond line, torch internals\nthird line",
            UserWarning,
        )
        return super().build_model()


class SlowRankKill(KillAtEnv):
    """KillAtEnv that sleeps ``step_sleep`` seconds per loss call, ``slow_factor`` times as long on
    rank ``slow_rank`` (-1: no rank is slower): a straggler on purpose, for the straggler watch
    and the goodput ledger."""

    def __init__(self, seed=0, step_sleep=0.1, slow_rank=-1, slow_factor=1.5, **params):
        super().__init__(seed, **params)
        self.step_sleep, self.slow_rank = float(step_sleep), int(slow_rank)
        self.slow_factor = float(slow_factor)

    def loss(self, model, batch, labels):
        me = tdist.get_rank() if tdist.is_initialized() else 0
        time.sleep(self.step_sleep * (self.slow_factor if me == self.slow_rank else 1.0))
        return super().loss(model, batch, labels)


class FailAtStart(SlowRankKill):
    """SlowRankKill that raises while it is built when ``$CLUSTERFLOW_TEST_FAIL_START=1``: the
    attempt dies in start-up, seconds after its processes started and before its first record
    (the goodput ledger's start-up death)."""

    def __init__(self, seed=0, **params):
        if os.environ.get("CLUSTERFLOW_TEST_FAIL_START"):
            raise RuntimeError("the task failed while it was built (CLUSTERFLOW_TEST_FAIL_START)")
        super().__init__(seed, **params)


class MemoryProbe:
    """Two linear layers, 64 -> 256 -> 8, on ``size`` random samples: a model whose memory is
    known by hand (tests/test_gpu_select.py's estimate checks)."""

    def __init__(self, seed=0, size=64):
        self.seed, self.size = seed, int(size)

    def build_model(self):
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
        )

    def train_dataset(self):
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.size, 64, generator=g)
        return [{"x": x[i], "index": i} for i in range(self.size)]

    def loss(self, model, batch, labels):
        return model(batch["x"]).pow(2).mean(), {}


class UnusedParameter(Tiny):
    """A model with a layer its loss never uses (a head kept for later): DDP finds no gradient
    for it, which needs ``dist.find_unused_parameters``."""

    def build_model(self):
        import torch

        model = super().build_model()
        model.spare_head = torch.nn.Linear(4, 4)
        return model


def _own_rank():
    return tdist.get_rank() if tdist.is_initialized() else int(os.environ.get("RANK", "0"))


class _SlowItems(SyntheticIdentities):
    """The same samples, each ``fetch_sleep`` seconds late: a dataset the loop waits for."""

    fetch_sleep = 0.0

    def __getitem__(self, i):
        time.sleep(self.fetch_sleep)
        return super().__getitem__(i)


class Unequal(PseudoIDTask):
    """Every step sleeps ``step_sleep`` seconds (a GPU's time, costing no CPU); rank
    ``hungry_rank`` also keeps a core busy on a thread of its own (hashing, which releases the
    GIL, so the loop itself is not slowed), and rank ``starved_rank`` reads each sample
    ``fetch_sleep`` seconds late: the efficiency figures of its heartbeats must tell them apart."""

    def __init__(
        self, seed=0, step_sleep=0.05, hungry_rank=-1, starved_rank=-1, fetch_sleep=0.0, **params
    ):
        super().__init__(seed, **params)
        self.step_sleep, self.hungry_rank = float(step_sleep), int(hungry_rank)
        self.starved_rank, self.fetch_sleep = int(starved_rank), float(fetch_sleep)
        if _own_rank() == self.hungry_rank:
            threading.Thread(target=_burn, daemon=True).start()

    def train_dataset(self):
        if self._train is None and _own_rank() == self.starved_rank:
            self._train = _SlowItems(self.seed, **self.data_args, split=0)
            self._train.fetch_sleep = self.fetch_sleep
        return super().train_dataset()

    def loss(self, model, batch, labels):
        time.sleep(self.step_sleep)
        return super().loss(model, batch, labels)


def _burn():
    block = b"x" * (1 << 20)
    while True:
        hashlib.sha256(block).digest()


class FailWhenFileAppears(Slow):
    """Slow, and its loss raises once the file ``fail_file`` exists: a run that fails when the
    test says so (a dashboard's notification of a marked run's failure)."""

    def __init__(self, seed=0, step_sleep=0.2, fail_file="", **params):
        super().__init__(seed, step_sleep, **params)
        self.fail_file = fail_file

    def loss(self, model, batch, labels):
        if self.fail_file and os.path.exists(self.fail_file):
            raise ValueError(f"failing on purpose: {self.fail_file} appeared")
        return super().loss(model, batch, labels)


class _PoisonedIdentities(SyntheticIdentities):
    """SyntheticIdentities whose sample ``poison`` crashes the process that reads it in epoch
    ``poison_epoch``: a segfault in native code (a read of address 0), as a corrupt record does
    in a C decoder, which no Python handler can catch. With ``poison_file``, the poison is the
    ``{"index", "epoch"}`` that file holds (looked at once a second; none while it is absent):
    a test poisons a sample mid-run and fixes it again."""

    poison, poison_epoch, poison_file = -1, -1, ""
    _looked_at = 0.0

    def __getitem__(self, index):
        if self.poison_file and time.monotonic() - self._looked_at >= 1.0:
            self._looked_at = time.monotonic()
            try:
                with open(self.poison_file) as f:
                    rec = json.load(f)
                self.poison, self.poison_epoch = int(rec["index"]), int(rec["epoch"])
            except (OSError, ValueError, KeyError):
                self.poison = -1
        if index == self.poison and self.epoch == self.poison_epoch:
            ctypes.string_at(0)
        return super().__getitem__(index)


class PoisonedSample(Slow):
    """Slow (``step_sleep`` seconds a step) over a training set whose sample ``poison`` crashes
    the rank that reads it in epoch ``poison_epoch`` (0-based), every time: the run's tries of
    that step end it (``rundir/tries.py``); or the sample ``poison_file`` names while it exists
    (benchmarks/chaos.py). Elsewhere it trains as PseudoIDTask."""

    def __init__(self, seed=0, poison=-1, poison_epoch=1, poison_file="", **params):
        super().__init__(seed, **params)
        self.poison, self.poison_epoch = int(poison), int(poison_epoch)
        self.poison_file = str(poison_file)

    def train_dataset(self):
        if self._train is None:
            self._train = _PoisonedIdentities(self.seed, **self.data_args, split=0)
            self._train.poison, self._train.poison_epoch = self.poison, self.poison_epoch
            self._train.poison_file = self.poison_file
        return self._train
