"""Generated configs and override lists for tests/test_fuzz_cli.py: a seeded random generator, so a
failure is reproduced by its case number.

A case starts from a small valid config (the 16-sample ``testtasks:Tiny``, one epoch, no mining)
and applies a few mutations (keys valid and not, values of every type in every YAML notation,
sections replaced or removed), then writes the text in block or flow style, sometimes damaged
(duplicated lines, tabs, anchors and alias bombs, deep nesting, truncation, binary junk) and in
one of several encodings, and adds overrides made the same way (some not UTF-8, some not
overrides at all).
"""

import os
import random

from clusterflow.config.job_config import SECTIONS, _field_types

BASE = {
    "run": {"name": "fuzz", "seed": "1"},
    "cluster": {"tasks_per_node": "1", "time_min": "10"},
    "train": {
        "epochs": "1",
        "batch_size": "8",
        "lr": "0.003",
        "progress_bar": "false",
        "eval_every_epochs": "0",
    },
    "checkpoint": {"every_steps": "1000"},
    "mining": {"enabled": "false"},
    "task": {"target": "testtasks:Tiny", "params": "{size: 16}"},
}

INTS = [
    "0",
    "1",
    "2",
    "3",
    "-1",
    "16",
    "64",
    "1e3",
    "1_000",
    "0x10",
    "0o17",
    "017",
    "1.0",
    "1.5",
    "+3",
    "9223372036854775807",
    "9223372036854775808",
    "1e30",
    "4294967295",
    "4294967296",
    "1:30",
    "'12'",
    "12.0e0",
]
FLOATS = [
    "3e-4",
    "1e10",
    "1E-3",
    ".5",
    "5.",
    "+1e-3",
    "-1e-3",
    "1_000.5",
    "1.0e+10",
    "inf",
    "-inf",
    "nan",
    ".inf",
    "-.inf",
    ".nan",
    "1e400",
    "-1e-400",
    "0.0",
    "-0.0",
    "1e-320",
    "'3e-4'",
    "0.5",
    "Infinity",
]
STRINGS = [
    "fuzz",
    "'007'",
    '""',
    "''",
    "ünïcødé",
    "训练",
    "😀",
    '"a\\nb"',
    '"\\t"',
    '"\\x00"',
    '"\\ud800"',
    '"\\x7f"',
    "memory://x",
    "s3://b/x",
    "file:///tmp/cf-fuzz",
    "file://rel",
    "/proc/x",
    "/sys/x",
    "/dev/null",
    "/dev/shm/cf-fuzz",
    "'a b'",
    "gpu|a100",
    "'%j'",
    '"$(touch /tmp/cf-fuzz-pwned)"',
    "'--qos=x'",
    "runs/x",
    ".",
    "/",
    "nope://x",
    "simplecache::memory://x",
    "'a: b'",
    "'#x'",
]
BOOLS = ["true", "false", "yes", "no", "on", "off", "maybe", "TRUE", "y", "n", "1", "0"]
NULLS = ["null", "~", ""]
SHAPES = [
    "[]",
    "{}",
    "[1, 2]",
    "[a, b]",
    "{a: 1}",
    "[[1]]",
    "{a: {b: {c: 1}}}",
    "[1, [2, [3]]]",
    "{1: 2}",
    "{null: 1}",
    "[&x 1, *x]",
    "2024-01-01",
    "!!timestamp 2001-02-30",
    "!!binary aGVsbG8=",
    "!!set {a, b}",
    "!!python/name:os.system",
    "!!str 12",
    "!!int '12'",
    "!!float 1",
    "[a, b",
    "{a: 1",
    "'unclosed",
    "*nowhere",
]
TARGETS = [
    "testtasks:Tiny",
    "testtasks:Nope",
    "nomod_fuzz:X",
    ".rel:X",
    "a:b:c",
    "clusterflow.tasks.pseudo_id:PseudoIDTask",
    "builtins:dict",
    "builtins:int",
    "os:getcwd",
    "testtasks",
    ":",
    "testtasks:tdist",
]
PARAM_KEYS = ["size", "hidden", "sise", "x", "ключ", "1", "fail_in "]
JUNK_OVERRIDES = [
    "noequals",
    "=x",
    "a=b",
    ".x=1",
    "train.=1",
    "train.epochs.x=1",
    "task.params.=1",
    "-x",
    "--nope",
    "train.epochs==3",
    " train.epochs = 3",
    "train.epochs=",
    "cluster.setup=[a, {b: c}]",
]
VALID = {
    "int": ["1", "2", "4", "8", "1e0", "2.0", "0x4", "1_0", "+4", "4.0e0"],
    "float": ["3e-4", "1e-3", ".5", "5.", "+1e-3", "1_0.5", "0.1", "1.0e+1", "'2e-3'", "0"],
    "bool": ["true", "false", "yes", "no", "on", "off", "True"],
    "str": ["fuzz", "训练", "'007'", "gpu", "'a b'", "😀", "1e3", "2024.10", "x-y_z"],
    "list": ["[a, b]", "[]", "x", "['module load x', 'echo 1e3']"],
    "dict": ["{}", "{a: 1}", "{mail-type: END}"],
}
# Keys whose values have a form of their own: mostly valid ones, some that the form refuses.
VALID_BY_KEY = {
    ("trackers", "mlflow"): ["{}", "{uri: 'sqlite:///fuzz.db'}", "{uri: x, experiment: e}"],
    ("trackers", "wandb"): ["{}", "{project: p, mode: offline}", "{project: p, mode: later}"],
    ("train", "profile"): ["''", "2-3", "1-1@0", "3-2", "1-2@9"],
    ("checkpoint", "keep_best"): ["''", "train/loss:min", "eval/acc:max", "loss"],
}
ENCODINGS = ["utf-8"] * 14 + [
    "utf-8-sig",
    "utf-16",
    "utf-16-le",
    "utf-16-be",
    "utf-32",
    "latin-1",
    "cp1252",
]


