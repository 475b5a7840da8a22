"""Scripts of the user's own (docs/own-loop.md): ``clusterflow.start()``, the library API's entry,
and :func:`run_script`, which runs a script as a job's program (``submit --script``,
``run --script``, the sbatch templates, torchrun).

``start`` is the job's side of a run: an :class:`~clusterflow.job.attempt.Attempt` (process group,
run dir, attempt record, stop signals, heartbeats and watchdog) and the
:class:`~clusterflow.train.session.Run` it opens; every rank starts with the same random streams
(``run.seed``), but those the script seeded itself (``train/seeds.py``). Its config is the
job's when a job runs the script (the config ``submit`` or ``run`` resolved; the script's own
arguments to ``start`` are then ignored, each with a warning),
otherwise the defaults, then ``config`` (a YAML file, a mapping or a Config), then ``overrides``
(``**{"train.log_every_steps": 10}`` or ``checkpoint={"every_steps": 50}``); ``script.path`` and
``script.args`` are the running script's and ``run.dir`` defaults to ``runs/<script name>``.

However a script ends, the run dir hears it: a stop ends the job in ``run.step`` (``RunStopped``);
an exception is recorded as the attempt's failure, with one line naming the script's frame; a
script that returns or exits without ``run.finish()`` fails with one line saying so.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import runpy
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TextIO

import torch

from clusterflow import config as cfgmod
from clusterflow import rundir
from clusterflow.config.job_config import Config, from_dict, task_keys_set
from clusterflow.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, RunFailed, UserError
from clusterflow.job.attempt import Attempt, exit_code, record_failure
from clusterflow.rundir import frozen_code, script_files
from clusterflow.rundir.states import State
from clusterflow.train.builders import amp_dtype
from clusterflow.train.seeds import GlobalSeeds
from clusterflow.train.session import Run, RunStopped

log = logging.getLogger("clusterflow")


@dataclass(frozen=True)
class _Context:
    """What a job hands the script it runs: its config, and the file it runs."""

    config: Config
    file: str


# Set by run_script while the script runs: start() takes the job's config from it.
_context: _Context | None = None
# The attempt clusterflow.start() began in this process.
_active: Attempt | None = None


def _amp(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The precision a script's sharded model and mining embed compute in: none unless
    ``train.amp`` names one (``auto`` is the task trainer's choice; a script autocasts itself)."""
    return amp_dtype("none" if cfg.train.amp == "auto" else cfg.train.amp, device)


def start(config: str | Mapping[str, Any] | Config | None = None, **overrides: object) -> Run:
    """Join the job this process belongs to (Slurm, torchrun, submitit or one process) and return
    its :class:`Run`: the run dir taken, the attempt recorded, resumed from its newest checkpoint
    once ``run.restore`` is called."""
    global _active
    if _active is not None:
        raise UserError(
            "clusterflow.start() was called twice in this process; call it once and pass the "
            "run it returned to where it is needed"
        )
    ctx = _context
    if ctx is not None:
        cfg, file = ctx.config, ctx.file
        ignored = _ignored(cfg, config, overrides)
    else:
        file = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        cfg, ignored = by_hand(config, overrides, list(sys.argv)), []
    if torch.distributed.is_initialized():
        raise UserError(
            "clusterflow.start(): the process group is initialized already (a "
            "dist.init_process_group call before it); remove that call: start() joins the group "
            "itself, from the environment Slurm, torchrun or submitit set"
        )
    if cfg.train.on_nonfinite == "skip_step":
        raise UserError(
            "train.on_nonfinite = 'skip_step' skips the optimizer step of a task; a script "
            "steps its optimizer itself: use fail (the default)"
        )
    job = Attempt(cfg, code_file=file or None)
    try:
        if not job.begin():
            outcome = job.outcome or ""
            raise RunStopped(outcome, exit_code(outcome))
        seeds = GlobalSeeds(job.cfg.run.seed, script=True)
        seeds.at_start()  # the script's own seeds kept; run.seed for the others
        run, _ = job.open_run(_amp(job.cfg, job.device), _what(job.cfg), seeds)
        for line in ignored:
            if run.rank == 0:
                log.warning("%s", line)
        unread = task_keys_set(job.cfg)
        if unread and run.rank == 0:
            log.warning(
                "%s: keys of a task's job, which a script's does not read (its batch is "
                "run.loader's, its optimizer and schedule its own): %s",
                _what(job.cfg),
                ", ".join(unread),
            )
    except RunStopped:
        raise
    except BaseException as exc:
        job.fail(exc)
        raise
    sys.stdout = _Tee(sys.stdout, job.paths.log_file(job.env.rank, job.attempt))
    _active = job
    if ctx is None:
        _guard(job)
    return run


