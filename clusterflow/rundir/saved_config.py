"""The run dir's ``config.yaml``: written once, portable, read back with the directory actually
used.

A run dir may be moved or copied and resumed from its new place, so nothing in it names its own
path: ``config.yaml`` (and each checkpoint manifest's copy of the config) stores ``run.dir: .``,
which means "the folder holding this file". The run dir of a launch is the one it was given
(``run.dir=...``), or the folder of a saved ``config.yaml`` given as the config file itself
(``python -m clusterflow.run runs/x/config.yaml``); never a path read from inside the run dir.
A relative ``checkpoint.dir`` lies inside the run dir too (``config.checkpoint_root``).

A ``config.yaml`` is read as the plain YAML clusterflow writes (``yaml.safe_dump`` of
``Config.to_dict``, whose values are fresh copies: no anchors or aliases, a few levels deep),
within :data:`~clusterflow.config.yaml_file.MAX_BYTES`. One that holds an anchor or an alias, or
nests deeper than :data:`~clusterflow.config.yaml_file.MAX_DEPTH` levels, is no config
clusterflow wrote: it is damaged, refused from its YAML events before anything is built from it
(a "billion laughs" of a few KB would expand to gigabytes wherever it is walked, and deep nesting
would exhaust the stack of the reader that builds it), so ``status`` and the dashboard name it
and go on.

A ``config.yaml`` that cannot be read (garbage bytes, not a mapping, invalid values) must not
block the run: it is set aside as ``config.yaml.damaged-<time>`` with a warning and written
anew from the config given now; the checkpoint restore still checks that config against the one
in the newest checkpoint's manifest (``config.check_resume``).

``resolve`` is the one rule for ``submit`` and ``run``: resume with the saved config (refusing a
different one) or write it for a first start. No torch here: ``submit`` runs it on the login node.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Mapping
from typing import Any

import yaml

from clusterflow import config as cfgmod
from clusterflow.config.job_config import Config
from clusterflow.config.yaml_file import MAX_BYTES, MAX_DEPTH
from clusterflow.errors import UserError
from clusterflow.rundir import records as rundir
from clusterflow.rundir import script_files, states
from clusterflow.storage import confined, durable
from clusterflow.storage.store import CheckpointStore

HEADER = "# clusterflow run config"
# How a run that continues is configured, when nothing changed (resolve).
SAME = "the same config"
_NOTE = (
    f"{HEADER}: written once, when the run started. run.dir is '.': the run lives in the folder\n"
    "# that holds this file, wherever it is moved or copied.\n"
)


def how_to_resume(paths: rundir.RunPaths) -> str:
    """What resumes a run that nothing brings back, from its newest checkpoint: submitting its
    own config.yaml again (the run dir is the folder that holds it)."""
    command = shlex.join(["python", "-m", "clusterflow.submit", paths.config])
    return f"resume from its newest checkpoint with: {command}"


def portable(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict as stored inside the run dir: ``run.dir`` is "." (this run dir)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    out["run"] = {**out.get("run", {}), "dir": "."}
    return out


def is_saved(path: str) -> bool:
    """True for a config.yaml that clusterflow wrote into a run dir."""
    try:
        with open(path, "rb") as f:
            return f.read(len(HEADER)) == HEADER.encode()
    except OSError:
        return False


def load(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """``config.load``, except that a run dir's own config.yaml runs in the folder that holds it
    (unless ``run.dir=`` is among the overrides)."""
    cfg = cfgmod.load(path, overrides)
    return _in_its_folder(cfg, path, overrides)


def _in_its_folder(cfg: Config, path: str | None, overrides: list[str] | tuple[str, ...]) -> Config:
    if (
        path
        and is_saved(path)
        and not any(o.split("=", 1)[0].strip() == "run.dir" for o in overrides)
    ):
        cfg.run.dir = os.path.dirname(path) or "."
    return cfg


def split_script_args(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(clusterflow's words, the script's) of a command line ``... -- SCRIPT_ARGS``: every word
    after the first ``--`` is the script's, untouched; None when there is no ``--``."""
    if "--" not in argv:
        return list(argv), None
    cut = argv.index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


