"""python -m clusterflow.check --script train.py [CONFIG.yaml] [KEY=VALUE ...] [--steps N] [-- ARGS]
python -m clusterflow.check CONFIG.yaml [KEY=VALUE ...] [--steps N]

Does this run resume exactly? The script (or task) runs here, as ``submit --local`` runs it, on
cluster.tasks_per_node processes: N steps uninterrupted, then again killed (SIGKILL of every
process) at a step between two checkpoints and resumed to step N. Every step's loss, learning
rate and batch, and the final state (the model, every registered state, each rank's random
streams) are compared with the uninterrupted run's, tensor by tensor. Exit 0 with a line
beginning "exact", or 1 with one beginning "not exact:" that names the first step that differs,
what differs, and the likely cause in the script's terms (docs/own-loop.md: "What breaks an
exact resume").

The plan (:func:`plan`): checkpoints every N//2 steps (``checkpoint.every_steps``; the epochs'
ends add theirs), the kill half way between the first one and the next, so that the resume
restores a checkpoint before the kill and trains the steps after it again. Three runs: N steps,
the kill's steps, and N minus the checkpoint's: at most 2.25 N steps in all (N=8: 8 + 6 + 4).
The runs get their own run dirs in a folder beside ``run.dir`` (kept when not exact, and with
``--keep``), with ``train.log_every_steps=1`` (each step's loss on its own), no snapshots in
memory (the resume reads the shared checkpoint), and no trackers or ``observe.on_event``
command. What a rank does in them is ``train/probe.py``'s; the tensors are compared by
``checkpoint/compare.py``, which the entry module hands in (this side imports no torch).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Protocol

from clusterflow import rundir
from clusterflow.config.job_config import Config, from_dict
from clusterflow.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_TERMINATED,
    UserError,
)
from clusterflow.launch import gpus, jobs, local
from clusterflow.launch.submit import check_task, prepare_run_dir
from clusterflow.rundir import (
    first_error,
    frozen_code,
    preflight,
    saved_config,
    script_files,
    states,
    timeline,
)
from clusterflow.storage import durable
from clusterflow.storage.store import CheckpointStore

DEFAULT_STEPS = 8
MIN_STEPS = 4
EXIT_NOT_EXACT = 1
EXACT, NOT_EXACT = "exact", "not exact:"

EXAMPLES = (
    "examples:\n"
    "  python -m clusterflow.check --script train.py -- --lr 0.1"
    "              # 8 steps, one process\n"
    "  python -m clusterflow.check --script train.py cluster.tasks_per_node=2 --steps 12"
    " -- --lr 0.1\n"
    "  python -m clusterflow.check configs/demo.yaml --steps 6"
    "                      # a task's run\n"
)


class Compare(Protocol):
    """``checkpoint.compare.differences``: (tensors compared, what differs) between the
    checkpoints of ``step`` under two checkpoint roots."""

    def __call__(self, reference: str, other: str, step: int) -> tuple[int, list[str]]: ...


@dataclass(frozen=True)
class Plan:
    """N steps, a checkpoint every ``every`` steps, the kill at step ``kill``."""

    steps: int
    every: int
    kill: int


def plan(steps: int) -> Plan:
    """The kill half way between the first checkpoint (N//2) and the next, never on one: the
    three runs train 2 N + N//4 steps at most."""
    every = steps // 2
    return Plan(steps, every, every + max(1, every // 2))


# -- one run --------------------------------------------------------------------------------------

# A step's record on one rank (train/probe.py): loss, lr, inputs, carried.
Row = dict[str, Any]
# rank -> step -> its record.
Trace = dict[int, dict[int, Row]]


@dataclass
class Ran:
    """What one launch left: its run dir, the attempt, how it ended (``halted`` at a step,
    ``completed`` at a step) and each rank's records by step."""

    paths: rundir.RunPaths
    checkpoints: str
    attempt: int
    halted: int | None
    completed: int | None
    trace: Trace = field(default_factory=dict)


def _read_trace(paths: rundir.RunPaths, ranks: int, attempt: int) -> tuple[Trace, int | None]:
    """Each rank's records of ``attempt``, and the step they halted at (None: no halt)."""
    trace: Trace = {}
    halted: int | None = None
    for rank in range(ranks):
        rows = rundir.read_jsonl(paths.check_trace(rank), within=paths.root)
        mine = [r for r in rows if r.get("attempt") == attempt]
        trace[rank] = {r["step"]: r for r in mine if isinstance(r.get("step"), int)}
        stops = [r["halted"] for r in mine if isinstance(r.get("halted"), int)]
        if rank == 0 and stops:
            halted = stops[-1]
    return trace, halted


class Runs:
    """The check's runs, in their folder; ``log``: where the launches' own output goes."""

    def __init__(self, cfg: Config, folder: str, chosen: list[int] | None) -> None:
        self.cfg, self.folder, self.chosen = cfg, folder, chosen
        self.log = os.path.join(folder, "launches.log")
        self.ranks = cfg.cluster.tasks_per_node

    def config(self, name: str, every: int) -> Config:
        """The user's config for the check's run ``name``: its own run dir and checkpoints, a
        checkpoint every ``every`` steps, each step logged, nothing sent outside; the files the
        script's arguments name as they are now (a run's first start records them; its resume
        keeps what its start recorded)."""
        data = self.cfg.to_dict()
        if self.cfg.script.files:
            data["script"]["files"] = script_files.named(self.cfg.script.args)
        data["run"]["dir"] = os.path.join(self.folder, name)
        data["checkpoint"].update(dir="", every_steps=every, memory_every_steps=0)
        data["train"].update(log_every_steps=1, progress_bar=False)
        data["trackers"] = {"mlflow": {}, "wandb": {}}
        data["observe"]["on_event"] = ""
        return from_dict(data)

    def launch(self, name: str, every: int, halt_at: int, save: bool) -> Ran:
        """Run ``name`` here (a first start, or its resume) until it halts at ``halt_at`` (saved
        there when ``save``) or completes; ScriptFailed when it fails (naming why), UserError
        when its launch is refused (a changed file, another config), Stopped on Ctrl-C."""
        cfg = self.config(name, every)
        paths = rundir.RunPaths(cfg.run.dir)
        with (
            open(self.log, "a", encoding="utf-8") as out,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(out),
        ):
            print(f"\n== {name}: halt at step {halt_at} ({'saved' if save else 'killed'})")
            cfg, _ = prepare_run_dir(cfg, paths, hold=True)
            os.makedirs(os.path.dirname(paths.check_plan), exist_ok=True)
            durable.write_atomic(paths.check_plan, json.dumps({"halt_at": halt_at, "save": save}))
            frozen_code.take(paths, cfg.task.target, cfg.run.snapshot_code, script=cfg.script.path)
            code = local.submit_local(cfg, paths, self.chosen)
        if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            raise Stopped(code)
        attempt = rundir.current_attempt(paths)
        trace, halted = _read_trace(paths, self.ranks, attempt)
        status, _ = rundir.read_object(paths.status)
        completed = None
        if halted is None and status.get("state") == states.COMPLETED:
            completed = int(status.get("global_step") or 0)
        if halted is None and completed is None:
            why = first_error.cause(paths, status, attempt) or "see its logs"
            raise ScriptFailed(
                f"the script failed in the check's run {name!r} (attempt {attempt}): {why}; "
                f"its logs: {paths.logs}, the launch's output: {self.log}",
                code,
            )
        return Ran(paths, cfg.checkpoint_dir, attempt, halted, completed, trace)


class ScriptFailed(Exception):
    """A run of the check failed (the script raised, or refused its input): the check ends with
    that run's exit status (1, or 2 for bad input) and its cause."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code if code in (EXIT_JOB_FAILED, EXIT_BAD_INPUT) else EXIT_JOB_FAILED


class Stopped(Exception):
    """Ctrl-C or SIGTERM stopped a launch: the check ends with its exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# -- what differs ---------------------------------------------------------------------------------


def _same(a: object, b: object) -> bool:
    """Equal, a NaN loss equal to a NaN loss."""
    return a == b or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    )


@dataclass(frozen=True)
class Difference:
    """The first step at which a run's records differ from the uninterrupted run's: the step,
    the first rank that differs there, and which of its fields differ."""

    step: int
    rank: int
    fields: tuple[str, ...]


def first_difference(reference: Trace, other: Trace, steps: range) -> Difference | None:
    """The first of ``steps`` where ``other``'s records differ from ``reference``'s on a rank
    (a step missing on one side differs)."""
    for step in steps:
        for rank in sorted(reference):
            a, b = reference[rank].get(step), other.get(rank, {}).get(step)
            if a is None or b is None:
                if a is not b:
                    return Difference(step, rank, ("step",))
                continue
            fields = tuple(k for k in ("inputs", "lr", "loss") if not _same(a.get(k), b.get(k)))
            if fields:
                return Difference(step, rank, fields)
    return None


def _loss(row: Row | None) -> str:
    loss = (row or {}).get("loss")
    return "none" if loss is None else f"{loss:.9g}"


def _lr(row: Row | None) -> str:
    lrs = (row or {}).get("lr") or []
    return "none" if not lrs else ", ".join(f"{x:.6g}" for x in lrs)


def _on(rank: int, ranks: int) -> str:
    return f"rank {rank}'s" if ranks > 1 else "the"


@dataclass
class Evidence:
    """What the three runs left, for :func:`verdict`: each one's records, the checkpoint the
    resume restored (``restored``), the files named in the script's arguments as seen before each
    run and after the last, the final states' differences and tensors compared, and a resume
    refused before it trained."""

    plan: Plan
    ranks: int
    reference: Trace
    killed: Trace
    resumed: Trace
    restored: int
    files: list[dict[str, str]]
    final: list[str]
    tensors: int
    refused: str = ""


def _file_changes(seen: list[dict[str, str]]) -> list[str]:
    """``PATH (digest a -> b)`` of each file whose digest changed between two sightings."""
    out = []
    for path in dict.fromkeys(p for s in seen for p in s):
        values = [s.get(path, script_files.GONE) for s in seen]
        changes = [(a, b) for a, b in itertools.pairwise(values) if a != b]
        if changes:
            out.append(f"{path} (digest {changes[0][0]} -> {changes[0][1]})")
    return out


def verdict(e: Evidence) -> tuple[bool, str]:
    """(exact, the line that says so): the first step that differs, what differs there, and the
    likely cause in the script's terms."""
    p, c = e.plan, e.restored
    changed = _file_changes(e.files)
    before = first_difference(e.reference, e.killed, range(1, p.kill + 1))
    after = first_difference(e.reference, e.resumed, range(c + 1, p.steps + 1))
    first = before.step if before else c + 1 if e.refused else after.step if after else p.steps
    if changed:
        refused = "; its resume was refused, as any launch refuses it" if e.refused else ""
        return False, (
            f"{NOT_EXACT} step {first}: {changed[0]}, named in the script's arguments, changed "
            f"while the check ran{refused}: a file read live (the script, or something beside "
            "it, writes a file the run reads); a run's inputs must stay as they were for its "
            "whole life: keep what changes in a registered state, or write it elsewhere"
        )
    if before is not None:
        return False, (
            f"{NOT_EXACT} step {first}: two runs differ before any kill "
            f"({_what(e, before, e.killed)}): the computation is not deterministic: a "
            "nondeterministic kernel (torch.use_deterministic_algorithms(True) names it), the "
            "wall clock, an unseeded random source (os.urandom, uuid, a set's order), or a file "
            "read live"
        )
    if e.refused:
        return False, (
            f"{NOT_EXACT} step {first} (the first after the checkpoint of step {c}): the "
            f"resume was refused: {e.refused}"
        )
    if after is not None:
        return False, _after_resume(e, after)
    if e.final:
        more = f"; and {len(e.final) - 3} more" if len(e.final) > 3 else ""
        return False, (
            f"{NOT_EXACT} step {first} (the final state): {'; '.join(e.final[:3])}{more} "
            "differ, though every step's loss, learning rate and batch were equal: a state no "
            "checkpoint holds fed a registered one after the resume (an unregistered counter or "
            "random generator of the script's own); register it with run.restore(..., name=obj)"
        )
    return True, (
        f"{EXACT}: {p.steps} steps on {e.ranks} rank(s), killed at step {p.kill} (SIGKILL) and "
        f"resumed from the checkpoint of step {c}: every step's loss, learning rate and batch, "
        f"and the final state ({e.tensors} tensors: the model, every registered state, each "
        "rank's random streams) bitwise equal to the uninterrupted run's"
    )


def _what(e: Evidence, d: Difference, other: Trace) -> str:
    a, b = e.reference.get(d.rank, {}).get(d.step), other.get(d.rank, {}).get(d.step)
    on = _on(d.rank, e.ranks)
    if "step" in d.fields:
        return f"{on} step {d.step} ran in {'one run only' if a or b else 'neither'}"
    if "inputs" in d.fields:
        return f"{on} batch differs, loss {_loss(b)} vs {_loss(a)}"
    if "lr" in d.fields:
        return f"the learning rate is {_lr(b)} vs {_lr(a)}"
    return f"{on} loss is {_loss(b)} vs {_loss(a)} on the same batch"


def _after_resume(e: Evidence, d: Difference) -> str:
    """The line for a run whose records agree up to the kill and part after the resume."""
    c = e.restored
    where = f"{NOT_EXACT} step {d.step} (the resume restored step {c}, the kill came at step "
    where += f"{e.plan.kill}): "
    a = e.reference.get(d.rank, {}).get(d.step)
    b = e.resumed.get(d.rank, {}).get(d.step)
    on = _on(d.rank, e.ranks)
    if "step" in d.fields:
        return where + (
            f"{on} step {d.step} ran in one run only: the resumed run stopped or went on "
            "otherwise than the uninterrupted one"
        )
    if "inputs" in d.fields:
        return where + _batch_cause(e, d, a, b)
    if "lr" in d.fields:
        return where + (
            f"the learning rate is {_lr(b)} after the resume and {_lr(a)} in the uninterrupted "
            "run, on the same batch: the schedule follows a counter of the script's own that no "
            "checkpoint holds (an unregistered counter); register it with run.restore(..., "
            "counters=counters), or compute the schedule from run.global_step"
        )
    return where + (
        f"{on} loss is {_loss(b)} after the resume and {_loss(a)} in the uninterrupted run, on "
        "the same batch and learning rate: a state the step uses is not in the checkpoint (a "
        "state not registered: the optimizer, a scheduler, another model or a dict not passed "
        "to run.restore), or a nondeterministic kernel"
    )


def _batch_cause(e: Evidence, d: Difference, a: Row | None, b: Row | None) -> str:
    """Why a batch after the resume differs: carried over from before ``run.step`` (the
    uninterrupted run's forward took a variable the script held, new, at the step before; or
    the resume trains the next step's batch), started over (it is an earlier step's batch), or
    a state of the script's own."""
    on, losses = _on(d.rank, e.ranks), f"loss {_loss(b)} vs {_loss(a)}"
    mine = e.reference.get(d.rank, {})
    carried = list((a or {}).get("carried") or [])
    ahead = mine.get(d.step + 1)
    if carried or (ahead is not None and _same(ahead.get("inputs"), (b or {}).get("inputs"))):
        held = ", ".join(carried)
        how = (
            f"the uninterrupted run's step {d.step} trained {held}, which the script drew during "
            f"step {d.step - 1}, before its run.step, and kept in a variable"
            if carried
            else f"the resume trains the batch the uninterrupted run trained at step {d.step + 1}"
        )
        return (
            f"{on} batch differs ({losses}): {how}: a value drawn before run.step and carried "
            "over to the next step (a prefetch) is in no checkpoint, so the resume draws it "
            "anew, where the random streams are not where they were; draw each step's batch "
            "after the previous "
            "run.step (at the top of the loop)"
        )
    again = [
        s
        for s, row in sorted(mine.items())
        if s < d.step and _same(row.get("inputs"), (b or {}).get("inputs"))
    ]
    if again:
        return (
            f"{on} batch after the resume is the one of step {again[0]} ({losses}): what picks "
            "the batches started over: a counter, position or random generator of the script's "
            "own that no checkpoint holds (an unregistered counter); register it with "
            "run.restore(..., name=obj)"
        )
    return (
        f"{on} batch differs from the uninterrupted run's ({losses}): it follows a state no "
        "checkpoint holds: a counter or position of the script's own (an unregistered counter), "
        "a random generator of its own, or a file read live; register it with "
        "run.restore(..., name=obj)"
    )


# -- the command ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    words, script_args = saved_config.split_script_args(
        list(sys.argv[1:] if argv is None else argv)
    )
    p = argparse.ArgumentParser(
        prog="python -m clusterflow.check",
        description=__doc__.split("\n\n")[1],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional with --script)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument(
        "--script",
        metavar="PATH",
        help="check this training script of your own (it calls clusterflow.start()); the words "
        "after -- are its arguments, passed untouched",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        metavar="N",
        help=f"steps of the uninterrupted run (>= {MIN_STEPS}; default {DEFAULT_STEPS}); the "
        "three runs train at most 2.25 N steps together",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="accepted for submit's command lines: the check always runs here",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the check's run dirs when it finds it exact"
    )
    args = p.parse_intermixed_args(words)
    args.script_args = script_args
    return args


def _folder(cfg: Config) -> str:
    """A new folder for the check's runs, beside run.dir (in runs/ when run.dir is no local
    path)."""
    parent = "runs" if "://" in cfg.run.dir else os.path.dirname(os.path.abspath(cfg.run.dir))
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(os.path.normpath(cfg.run.dir)) or "run"
    return tempfile.mkdtemp(prefix=f"{name}.check-", dir=parent)


def _say(text: str) -> None:
    print(f"check: {text}", flush=True)


def run_check(cfg: Config, steps: int, compare: Compare, folder: str) -> tuple[bool, str]:
    """The three runs of ``cfg`` in ``folder`` and their verdict: (exact, the line)."""
    chosen = gpus.for_local(
        cfg.cluster.gpus_per_node, cfg.cluster.gpus, os.environ, need=lambda: jobs.memory_need(cfg)
    )
    runs = Runs(cfg, folder, chosen)
    what = cfg.script.path or cfg.task.target
    files = [script_files.named(cfg.script.args)]
    p = plan(steps)
    _say(f"{what} on {runs.ranks} process(es): {steps} steps uninterrupted (run 1 of 3)")
    ref = runs.launch("uninterrupted", p.every, p.steps, save=True)
    if ref.completed is not None and ref.completed < steps:
        if ref.completed < MIN_STEPS:
            raise UserError(
                f"{what} completed after {ref.completed} step(s), fewer than the check needs "
                f"({MIN_STEPS}): give it arguments that train at least {MIN_STEPS} steps"
            )
        _say(f"it completed at step {ref.completed}: the check compares {ref.completed} steps")
        p = plan(ref.completed)
    files.append(script_files.named(cfg.script.args))
    _say(f"killed at step {p.kill}, between checkpoints (run 2 of 3)")
    killed = runs.launch("resumed", p.every, p.kill, save=False)
    files.append(script_files.named(cfg.script.args))
    refused, resumed = "", None
    _say(f"resumed to step {p.steps} (run 3 of 3)")
    try:
        resumed = runs.launch("resumed", p.every, p.steps, save=True)
    except UserError as exc:  # refused before it started: a changed file, another config
        refused = str(exc)
    files.append(script_files.named(cfg.script.args))
    restored = _restored(killed, resumed is not None)
    tensors, final = 0, []
    if resumed is not None:
        try:
            tensors, final = compare(ref.checkpoints, resumed.checkpoints, p.steps)
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(
                f"the final checkpoints (step {p.steps}) of {ref.checkpoints} and "
                f"{resumed.checkpoints} could not be compared: {exc}"
            ) from None
    evidence = Evidence(
        p,
        runs.ranks,
        ref.trace,
        killed.trace,
        resumed.trace if resumed is not None else {},
        restored,
        files,
        final,
        tensors,
        refused,
    )
    exact, line = verdict(evidence)
    if not exact and final:
        line += f"\nthe final state differs in: {by_state(final)}"
    return exact, line


def by_state(found: list[str]) -> str:
    """``compare.differences``'s list, by registered state: ``model (4 entries, e.g. ...);
    rng of rank 0 (1 entry, ...)``."""
    groups: dict[str, list[str]] = {}
    for entry in found:
        groups.setdefault(entry.split("[", 1)[0].split(" (", 1)[0], []).append(entry)
    return "; ".join(
        f"{name} ({len(items)} {'entry' if len(items) == 1 else 'entries'}, e.g. {items[0]})"
        for name, items in groups.items()
    )


def _restored(killed: Ran, resumed: bool) -> int:
    """The step the resume restored (its timeline's record), or, when no resume ran, the newest
    checkpoint the killed run committed: the one it would have restored."""
    if resumed:
        rec = timeline.read_all(killed.paths).records.get(killed.attempt + 1) or {}
        return int(rec.get("restored_step") or 0)
    return max(CheckpointStore(killed.checkpoints).steps(), default=0)


def main(argv: list[str] | None, compare: Compare) -> int:
    args = parse_args(argv)
    if args.steps < MIN_STEPS:
        raise UserError(
            f"--steps {args.steps}: the check needs at least {MIN_STEPS} steps (a checkpoint, a "
            "kill after it, and steps after the kill)"
        )
    cfg = saved_config.load_command(args.config, args.overrides, args.script, args.script_args)
    if not cfg.script.path:
        check_task(cfg)
    folder = _folder(cfg)
    probe = cfg.to_dict()
    probe["run"]["dir"] = folder
    preflight.check_paths(from_dict(probe))
    try:
        exact, line = run_check(cfg, args.steps, compare, folder)
    except Stopped as stopped:
        print(f"check interrupted; its runs are in {folder}", file=sys.stderr)
        return stopped.code
    except ScriptFailed as failed:
        print(f"error: {failed} (the check's runs are in {folder})", file=sys.stderr)
        return failed.code
    except UserError as exc:
        raise UserError(f"{exc} (the check's runs are in {folder})") from None
    if exact and not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        line += f"\nthe check's runs: {folder} (the launches' output: {folder}/launches.log)"
    print(line)
    return EXIT_OK if exact else EXIT_NOT_EXACT


__all__ = [
    "EXACT",
    "EXIT_NOT_EXACT",
    "NOT_EXACT",
    "Compare",
    "Difference",
    "Evidence",
    "Plan",
    "first_difference",
    "main",
    "plan",
    "verdict",
]
