"""Typed configuration: the sections assembled, YAML as the file format, ``a.b=c`` overrides, and
the one rule for resuming a run with a config.

Precedence: dataclass defaults < YAML file < command-line overrides. The sections and their
checks live in ``sections/``; ``docs/configuration.md`` is generated from them
(``python -m clusterflow.config``). This module must not import torch: it runs on the login node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clusterflow.config import fingerprint
from clusterflow.config import yaml_file as config_yaml
from clusterflow.config.sections import (
    SECTIONS,
    TASK,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DistConfig,
    MiningConfig,
    ObserveConfig,
    RunConfig,
    ScriptConfig,
    TaskConfig,
    TrackersConfig,
    TrainConfig,
    check,
    is_url,
    keys,
)
from clusterflow.config.values import coerce, short, shown
from clusterflow.errors import UserError


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mining: MiningConfig = field(default_factory=MiningConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)

    def __post_init__(self) -> None:
        world = self.cluster.world_size
        per_step = world * self.train.grad_accum
        check(
            # A script's batches come from its run.loader call, not from train.batch_size.
            bool(self.script.path) or self.train.batch_size % per_step == 0,
            "train.batch_size",
            self.train.batch_size,
            f"must be divisible by world size x grad_accum = {world} x {self.train.grad_accum} "
            f"= {per_step} so every rank gets the same micro-batch; try "
            f"train.batch_size={max(per_step, self.train.batch_size // per_step * per_step)}",
        )
        check(
            self.mining.embed_with != "ema" or self.train.ema_decay > 0,
            "mining.embed_with",
            self.mining.embed_with,
            "embedding with the EMA weights needs train.ema_decay > 0 (e.g. 0.999)",
        )
        window = self.train.profile_window
        check(
            window is None or max(window[2]) < world,
            "train.profile",
            self.train.profile,
            f"names rank {max(window[2]) if window else 0} but the run has {world} rank(s) "
            f"(0..{world - 1}); name ranks below {world}",
        )
        ckpt = self.checkpoint.dir
        check(
            self.train.parallel != "fsdp" or not is_url(ckpt) or ckpt.startswith("file://"),
            "checkpoint.dir",
            ckpt,
            "train.parallel=fsdp writes sharded checkpoints from every rank to a filesystem "
            "they all mount; use a path on a shared filesystem (or train.parallel=ddp)",
        )

        check(
            self.train.parallel != "fsdp" or self.checkpoint.memory_every_steps == 0,
            "checkpoint.memory_every_steps",
            self.checkpoint.memory_every_steps,
            "snapshots in memory hold a replicated model (train.parallel=ddp); a sharded run "
            "(train.parallel=fsdp) keeps its checkpoints on the shared filesystem: set "
            "checkpoint.memory_every_steps=0",
        )

    def check_profile_reaches(self, samples: int) -> None:
        """Refuse a ``train.profile`` window that starts after the run's last step (it would
        profile nothing); ``samples``: the training set's size."""
        window, t = self.train.profile_window, self.train
        per_epoch = samples // t.batch_size
        last = t.epochs * per_epoch
        check(
            window is None or window[0] <= last,
            "train.profile",
            t.profile,
            f"starts after the run's last step: {t.epochs} epoch(s) x {per_epoch} steps "
            f"({samples} samples / train.batch_size {t.batch_size}) = {last} steps; profile "
            f"steps within 1-{last}, e.g. {max(1, last - 2)}-{last}",
        )

    def to_dict(self) -> dict[str, Any]:
        """Sections by their config keys (``checkpoint.async``, not the field name ``async_``)."""
        data = dataclasses.asdict(self)
        return {
            name: {key: data[name][fname] for key, fname in keys(SECTIONS[name]).items()}
            for name in data
        }

    def to_yaml(self) -> str:
        return config_yaml.dump(self.to_dict())

    def fingerprint(self) -> str:
        """Hash of everything except where the run lives, so a moved run dir still resumes."""
        data = self.to_dict()
        data["run"] = {k: v for k, v in data["run"].items() if k != "dir"}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def checkpoint_dir(self) -> str:
        return checkpoint_root(self.run.dir, self.checkpoint.dir)


CHECKPOINTS = "checkpoints"  # the checkpoints' folder in the run dir, unless checkpoint.dir says