class _Tee:
    """The script's standard output, into its rank's log too, where ``clusterflow logs`` and the
    dashboard read it (under ``submit --script`` the process's own output is a file of Slurm's
    or submitit's). Lines, as ``print`` writes them; clusterflow's log lines on rank 0's console
    go to the stream the logging set up, not through this."""

    def __init__(self, stream: TextIO, path: str) -> None:
        self.stream = stream
        # Open until the script ends (close_log), line-buffered: a print is in the log at once.
        self.log: TextIO | None = open(  # noqa: SIM115
            path, "a", encoding="utf-8", errors="replace", buffering=1
        )

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if self.log is not None:
            try:
                self.log.write(text)
            except (OSError, ValueError):  # a full disk never fails the script's print
                self.log = None
        return written

    def flush(self) -> None:
        self.stream.flush()
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                self.log.flush()

    def close_log(self) -> TextIO:
        """Stop copying; returns the stream."""
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                self.log.close()
            self.log = None
        return self.stream

    def __getattr__(self, name: str) -> object:  # fileno, isatty, encoding, ...
        return getattr(self.stream, name)


def _what(cfg: Config) -> str:
    return f"script {os.path.basename(cfg.script.path)}" if cfg.script.path else "the script"


def by_hand(
    config: str | Mapping[str, Any] | Config | None,
    overrides: Mapping[str, object],
    argv: list[str],
) -> Config:
    """The config of a script started by hand (python, torchrun, srun): defaults < ``config`` <
    ``overrides``; the running script, its arguments and the files they name
    (``script_files.py``); run.dir runs/<script name> unless given."""
    raw = _raw(config, overrides)
    script = argv[0] if argv and argv[0].endswith(".py") else ""
    section = raw.setdefault("script", {})
    if not isinstance(section, dict):
        raise UserError("clusterflow.start(script=...): give the script section as a mapping")
    section.setdefault("path", os.path.normpath(script) if script else "")
    section.setdefault("args", argv[1:] if script else [])
    if isinstance(section["args"], (list, tuple)):
        section.setdefault("files", script_files.named(section["args"]))
    run = raw.setdefault("run", {})
    if isinstance(run, dict) and "dir" not in run and script:
        run["dir"] = f"runs/{os.path.splitext(os.path.basename(script))[0]}"
    return cfgmod.build(raw, source="clusterflow.start()")


def _raw(
    config: str | Mapping[str, Any] | Config | None, overrides: Mapping[str, object]
) -> dict[str, Any]:
    """The sections ``config`` and ``overrides`` name, as a YAML file would hold them."""
    if config is None:
        raw: dict[str, Any] = {}
    elif isinstance(config, Config):
        raw = config.to_dict()
    elif isinstance(config, str):
        read = cfgmod.read_yaml(config)
        if read is not None and not isinstance(read, dict):
            raise UserError(f"{config}: the top level must be a mapping of sections")
        raw = dict(read or {})
    elif isinstance(config, Mapping):
        raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    else:
        raise UserError(
            f"clusterflow.start(config=...): expected a YAML file's path, a mapping of sections "
            f"or a Config, got {type(config).__name__}"
        )
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for key, value in overrides.items():
        section, dot, name = key.partition(".")
        if dot:
            node = raw.setdefault(section, {})
            if not isinstance(node, dict):
                raise UserError(
                    f"clusterflow.start({key}=...): section {section!r} is not a mapping"
                )
            name, dot, sub = name.partition(".")
            if dot:  # one entry of a mapping such as task.params
                old = node.get(name)
                node[name] = {**(old if isinstance(old, dict) else {}), sub: value}
            else:
                node[name] = value
        elif isinstance(value, Mapping):
            node = raw.setdefault(section, {})
            if isinstance(node, dict):
                node.update(value)
        else:
            raise UserError(
                f"clusterflow.start({key}=...): name a key as section.key, e.g. "
                f"clusterflow.start(**{{'train.log_every_steps': 10}}), or give a whole section as "
                f"a mapping, e.g. clusterflow.start(checkpoint={{'every_steps': 50}})"
            )
    return raw


def _ignored(
    cfg: Config, config: str | Mapping[str, Any] | Config | None, overrides: Mapping[str, object]
) -> list[str]:
    """Inside a job: a line for each key the script's own arguments to ``start`` set to another
    value than the job's config holds (the job's wins)."""
    if config is None and not overrides:
        return []
    asked = cfgmod.build(_raw(config, overrides), source="clusterflow.start()").to_dict()
    named = _raw(config, overrides)
    now = cfg.to_dict()
    lines = []
    for section, values in named.items():
        if not isinstance(values, dict) or section not in now:
            continue
        for key in values:
            if key in now[section] and asked[section].get(key) != now[section][key]:
                lines.append(
                    f"clusterflow.start(): {section}.{key}={asked[section].get(key)!r} is "
                    f"ignored: this job runs on its submitted config ({section}.{key}="
                    f"{now[section][key]!r}); give it on the submit command line instead "
                    f"({section}.{key}=VALUE)"
                )
    return lines