def load_script(
    path: str | None,
    overrides: list[str] | tuple[str, ...],
    script: str,
    args: list[str] | tuple[str, ...] = (),
) -> Config:
    """The config of ``--script SCRIPT [CONFIG.yaml] [KEY=VALUE ...] [-- ARGS]``: defaults, then
    run.dir ``runs/<script name>``, then the optional file, the script, its arguments and the
    files they name (``script_files.py``), the overrides. A script that is not a readable Python
    file is refused here."""
    if not script.endswith(".py") or not os.path.isfile(script):
        why = "is not a Python file (.py)" if not script.endswith(".py") else "does not exist"
        raise UserError(
            f"--script {script!r} {why} (looked in {os.getcwd()}); give the path of the "
            "training script, e.g. --script train.py"
        )
    stem = os.path.splitext(os.path.basename(script))[0]
    cfg = cfgmod.load(
        path,
        overrides,
        given={
            "script": {
                "path": os.path.normpath(script),
                "args": list(args),
                "files": script_files.named(args),
            }
        },
        defaults={"run": {"dir": f"runs/{stem}"}},
    )
    return _in_its_folder(cfg, path, overrides)


def load_command(
    config: str | None, overrides: list[str], script: str | None, script_args: list[str] | None
) -> Config:
    """The config of a ``run`` or ``submit`` command line: ``CONFIG [KEY=VALUE ...]``, or
    ``--script PATH [CONFIG] [KEY=VALUE ...] [-- SCRIPT_ARGS]``."""
    if config is not None and "=" in config and not os.path.isfile(config):
        overrides, config = [config, *overrides], None  # --script PATH KEY=VALUE ...
    if script is not None:
        return load_script(config, overrides, script, script_args or [])
    if script_args is not None:
        raise UserError(
            f"the words after -- ({' '.join(script_args) or 'none'}) are a script's arguments: "
            "give the script with --script PATH, or drop the --"
        )
    if config is None:
        raise UserError("give a config file (CONFIG.yaml [KEY=VALUE ...]) or --script PATH")
    return load(config, overrides)


def write_config(cfg: Config) -> None:
    paths = rundir.RunPaths(cfg.run.dir)
    os.makedirs(paths.root, exist_ok=True)
    durable.write_atomic(
        paths.config, _NOTE + yaml.safe_dump(portable(cfg.to_dict()), sort_keys=False)
    )


class NotWritten(ValueError):
    """YAML that clusterflow never writes into config.yaml (an anchor or an alias, nesting
    beyond :data:`MAX_DEPTH`); its text says what was found."""


# PyYAML's event parser: libyaml's where it is compiled in, which scans nesting without recursion.
_EVENTS = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_written(text: str) -> None:
    """NotWritten for YAML that :func:`write_config` never writes, seen from its events alone
    (nothing is built, no alias followed), at the first one that is not."""
    too_deep = NotWritten(
        f"it nests deeper than {MAX_DEPTH} levels, which no config clusterflow writes does"
    )
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_EVENTS):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise NotWritten(
                    f"it holds a YAML anchor or alias ({event.anchor!r}, line {line}), which "
                    "clusterflow never writes"
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise too_deep
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        # libyaml stops at 1000 levels of its own, sooner than the events above reach them
        # while it scans ahead in a flow collection: the same refusal.
        if "nesting" in str(exc.problem):
            raise too_deep from None
        raise


def _parse(target: str) -> Any:
    """config.yaml's YAML; OSError for one that is no regular file of the run dir (a link, a
    FIFO: ``storage/confined.py``) or larger than a config may be, NotWritten for YAML that
    clusterflow does not write (:func:`_check_written`)."""
    text = confined.read_bytes(target, limit=MAX_BYTES).decode("utf-8")
    _check_written(text)
    return yaml.safe_load(text)


def read_plain(paths: rundir.RunPaths) -> tuple[dict[str, Any], str]:
    """The saved config as plain YAML, for readers that must never stop on it (``status``):
    (mapping, "") or, when it is missing or damaged, ({}, what is wrong). Nothing is checked
    or set aside here: the next launch does that (:func:`read`)."""
    try:
        data = _parse(paths.config)
    except confined.Refused as exc:
        return {}, exc.why
    except NotWritten as exc:
        return {}, str(exc)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}" if mark is not None else ""
        return {}, f"not valid YAML{where}: {exc.problem or exc.context}"
    except (OSError, ValueError, yaml.YAMLError) as exc:  # ValueError: bytes that are not UTF-8
        return {}, type(exc).__name__
    if not isinstance(data, dict):
        return {}, f"a YAML {type(data).__name__}, not a mapping"
    return data, ""