def checkpoint_root(run_dir: str, configured: str) -> str:
    """Where a run's checkpoints are: RUN_DIR/checkpoints by default; ``checkpoint.dir`` as given
    when it is a URL or an absolute path; inside the run dir when relative (it moves with it)."""
    if not configured:
        return join(run_dir, CHECKPOINTS)
    if "://" in configured or os.path.isabs(configured):
        return configured
    return join(run_dir, configured)


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', keeping URLs such as s3://bucket intact (a Path would mangle
    them)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


# ---------------------------------------------------------------------------------------------
# Resuming: one rule for submit, run and the checkpoint restore

# Keys that may differ between a run's saved config and a later launch of it: where the run dir
# and its checkpoints are now (a moved or copied run dir resumes from its new place), how often
# the lease is renewed, what to do about a non-finite loss (a diverged run resumes from its
# last finite checkpoint, skipping such steps), and the command run on the run's events.
MAY_CHANGE_ON_RESUME: frozenset[str] = frozenset(
    {
        "run.dir",
        "checkpoint.dir",
        "run.lease_s",
        "train.on_nonfinite",
        "train.max_consecutive_skips",
        "dist.heartbeat_s",
        "dist.stall_s",
        "cluster.gpus",
        "observe.on_event",
    }
)


# Keys a completed run may change when it is launched again: it then trains on from its last
# step, with more epochs (a task's train.epochs; its schedule spans the new total) or with a
# script's arguments that ask for more (--max-steps 2000); the same config trains nothing.
TRAIN_ON: frozenset[str] = frozenset({"train.epochs", "script.args"})


def differences(saved: Mapping[str, Any], requested: Mapping[str, Any]) -> list[str]:
    """``section.key: old -> new`` for each key both configs hold with different values, outside
    ``MAY_CHANGE_ON_RESUME``. A key only one side holds (added or removed by another clusterflow
    version, so it takes its default) is not a difference."""
    out = []
    for section, values in saved.items():
        other = requested.get(section)
        if not isinstance(values, Mapping) or not isinstance(other, Mapping):
            continue
        for key, old in values.items():
            name = f"{section}.{key}"
            if key in other and other[key] != old and name not in MAY_CHANGE_ON_RESUME:
                out.append(f"{name}: {old!r} -> {other[key]!r}")
    return out


def resume_config(saved: Config, requested: Config) -> Config:
    """The saved config, with the keys in ``MAY_CHANGE_ON_RESUME`` taken from ``requested``."""
    data, new = saved.to_dict(), requested.to_dict()
    for name in MAY_CHANGE_ON_RESUME:
        section, key = name.split(".")
        data[section][key] = new[section][key]
    return from_dict(data)


def _both_hold(
    change: fingerprint.Change, saved: Mapping[str, Any], requested: Mapping[str, Any]
) -> bool:
    """False for a section key only one side holds (added or removed by another clusterflow
    version, so it takes its default): not a difference. Sub-keys (task.params.x) and derived
    values count."""
    parts = change.key.split(".")
    if parts[0] == "derived" or len(parts) != 2:
        return True
    return all(
        isinstance(c.get(parts[0]), Mapping) and parts[1] in c[parts[0]] for c in (saved, requested)
    )


