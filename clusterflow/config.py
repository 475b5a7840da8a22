"""Typed configuration: the sections assembled, YAML as the file format, ``a.b=c`` overrides, and
the one rule for resuming a run with a config.

Precedence: dataclass defaults < YAML file < command-line overrides. The sections and their
checks live in ``config_sections.py``; ``docs/configuration.md`` is generated from them
(``python -m clusterflow.config``). This module must not import torch: it runs on the login node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from clusterflow.config_sections import (  # noqa: F401 - re-exported: clusterflow.config.TrainConfig etc.
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DistConfig,
    MiningConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
    _check,
    keys,
)
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

    def __post_init__(self) -> None:
        world = self.cluster.world_size
        per_step = world * self.train.grad_accum
        _check(
            self.train.batch_size % per_step == 0,
            "train.batch_size",
            self.train.batch_size,
            f"must be divisible by world size x grad_accum = {world} x {self.train.grad_accum} = {per_step} "
            f"so every rank gets the same micro-batch; try train.batch_size={max(per_step, self.train.batch_size // per_step * per_step)}",
        )

    def to_dict(self) -> dict[str, Any]:
        """Sections by their config keys (``checkpoint.async``, not the field name ``async_``)."""
        data = dataclasses.asdict(self)
        return {name: {key: data[name][fname] for key, fname in keys(SECTIONS[name]).items()} for name in data}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """Hash of everything except where the run lives, so a moved run dir still resumes."""
        data = self.to_dict()
        data["run"] = {k: v for k, v in data["run"].items() if k != "dir"}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or join(self.run.dir, "checkpoints")


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "cluster": ClusterConfig,
    "dist": DistConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "mining": MiningConfig,
    "task": TaskConfig,
    "data": DataConfig,
}


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', keeping URLs such as s3://bucket intact (a Path would mangle them)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out



# ---------------------------------------------------------------------------------------------
# Resuming: one rule for submit, run and the checkpoint restore

# Keys that may differ between a run's saved config and a later launch of it: where the run dir
# is now (a moved or copied run dir resumes from its new place).
MAY_CHANGE_ON_RESUME: frozenset[str] = frozenset({"run.dir"})


def differences(saved: Mapping[str, Any], requested: Mapping[str, Any]) -> list[str]:
    """``section.key: old -> new`` for each key both configs hold with different values, outside
    ``MAY_CHANGE_ON_RESUME``. A key only one side holds (added or removed by another clusterflow
    version, so it takes its default) is not a difference."""
    out = []
    for section, keys in saved.items():
        other = requested.get(section)
        if not isinstance(keys, Mapping) or not isinstance(other, Mapping):
            continue
        for key, old in keys.items():
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


def check_resume(saved: Mapping[str, Any], requested: Mapping[str, Any], what: str, relaunch: bool = False) -> None:
    """The one config-consistency rule, shared by ``submit``, ``run`` and the checkpoint restore:
    a run continues only with the config it started with. ``what`` names the saved side (a run
    dir, a checkpoint). A relaunch of the same job by its launcher (a Slurm requeue re-runs the
    sbatch script, which re-reads a YAML file the user may have edited since) runs on the saved
    config with a note; any other difference is refused, naming the keys."""
    diffs = differences(saved, requested)
    if not diffs:
        return
    listed = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    if relaunch:
        print(f"note: this relaunched job runs on the config of {what}, which differs from the one given now ({listed})",
              file=sys.stderr)
        return
    raise UserError(f"{what} holds a run with a different config ({listed}); to resume it, use the same config; "
                    f"to start a new run, set run.dir=<new path>")

# ---------------------------------------------------------------------------------------------
# Type coercion


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (list,):
        return "a list"
    if origin in (dict,):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` as type ``tp`` or raise a UserError naming the key, the value and the type."""
    origin = typing.get_origin(tp)
    bad = UserError(f"{key} = {value!r}: expected {_type_name(tp)}, got {type(value).__name__}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # a partition named 01 or a job name 2025 is still a name
        if not isinstance(value, str):
            raise bad
        return value
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise bad
        (item,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # a programming error, not a user one


def _field_types(section_cls: type) -> dict[str, Any]:
    """Config key -> type."""
    hints = typing.get_type_hints(section_cls)
    return {key: hints[fname] for key, fname in keys(section_cls).items()}


def build(raw: dict[str, Any], source: str = "config") -> Config:
    """Build a validated Config from a nested mapping (what the YAML file holds)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}")
    sections = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            raise UserError(f"{source}: unknown section {name!r}; valid sections: {', '.join(SECTIONS)}")
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise UserError(f"{source}: section {name!r} must be a mapping of keys, got {value!r}")
        types_ = _field_types(SECTIONS[name])
        kwargs = {}
        for key, v in value.items():
            if key not in types_:
                raise UserError(
                    f"{source}: unknown key {name}.{key}; valid keys of [{name}]: {', '.join(types_)}"
                )
            kwargs[keys(SECTIONS[name])[key]] = _coerce(f"{name}.{key}", v, types_[key])
        sections[name] = kwargs
    built = {name: cls(**sections.get(name, {})) for name, cls in SECTIONS.items()}
    return Config(**built)


def _parse_override(text: str) -> tuple[str, str, str, Any]:
    """``section.key=value`` -> (section, key, "", value); ``task.params.a=1`` -> (task, params, a, 1)."""
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise UserError(f"override {text!r} must look like section.key=value, e.g. train.epochs=3")
    section, _, name = key.strip().partition(".")
    name, _, sub = name.partition(".")
    if section not in SECTIONS:
        raise UserError(f"override {text!r}: unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
    types_ = _field_types(SECTIONS[section])
    if name not in types_:
        raise UserError(f"override {text!r}: unknown key {section}.{name}; valid keys of [{section}]: {', '.join(types_)}")
    if sub and typing.get_origin(types_[name]) is not dict:
        raise UserError(f"override {text!r}: {section}.{name} is a single value, not a mapping; write {section}.{name}=VALUE")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value  # not YAML: take it as the plain string the user typed
    if types_[name] is str and not isinstance(parsed, str):
        parsed = value  # keep '007' as '007', not 7
    return section, name, sub, parsed


def read_yaml(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise UserError(f"config file not found: {path!r} (cwd is {os.getcwd()}); pass the path of a YAML file such as configs/demo.yaml")
    if os.path.isdir(path):
        raise UserError(f"config path {path!r} is a directory; pass a YAML file such as configs/demo.yaml")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"malformed YAML at {where}: {problem}; fix the file (indentation and ':' after each key)") from None


def load(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < file < overrides, validated. Raises UserError on any bad input."""
    raw = read_yaml(path) if path else {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    # Validate the file alone first, so an error names the file rather than an override.
    build(raw, source=path or "config")
    for text in overrides:
        section, name, sub, value = _parse_override(text)
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        if sub:  # one entry of a mapping such as task.params, keeping the file's other entries
            old = raw[section].get(name)
            raw[section][name] = {**(old if isinstance(old, dict) else {}), sub: value}
        else:
            raw[section][name] = value
    return build(raw, source=f"{path} with overrides" if overrides else (path or "config"))


def from_dict(data: dict[str, Any]) -> Config:
    return build(data, source="resolved config")


def reference_markdown() -> str:
    """The configuration reference, generated from the dataclasses (docs/configuration.md)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `clusterflow/config_sections.py` by `python -m clusterflow.config > docs/configuration.md`;",
        "a test fails when this page and the code disagree.",
        "",
        "Precedence: defaults < YAML file < `section.key=value` overrides on the command line.",
        "",
    ]
    for name, cls in SECTIONS.items():
        lines += [f"## `{name}`", "", (cls.__doc__ or "").strip(), "", "| key | type | default | meaning |", "|---|---|---|---|"]
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            key = f.metadata.get("key", f.name)
            tp = hints[key]
            tname = getattr(tp, "__name__", str(tp)).replace("typing.", "")
            if typing.get_origin(tp) is not None:
                tname = str(tp).replace("typing.", "")
            lines.append(f"| `{name}.{key}` | {tname} | `{json.dumps(default)}` | {f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())