def read(run_dir: str, set_aside: bool = True) -> Config | None:
    """The saved config, with ``run.dir`` = ``run_dir``; None when there is none, or when it is
    damaged (then it is set aside with a warning, unless ``set_aside`` is False)."""
    target = rundir.RunPaths(run_dir).config
    if not os.path.exists(target):
        return None
    try:
        data = _parse(target)
        if not isinstance(data, dict):
            raise UserError(f"the top level is a {type(data).__name__}, not a mapping of sections")
        data.setdefault("run", {})
        if not isinstance(data["run"], dict):
            raise UserError("its run section is not a mapping")
        data["run"] = {**data["run"], "dir": run_dir}
        return cfgmod.build(data, source=target)
    # ValueError: bytes that are not UTF-8.
    except (UserError, OSError, ValueError, yaml.YAMLError) as exc:
        if not set_aside:
            print(
                f"warning: {target} is damaged ({exc}); "
                "a run would keep it aside and write it anew",
                file=sys.stderr,
            )
            return None
        aside = f"{target}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(target, aside)
        print(
            f"warning: {target} is damaged ({exc}); kept as {aside} "
            "and written anew from the config given now "
            "(the newest checkpoint's own config is still checked at resume)",
            file=sys.stderr,
        )
        return None


def _has_checkpoint(cfg: Config) -> bool:
    """Whether the run of ``cfg`` committed a checkpoint; True when that cannot be told."""

    try:
        return bool(CheckpointStore(cfg.checkpoint_dir, cfg.checkpoint.keep_last).steps())
    # An unreachable store: assume there is something to protect.
    except Exception:  # noqa: BLE001
        return True


def _committed_steps(root: str, keep_last: int) -> list[int] | None:
    """The committed steps under a checkpoint root; None when it cannot be read."""
    try:
        return CheckpointStore(root, keep_last).steps()
    except Exception:  # noqa: BLE001 - an unreachable store or a missing fsspec package
        return None


def _checkpoints_moved(saved: Config, cfg: Config) -> bool:
    """Whether a resume changes where the checkpoints are (config.yaml must then say so). A new
    ``checkpoint.dir`` is taken only when the checkpoints went there too: where it holds none of
    the run's and the old one holds some (or cannot be read), resuming would silently train from
    step 0, so it is refused, naming both dirs and how to move them."""
    old, new = saved.checkpoint_dir, cfg.checkpoint_dir
    if old == new:
        return False
    keep = cfg.checkpoint.keep_last
    if _committed_steps(new, keep):
        return True
    held = _committed_steps(old, keep)
    if held == []:
        return True  # nothing committed anywhere: nothing to lose
    what = (
        f"its committed checkpoints (step-{held[-1]} the newest) are in {old}"
        if held
        else f"its checkpoints may be in {old}, which cannot be read now"
    )
    raise UserError(
        f"checkpoint.dir changed for run dir {cfg.run.dir!r} from {saved.checkpoint.dir or old!r} "
        f"to {cfg.checkpoint.dir!r}, but {new} holds no committed checkpoint and {what}: resuming "
        f"would train from step 0. Move them first (e.g. mkdir -p {new} && mv {old}/step-* {new}/) "
        f"and submit again, or keep checkpoint.dir={saved.checkpoint.dir or old}"
    )


def ends_run(manifest: Mapping[str, Any]) -> bool:
    """Whether a committed checkpoint holds its run's end: every step of a loop of
    ``run.steps(..., max_steps)`` taken (its ``max_steps``), or every epoch trained (its
    ``epochs``, which a script's ``run.epochs(n)`` sets; a manifest of an older version: its
    config's train.epochs)."""
    steps, step = manifest.get("max_steps"), manifest.get("global_step")
    if _is_int(steps):
        return _is_int(step) and step >= steps > 0
    config = manifest.get("config")
    train = config.get("train") if isinstance(config, dict) else None
    epochs = manifest.get("epochs")
    if not _is_int(epochs):
        epochs = train.get("epochs") if isinstance(train, dict) else None
    epoch = manifest.get("epoch")
    return _is_int(epochs) and _is_int(epoch) and epoch >= epochs > 0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def completed_at(run_dir: str) -> int | None:
    """The global step a completed run ended at (status.json's state ``completed``), or None."""
    status, _ = rundir.read_object(rundir.RunPaths(run_dir).status)
    if status.get("state") != states.COMPLETED:
        return None
    step = status.get("global_step")
    return step if _is_int(step) else 0


def nothing_to_train(cfg: Config) -> int | None:
    """The step a completed run ended at when ``cfg`` asks for nothing more (none of
    ``config.TRAIN_ON``'s keys changed: no more epochs, the script's arguments as they were), or
    None. Reads only. What the run completed with is its newest checkpoint's config (a launch
    asking for more epochs has rewritten config.yaml before its job starts); config.yaml's where
    that cannot be read."""
    step = completed_at(cfg.run.dir)
    saved = read(cfg.run.dir, set_aside=False) if step is not None else None
    if saved is None:
        return None
    old, new = _completed_with(cfgmod.resume_config(saved, cfg)) or saved.to_dict(), cfg.to_dict()
    for name in cfgmod.TRAIN_ON:
        section, key = name.split(".")
        if old.get(section, {}).get(key) != new.get(section, {}).get(key):
            return None
    return step