def check_resume(
    saved: Mapping[str, Any],
    requested: Mapping[str, Any],
    what: str,
    relaunch: bool = False,
    completed: bool = False,
) -> list[fingerprint.Change]:
    """The one config-consistency rule, shared by the ``submit`` and ``run`` commands and the
    checkpoint restore: a run continues only with the experiment it started with. Keys that
    change results (``fingerprint.KEYS``: model, data, optimisation, seed, mining) must match;
    resources (Slurm resources, world size, workers, intervals, timeouts) may change, and are
    returned as ``fingerprint.Change`` items for the caller to report. ``what`` names the saved
    side (a run dir, a checkpoint). A relaunch of the same job by its launcher (a Slurm requeue
    re-runs the sbatch script, which re-reads a YAML file the user may have edited since) runs on
    the saved config with a note; any other result change is refused, naming the keys, except a
    new ``train.batch_size`` where ``requested`` sets ``train.allow_batch_size_change``, and, for
    a ``completed`` run that trains on, ``TRAIN_ON``'s keys."""

    result, other = fingerprint.compare(saved, requested)
    result, rebatched = fingerprint.allowed_batch_size_change(result, requested)
    other += rebatched
    if completed:
        other += [c for c in result if c.key in TRAIN_ON]
        result = [c for c in result if c.key not in TRAIN_ON]
    result = [
        c for c in result if _both_hold(c, saved, requested) and c.key not in MAY_CHANGE_ON_RESUME
    ]
    other = [
        c for c in other if _both_hold(c, saved, requested) and c.key not in MAY_CHANGE_ON_RESUME
    ]
    if not result:
        return other
    listed = fingerprint.summary(result)
    if relaunch:
        print(
            f"note: this relaunched job runs on the config of {what}, "
            f"which differs from the one given now ({listed})",
            file=sys.stderr,
        )
        return []
    raise UserError(
        f"{what} holds a run with a different config ({listed}); to resume it, use the same values "
        f"for these keys (resources such as cluster.* may change: docs/workflows.md); "
        f"to start a new run, set run.dir=<new path>"
    )


# ---------------------------------------------------------------------------------------------
# Building a Config from what the YAML file and the overrides hold


def _field_types(section_cls: type) -> dict[str, Any]:
    """Config key -> type."""
    hints = typing.get_type_hints(section_cls)
    return {key: hints[fname] for key, fname in keys(section_cls).items()}


def _name(source: str, name: object, what: str, example: str) -> str:
    """``name`` if it is a string; else a UserError (YAML reads ``1:`` or ``null:`` as a number or
    null)."""
    if not isinstance(name, str):
        raise UserError(f"{source}: {what} {shown(name)} is not a name; {example}")
    return name


def build(raw: dict[str, Any], source: str = "config") -> Config:
    """Build a validated Config from a nested mapping (what the YAML file holds)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(
            f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)}), "
            f"got {'a list' if isinstance(raw, list) else shown(raw)}"
        )
    sections = {}
    for name, value in raw.items():
        if (
            _name(source, name, "section", f"sections are words: {', '.join(SECTIONS)}")
            not in SECTIONS
        ):
            raise UserError(
                f"{source}: unknown section {name!r}; valid sections: {', '.join(SECTIONS)}"
            )
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise UserError(
                f"{source}: section {name!r} must be a mapping of keys, got {shown(value)}"
            )
        types_ = _field_types(SECTIONS[name])
        kwargs = {}
        for key, v in value.items():
            if (
                _name(source, key, "key", f"keys of [{name}] are words: {', '.join(types_)}")
                not in types_
            ):
                raise UserError(
                    f"{source}: unknown key {name}.{key}; valid "
                    f"keys of [{name}]: {', '.join(types_)}"
                )
            kwargs[keys(SECTIONS[name])[key]] = coerce(f"{name}.{key}", v, types_[key])
        sections[name] = kwargs
    built = {name: cls(**sections.get(name, {})) for name, cls in SECTIONS.items()}
    return Config(**built)


def _parse_override(text: str) -> tuple[str, str, str, Any]:
    """``section.key=value`` -> (section, key, "", value); ``task.params.a=1`` -> (task, params,
    a, 1)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # The shell passed bytes that are not UTF-8 (Python keeps them as surrogates).
        raw = text.encode("utf-8", "surrogateescape")
        raise UserError(
            f"override {raw!r} is not UTF-8 text; type it in a UTF-8 terminal "
            f"(check the locale: LANG=C.UTF-8)"
        ) from None
    text_shown = short(text)
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise UserError(
            f"override {text_shown!r} must look like section.key=value, e.g. train.epochs=3"
        )
    section, _, name = key.strip().partition(".")
    name, _, sub = name.partition(".")
    if section not in SECTIONS:
        raise UserError(
            f"override {text_shown!r}: unknown section "
            f"{section!r}; valid sections: {', '.join(SECTIONS)}"
        )
    types_ = _field_types(SECTIONS[section])
    if name not in types_:
        raise UserError(
            f"override {text_shown!r}: unknown key {section}.{name}; "
            f"valid keys of [{section}]: {', '.join(types_)}"
        )
    if sub and typing.get_origin(types_[name]) is not dict:
        raise UserError(
            f"override {text_shown!r}: {section}.{name} is a single "
            f"value, not a mapping; write {section}.{name}=VALUE"
        )
    if types_[name] is str:
        try:
            parsed = config_yaml.parse(value, f"override {text_shown!r}", lenient=True)
        except UserError:
            parsed = None
        # YAML only to unquote: '007' stays '007', not 7, and a value YAML cannot read is the text
        # typed.
        return section, name, sub, parsed if isinstance(parsed, str) else value
    parsed = (
        config_yaml.parse(value, f"override {text_shown!r}", lenient=True) if value.strip() else ""
    )
    return section, name, sub, parsed


