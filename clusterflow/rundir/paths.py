"""The run directory: every file name in it (:class:`RunPaths`).

Inside ``RUN_DIR``:

    config.yaml                   resolved config, written once by the submitting process
    checkpoints/step-<N>/         committed checkpoints (see ``storage/store.py``), unless
                                  checkpoint.dir says elsewhere
    best                          with checkpoint.keep_best: a symbolic link to the best
                                  checkpoint's folder (a file holding its URL when checkpoints
                                  are not on a local path)
    tb/                           TensorBoard events, a new file per attempt
    metrics.jsonl                 the same scalars as JSON lines (read them with
                                  ``observe/metrics.py``'s ``read_metrics``)
    trackers.json                 each experiment tracker's run id (one tracker run per
                                  clusterflow run) and, for W&B, the last step it holds per tag
                                  (see ``observe/trackers/``)
    wandb/                        W&B's own files (offline runs are synced from here)
    profile/                      train.profile's traces (see ``observe/profiling.py``)
    logs/                         rank<R>.attempt<A>.log per rank and attempt; slurm/ or
                                  submitit/ for the launcher's output; events.log: the output
                                  of observe.on_event's command
    events/attempt<A>.<event>.json
                                  observe.on_event ran for this event of attempt A: when, by
                                  whom (written once, see ``observe/events.py``)
    attempts.jsonl                one line per job start (requeues included), appended by rank 0
    stops.jsonl                   one line per stop on a signal (preempted, timeout), appended
                                  by rank 0
    restarts.jsonl                one line per restart inside a job's allocation, and when its
                                  attempt trained again (see restarts.py)
    faults.jsonl                  a fault no other record names (no progress), one line each
                                  (see faults.py, which reads every attempt's fault)
    submissions.jsonl             one line per Slurm job submit made for this run (see
                                  submissions.py)
    status.json                   the latest progress, rewritten atomically by rank 0
                                  (status.json.lock: its lock)
    cancelled.json                present once a user cancelled the run (see cancel_marker.py)
    errors/rank<R>.json           the exception that ended a rank, written by that rank
    errors/first.attempt<A>.json  the first cause of a failed attempt, written once (see
                                  first_error.py)
    warnings/rank<R>.attempt<A>.txt
                                  every Python warning of that rank and attempt (torch's too),
                                  whole, with where it was raised; the log has one line each
    heartbeats/rank<R>.json       each rank's latest heartbeat (see ``observe/heartbeat.py``)
    inflight/rank<R>.bin          the step each rank is about to train and its slice of that
                                  step's batch, rewritten in place before each batch (see
                                  inflight.py)
    tries.jsonl                   one line per fault that ended an attempt: the step it died
                                  on, whether the run made progress since the fault before,
                                  how many times that step was tried (see tries.py)
    .nodecheck-<host>-<pid>       a node's probe of the run dir before a restart uses it, gone
                                  a moment later (see ``job/nodecheck.py``)
    timeline/attempt<A>.json      when attempt A started, restored, trained its first step,
                                  committed, ended, and its seconds per phase; rewritten by
                                  rank 0 (see timeline.py; the goodput ledger reads it)
    stragglers.jsonl              one line per rank named a straggler (see stragglers.py)
    stalls/attempt<A>/            stacks (rank<R>.stacks.txt) and flight recorder dumps of a
                                  stall (see ``observe/watchdog.py``)
    code/<version>/               the task's code frozen at submission; code/current.json names
                                  the one the next attempt imports (see frozen_code.py)
    sample_ledger.json            per epoch, which ranges of its sample order which attempt
                                  trained, as of the newest committed checkpoint (rewritten by
                                  rank 0 after each commit and at each start; docs/data.md)
    mining/epoch-<E>/             a mining round's embeddings and k-NN blocks until its labels
                                  are committed (see ``mining/rounds.py``)
    model.pt                      the final weights (plain state_dict), written when the run
                                  completes
    model_ema.pt                  the final EMA weights (train.ema_decay > 0), the same form
    lease/gen-<N>.json            which job holds the run dir, renewed while it runs (see
                                  lease.py)
    memory.key                    with checkpoint.memory_every_steps: the random part of the
                                  names of the run's folders under checkpoint.memory_dir, drawn
                                  once, mode 0600 (see ``storage/snapshots.py``)
    config.yaml.damaged-*         a config.yaml that could not be read, set aside (see
                                  saved_config.py)
    check/plan.json               only in the runs of ``clusterflow check``: the step to halt
                                  at, written by the check before each launch; with it every
                                  rank records each step in check/rank<R>.jsonl (see
                                  ``train/probe.py``, ``launch/check.py``)

The small records ``status`` reads (status.json, attempts, stops, errors) are written and read
by records.py.

A sweep's run.dir holds ``sweep.json`` (the index, see ``sweeps/index.py``), ``.sweep.lock`` and
one run dir per member, ``SWEEP_DIR/<member name>/``.

Only local paths are supported for the run dir itself (logs and status need a POSIX filesystem);
checkpoints may live elsewhere through `checkpoint.dir`. Every file here that a reader may open
while it is being replaced goes through ``storage/durable.py``'s ``write_atomic``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from clusterflow.config.job_config import CHECKPOINTS
from clusterflow.storage.names import MODEL


@dataclass(frozen=True)
class RunPaths:
    """The names of everything in one run directory (like submitit's ``JobPaths``)."""

    root: str

    def _p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def config(self) -> str:
        return self._p("config.yaml")

    @property
    def checkpoints(self) -> str:
        return self._p(CHECKPOINTS)

    @property
    def tb(self) -> str:
        return self._p("tb")

    @property
    def metrics(self) -> str:
        return self._p("metrics.jsonl")

    @property
    def profile(self) -> str:
        return self._p("profile")

    @property
    def best(self) -> str:
        return self._p("best")

    @property
    def trackers(self) -> str:
        return self._p("trackers.json")

    @property
    def wandb(self) -> str:
        return self._p("wandb")

    @property
    def logs(self) -> str:
        return self._p("logs")

    @property
    def slurm_logs(self) -> str:
        return self._p("logs", "slurm")

    @property
    def submitit_logs(self) -> str:
        return self._p("logs", "submitit")

    @property
    def attempts(self) -> str:
        return self._p("attempts.jsonl")

    @property
    def stops(self) -> str:
        return self._p("stops.jsonl")

    @property
    def restarts(self) -> str:
        return self._p("restarts.jsonl")

    @property
    def faults(self) -> str:
        return self._p("faults.jsonl")

    @property
    def status(self) -> str:
        return self._p("status.json")

    @property
    def sample_ledger(self) -> str:
        return self._p("sample_ledger.json")

    @property
    def errors(self) -> str:
        return self._p("errors")

    @property
    def mining_rounds(self) -> str:
        return self._p("mining")

    @property
    def model(self) -> str:
        return self._p(MODEL)

    @property
    def model_ema(self) -> str:
        return self._p("model_ema.pt")

    @property
    def lease(self) -> str:
        return self._p("lease")

    @property
    def memory_key(self) -> str:
        return self._p("memory.key")

    @property
    def submissions(self) -> str:
        return self._p("submissions.jsonl")

    @property
    def cancelled(self) -> str:
        return self._p("cancelled.json")

    @property
    def heartbeats(self) -> str:
        return self._p("heartbeats")

    @property
    def timelines(self) -> str:
        return self._p("timeline")

    @property
    def stragglers(self) -> str:
        return self._p("stragglers.jsonl")

    @property
    def code(self) -> str:
        return self._p("code")

    @property
    def code_pointer(self) -> str:
        return self._p("code", "current.json")

    @property
    def sweep_index(self) -> str:
        return self._p("sweep.json")

    @property
    def sweep_lock(self) -> str:
        return self._p(".sweep.lock")

    @property
    def events(self) -> str:
        return self._p("events")

    @property
    def event_log(self) -> str:
        return self._p("logs", "events.log")

    @property
    def check_plan(self) -> str:
        return self._p("check", "plan.json")

    def check_trace(self, rank: int) -> str:
        return self._p("check", f"rank{rank}.jsonl")

    def event_file(self, attempt: int, event: str) -> str:
        return self._p("events", f"attempt{attempt}.{event}.json")

    def log_file(self, rank: int, attempt: int) -> str:
        return self._p("logs", f"rank{rank}.attempt{attempt}.log")

    def error_file(self, rank: int) -> str:
        return self._p("errors", f"rank{rank}.json")

    def first_error_file(self, attempt: int) -> str:
        return self._p("errors", f"first.attempt{attempt}.json")

    def warnings_file(self, rank: int, attempt: int) -> str:
        return self._p("warnings", f"rank{rank}.attempt{attempt}.txt")

    def heartbeat_file(self, rank: int) -> str:
        return self._p("heartbeats", f"rank{rank}.json")

    @property
    def inflight(self) -> str:
        return self._p("inflight")

    def inflight_file(self, rank: int) -> str:
        return self._p("inflight", f"rank{rank}.bin")

    @property
    def tries(self) -> str:
        return self._p("tries.jsonl")

    def node_probe(self, host: str) -> str:
        """A node's probe of the run dir (``job/nodecheck.py`` adds its process id)."""
        return self._p(f".nodecheck-{host}")

    def timeline_file(self, attempt: int) -> str:
        return self._p("timeline", f"attempt{attempt}.json")

    def stalls(self, attempt: int) -> str:
        return self._p("stalls", f"attempt{attempt}")

    def stacks_file(self, rank: int, attempt: int) -> str:
        return self._p("stalls", f"attempt{attempt}", f"rank{rank}.stacks.txt")

    def nccl_trace_prefix(self, attempt: int) -> str:
        """NCCL's own dump on a timeout: torch appends the rank (the name torchfrtrace's
        --prefix reads)."""
        return self._p("stalls", f"attempt{attempt}", "nccl_trace_rank_")

    def code_version(self, version: str) -> str:
        return self._p("code", version)

    def member(self, name: str) -> str:
        """A sweep member's run dir, inside the sweep's run.dir."""
        return self._p(name)