class Gen:
    def __init__(self, seed):
        self.r = random.Random(seed)

    def pick(self, xs):
        return xs[self.r.randrange(len(xs))]

    def value(self):
        kind = self.r.random()
        if kind < 0.05:
            return str(self.r.randrange(10 ** self.r.randrange(1, 40)))
        if kind < 0.07:
            return "9" * self.r.choice([4299, 4301, 6000])
        if kind < 0.09:
            n = self.r.randrange(1, 400)
            return "[" * n + "]" * n
        if kind < 0.11:
            return (
                "'"
                + "".join(
                    chr(self.r.randrange(32, 0x2FFF)) for _ in range(self.r.randrange(1, 40))
                ).replace("'", "''")
                + "'"
            )
        pools = [INTS, FLOATS, STRINGS, BOOLS, NULLS, SHAPES]
        return self.pick(self.pick(pools))

    def fitting(self, section, key):
        """A value of the key's type, in some notation: most pass the type check, some a range
        check."""
        if (section, key) in VALID_BY_KEY:
            return self.pick(VALID_BY_KEY[section, key])
        tp = _field_types(SECTIONS[section]).get(key) if section in SECTIONS else None
        name = getattr(tp, "__name__", str(tp))
        pool = VALID.get(name) or VALID["str"]
        return self.pick(pool)

    def key(self, section):
        if section in SECTIONS and self.r.random() < 0.85:
            return self.pick(list(_field_types(SECTIONS[section])))
        return self.pick(["epochz", "Dir", "lr ", "1", "null", "true", "ключ", "x.y", "'quoted'"])

    def mutate(self, cfg):
        op = self.r.random()
        section = self.pick(list(SECTIONS) + ["trian", "1", "null"])
        if op < 0.55:
            if not isinstance(cfg.get(section, {}), dict):
                cfg[section] = {}
            if section == "task" and self.r.random() < 0.5:
                key = "target" if self.r.random() < 0.5 else "params"
                value = (
                    self.pick(TARGETS)
                    if key == "target"
                    else f"{{{self.pick(PARAM_KEYS)}: {self.value()}}}"
                )
                cfg.setdefault("task", {})[key] = value
            else:
                key = self.key(section)
                cfg.setdefault(section, {})[key] = (
                    self.fitting(section, key) if self.r.random() < 0.5 else self.value()
                )
        elif op < 0.70:
            if section in cfg and isinstance(cfg[section], dict) and cfg[section]:
                del cfg[section][self.pick(list(cfg[section]))]
            else:
                cfg.pop(section, None)
        elif op < 0.85:
            cfg[section] = self.value()
        else:
            cfg[self.pick(["1", "null", "true", "'x y'", "? [a]", "ünï"])] = self.value()

    def render(self, cfg):
        lines = []
        for section, body in cfg.items():
            if not isinstance(body, dict):
                lines.append(f"{section}: {body}")
            elif self.r.random() < 0.3:
                lines.append(
                    f"{section}: {{" + ", ".join(f"{k}: {v}" for k, v in body.items()) + "}"
                )
            else:
                lines.append(f"{section}:")
                lines += [f"  {k}: {v}" for k, v in body.items()]
        return self.damage(lines)

    def damage(self, lines):
        op = self.r.random()
        if op < 0.06 and lines:
            i = self.r.randrange(len(lines))
            lines.insert(
                self.r.randrange(len(lines) + 1), lines[i]
            )  # a duplicated key (or section)
        elif op < 0.10 and lines:
            i = self.r.randrange(len(lines))
            lines[i] = (
                lines[i].replace("  ", "\t", 1) if lines[i].startswith("  ") else "\t" + lines[i]
            )
        elif op < 0.13:
            n = self.r.randrange(2, 10)
            bomb = ["run:", '  name: &a0 ["x","x","x","x","x","x","x","x","x"]']
            bomb += [f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, n)]
            lines = bomb + [ln for ln in lines if not ln.startswith("run")]
        elif op < 0.15:
            lines.append("task: {params: &p {a: *p}}")
        elif op < 0.17:
            lines = ["- " + ln for ln in lines] if self.r.random() < 0.5 else [self.value()]
        elif op < 0.19:
            lines = []
        text = "\n".join(lines) + "\n"
        if self.r.random() < 0.04:
            text = text[: self.r.randrange(len(text) + 1)]
        return text

    def encode(self, text):
        if self.r.random() < 0.04:
            return bytes(self.r.randrange(256) for _ in range(self.r.randrange(1, 3000)))
        try:
            data = text.encode(self.pick(ENCODINGS), errors="surrogatepass")
        except UnicodeEncodeError:
            data = text.encode("utf-8", errors="surrogatepass")
        if self.r.random() < 0.04 and data:
            at = self.r.randrange(len(data))
            data = (
                data[:at]
                + bytes(self.r.randrange(256) for _ in range(self.r.randrange(1, 8)))
                + data[at:]
            )
        return data

    def override(self):
        op = self.r.random()
        if op < 0.08:
            return self.pick(JUNK_OVERRIDES)
        if op < 0.12:
            return os.fsdecode(b"train.lr=" + bytes(self.r.randrange(128, 256) for _ in range(3)))
        section = self.pick(list(SECTIONS) + ["trian"])
        if section == "task" and self.r.random() < 0.5:
            if self.r.random() < 0.4:
                return f"task.target={self.pick(TARGETS)}"
            return f"task.params.{self.pick(PARAM_KEYS).strip()}={self.value()}"
        key = self.key(section).strip()
        value = self.fitting(section, key) if self.r.random() < 0.5 else self.value()
        return f"{section}.{key}={value}"

    def case(self):
        """(config file bytes, overrides)."""
        cfg = {s: dict(body) for s, body in BASE.items()}
        for _ in range(self.r.choice([0, 1, 1, 2, 3, 4])):
            self.mutate(cfg)
        overrides = [self.override() for _ in range(self.r.choice([0, 0, 1, 2, 3]))]
        return self.encode(self.render(cfg)), overrides