def read_yaml(path: str) -> Any:
    """What the YAML file ``path`` holds (None for an empty file); UserError on anything
    unreadable."""
    return config_yaml.parse(config_yaml.read_text(path), path)


def load(
    path: str | None,
    overrides: list[str] | tuple[str, ...] = (),
    given: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Defaults < ``defaults`` < file < ``given`` < overrides, validated. ``given``: values the
    command line gives as Python values, not as text (a script's path and arguments); ``defaults``:
    what a file or an override may still change (a script's default run.dir). Raises UserError on
    any bad input."""
    raw = read_yaml(path) if path else None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise UserError(
            f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)}), "
            f"got {'a list' if isinstance(raw, list) else shown(raw)}"
        )
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for layer, under in ((defaults, True), (given, False)):
        for section, values in (layer or {}).items():
            node = raw.get(section)
            node = dict(node) if isinstance(node, dict) else {}
            raw[section] = {**values, **node} if under else {**node, **values}
    # Validate the file alone first, so an error names the file rather than an override.
    build(raw, source=path or "config")
    for text in overrides:
        section, name, sub, value = _parse_override(text)
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        if sub:  # one entry of a mapping such as task.params, keeping the file's other entries
            old = raw[section].get(name)
            raw[section][name] = {**(old if isinstance(old, dict) else {}), sub: value}
        else:
            raw[section][name] = value
    return build(raw, source=f"{path} with overrides" if overrides else (path or "config"))


def from_dict(data: dict[str, Any]) -> Config:
    return build(data, source="resolved config")


def task_keys_set(cfg: Config) -> list[str]:
    """The keys of a task's that ``cfg`` sets to other than their defaults (``applies=TASK``),
    as ``key = value``: what a script's job says it leaves alone."""
    out = []
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        for f in dataclasses.fields(cls):
            if f.metadata.get("applies") != TASK:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            value = getattr(section, f.name)
            if value != default:
                out.append(f"{name}.{f.metadata.get('key', f.name)} = {short(repr(value))}")
    return out


def reference_markdown() -> str:
    """The configuration reference, generated from the dataclasses (docs/configuration.md)."""
    lines = [
        "# Configuration reference",
        "",
        (
            "Generated from `clusterflow/config/sections/` by "
            "`python -m clusterflow.config > docs/configuration.md`;"
        ),
        "a test fails when this page and the code disagree.",
        "",
        (
            "*applies to*: whose job reads the key: a task's (the task trainer), a script's "
            "(your own loop: [own loop](own-loop.md)), or both. A script's job that sets a key "
            "of a task's says so in one line."
        ),
        "",
        "Precedence: defaults < YAML file < `section.key=value` overrides on the command line.",
        "",
    ]
    for name, cls in SECTIONS.items():
        lines += [
            f"## `{name}`",
            "",
            (cls.__doc__ or "").strip(),
            "",
            "| key | type | default | applies to | meaning |",
            "|---|---|---|---|---|",
        ]
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default
            if default is dataclasses.MISSING:
                default = f.default_factory()  # type: ignore[misc]
            key = f.metadata.get("key", f.name)
            tp = hints[key]
            tname = getattr(tp, "__name__", str(tp)).replace("typing.", "")
            if typing.get_origin(tp) is not None:
                tname = str(tp).replace("typing.", "")
            lines.append(
                f"| `{name}.{key}` | {tname} | `{json.dumps(default)}` "
                f"| {f.metadata['applies']} | {f.metadata.get('help', '')} |"
            )
        lines.append("")
    return "\n".join(lines)