def _guard(job: Attempt) -> None:
    """A script started by hand: an exception that ends it is recorded as the attempt's failure,
    and an exit without ``run.finish()`` is said and recorded."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if job.outcome is not None:  # the job had ended
            if isinstance(exc, UserError):  # a call after the end: one line, as any misuse
                print(f"error: {exc}", file=sys.stderr)
                _leave(EXIT_BAD_INPUT)
            previous(kind, exc, tb)
            return
        code = EXIT_JOB_FAILED
        try:
            job.fail(exc)
            previous(kind, exc, tb)  # a failure clusterflow does not name: Python's traceback
        except SystemExit as named:
            code = named.code if isinstance(named.code, int) else EXIT_JOB_FAILED
        _leave(code)

    sys.excepthook = hook
    # At the interpreter's shutdown, before it joins threads and before concurrent.futures
    # refuses new work (its hook, registered when clusterflow imported it, runs after this one):
    # the checkpoint write in flight completes (an epoch's end is written in the background).
    threading._register_atexit(_write_done, job)  # type: ignore[attr-defined]
    atexit.register(_at_exit, job)


def _write_done(job: Attempt) -> None:
    if job.outcome is None and job.internals is not None:
        job.internals.wait_for_write()


def _at_exit(job: Attempt) -> None:
    if job.outcome is not None or job.run is None:
        return
    try:
        job.fail(_unfinished(job.cfg))
    except SystemExit as exc:
        _leave(exc.code if isinstance(exc.code, int) else EXIT_JOB_FAILED)


def _leave(code: int) -> None:
    """Flush everything, then leave without interpreter teardown (as ``clusterflow.run`` does:
    the communication library's threads can abort a process while Python unwinds)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _unfinished(cfg: Config) -> UserError:
    return UserError(
        f"{_what(cfg)} ended without calling run.finish(): the run's end (model.pt, its state "
        "completed) was never reached; call run.finish() after the epochs loop (the "
        "checkpoints are kept: running it again resumes)"
    )


def script_file(cfg: Config, paths: rundir.RunPaths) -> str:
    """The file a job runs for ``script.path``: its copy frozen at submission
    (``frozen_code``), else the script in place."""
    info = frozen_code.activate(paths)
    if info is not None and info.get("script"):
        return os.path.join(os.path.abspath(info["path"]), info["script"])
    path = os.path.abspath(cfg.script.path)
    if not os.path.isfile(path):
        raise UserError(
            f"script.path = {cfg.script.path!r}: no such file (looked in {os.getcwd()}); give "
            "the script's path as seen from where the job starts"
        )
    return path


def run_script(config: Config, environ: Mapping[str, str] | None = None) -> str:
    """Run ``script.path`` with ``script.args`` as this process's program, as ``python SCRIPT
    ARGS`` would, on the job's config. Returns the job's outcome."""
    global _context, _active
    cfg = config if isinstance(config, Config) else from_dict(dict(config))
    paths = rundir.RunPaths(cfg.run.dir)
    file = script_file(cfg, paths)
    argv, path, stdout = sys.argv, list(sys.path), sys.stdout
    sys.argv = [file, *cfg.script.args]
    sys.path.insert(0, os.path.dirname(file))  # as python puts a script's folder first
    _context, _active = _Context(cfg, file), None
    try:
        runpy.run_path(file, run_name="__main__")
    except RunStopped as stopped:
        return stopped.outcome
    except SystemExit as exc:
        if _active is not None and _active.outcome is not None:
            return _active.outcome
        if exc.code not in (0, None):
            _fail(cfg, RunFailed(f"{_what(cfg)} exited with status {exc.code}"), environ)
            raise
    except BaseException as exc:
        _fail(cfg, exc, environ)
        raise
    finally:
        sys.argv, sys.path[:] = argv, path
        if isinstance(sys.stdout, _Tee):
            sys.stdout.close_log()
        sys.stdout = stdout
        _context = None
    if _active is None:
        _fail(
            cfg,
            UserError(
                f"{_what(cfg)} ended without calling clusterflow.start(): nothing of it ran under "
                "clusterflow; call run = clusterflow.start() before training (docs/own-loop.md)"
            ),
            environ,
        )
        return State.FAILED
    if _active.outcome is None:
        _fail(cfg, _unfinished(cfg), environ)
    return _active.outcome or State.FAILED


def _fail(cfg: Config, exc: BaseException, environ: Mapping[str, str] | None) -> None:
    """The script failed: recorded by its attempt, or, before ``start`` took the run dir, said
    without writing there."""
    if _active is not None and _active.outcome is None:
        _active.fail(exc)
        return
    env = dict(os.environ if environ is None else environ)
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")) or 0)
    record_failure(
        exc, cfg, rundir.RunPaths(cfg.run.dir), rank, env, write=False, code_file=cfg.script.path
    )


__all__ = ["RunStopped", "by_hand", "run_script", "start"]