def _completed_with(cfg: Config) -> dict[str, Any] | None:
    """The config the newest committed checkpoint of ``cfg``'s run was saved with; None when
    there is none or it cannot be read."""
    try:
        manifest = CheckpointStore(cfg.checkpoint_dir, cfg.checkpoint.keep_last).newest_manifest()
    except Exception:  # noqa: BLE001 - an unreachable store or a missing fsspec package
        return None
    config = manifest.get("config") if manifest else None
    return config if isinstance(config, dict) else None


def nothing_to_train_said(run_dir: str, step: int) -> str:
    """What a launch of a completed run that asks for nothing more says."""
    return (
        f"run dir {run_dir} already completed at step {step}: nothing to train; to train on, "
        "launch it with more epochs or steps (the script's arguments, or train.epochs, may "
        "change on a completed run: docs/own-loop.md#a-completed-run)"
    )


def resolve(cfg: Config, relaunch: bool = False, write: bool = True) -> tuple[Config, str]:
    """The config to run, and "" for a new run, or how the run it continues is configured when
    the run dir already held one ("the same config", "the same config but for resources: ...",
    for ``submit``'s line saying it resumes). An existing run continues
    with its saved config; a different experiment is refused (``config.check_resume``); changed
    resources (``config/fingerprint.py``: cluster.*, workers, intervals) are taken, with a note,
    and config.yaml is rewritten with them; where the run dir is may change
    (``MAY_CHANGE_ON_RESUME``); for a ``relaunch`` by the launcher (a Slurm requeue re-reads a
    YAML that may have been edited since), with a note. A run that committed no checkpoint yet
    has nothing to resume: a different config replaces its config.yaml, with a note (a first
    start that failed on a bad task parameter can be fixed and resubmitted into the same run
    dir). The files the script's arguments named when the run started (``script.files``) must be
    as they were: a resume on a changed one is refused (``script_files.py``), the launch's own
    digests are not compared (a file created since, by the run itself, is no change). A
    completed run may change ``config.TRAIN_ON``'s keys: it trains on, with a note.
    ``write=False`` decides without writing anything (``--dry-run``, ``--check``)."""
    saved = read(cfg.run.dir, set_aside=write)
    if saved is None:
        if write:
            write_config(cfg)
        return cfg, ""
    diffs = cfgmod.differences(saved.to_dict(), cfg.to_dict())
    if diffs and not relaunch and not _has_checkpoint(cfgmod.resume_config(saved, cfg)):
        print(
            f"note: run dir {cfg.run.dir!r} has no committed checkpoint, so nothing to resume: "
            f"its config.yaml is replaced by this config ({'; '.join(diffs[:6])})",
            file=sys.stderr,
        )
        if write:
            write_config(cfg)
        return cfg, ""
    script_files.refuse_changed(saved.script.files, cfg.run.dir)
    asked = cfg.to_dict()
    asked["script"]["files"] = dict(saved.script.files)
    cfg = cfgmod.from_dict(asked)
    done = completed_at(cfg.run.dir)
    changed = cfgmod.check_resume(
        saved.to_dict(),
        cfg.to_dict(),
        f"run dir {cfg.run.dir!r}",
        relaunch=relaunch,
        completed=done is not None,
    )
    moved = _checkpoints_moved(saved, cfg)
    if moved and not changed:
        print(
            f"note: run dir {cfg.run.dir!r} resumes from the checkpoints in {cfg.checkpoint_dir} "
            f"(checkpoint.dir was {saved.checkpoint.dir or saved.checkpoint_dir!r})",
            file=sys.stderr,
        )
        resumed = cfgmod.resume_config(saved, cfg)
        if write:
            write_config(resumed)
        return resumed, f"{SAME} but for checkpoint.dir ({cfg.checkpoint_dir})"
    if relaunch or not changed:
        return cfgmod.resume_config(saved, cfg), SAME
    # Only resources changed (a longer time limit, another partition, fewer nodes), or a completed
    # run trains on: the run resumes with them, and config.yaml says what it runs with now.
    more = [c for c in changed if c.key in cfgmod.TRAIN_ON]
    if more:
        print(
            f"note: run dir {cfg.run.dir!r} completed at step {done} and trains on: "
            f"{'; '.join(map(str, more))}",
            file=sys.stderr,
        )
    rest = [c for c in changed if c.key not in cfgmod.TRAIN_ON]
    if rest:
        print(
            f"note: run dir {cfg.run.dir!r} resumes with changed resources: "
            f"{'; '.join(map(str, rest))}",
            file=sys.stderr,
        )
    if write:
        write_config(cfg)
    return cfg, f"{SAME} but for resources: {'; '.join(map(str, changed))}"
