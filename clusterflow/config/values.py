"""From parsed YAML values to the typed config fields, each refusal naming the key, the value and
the fix.

- Numbers as people write them: a float field takes anything Python's ``float()`` reads (``3e-4``,
  ``1_000.5``, ``.5``, ``+1E-3``), then must be finite (``inf`` and ``nan`` are refused). An
  integer field takes a whole number in any of those notations, exactly (``1e3`` is 1000, ``1.5e3``
  is 1500, ``1.5`` and ``1e-3`` are refused), and at most 2**63-1.
- A string field takes the text as written (``007`` stays ``007``), free of control characters
  (a line break in a job name would break the sbatch script) and of text that is not UTF-8.
- A mapping (``task.params``, ``cluster.sbatch_extra``) holds plain values only: string keys, and
  strings, numbers, booleans, null, lists and mappings, which survive YAML, JSON and pickling.
"""

from __future__ import annotations

import math
import types
import typing
from decimal import Decimal, InvalidOperation
from typing import Any

from clusterflow.config.yaml_file import YFloat, YInt, plain
from clusterflow.errors import UserError

INT_MAX = 2**63 - 1  # what the C libraries underneath take (int64)
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def type_name(tp: object) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(t) for t in typing.get_args(tp))
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    return _NAMES.get(tp, str(tp))


def short(text: str, limit: int = 100) -> str:
    """``text``, cut in the middle when longer than ``limit`` (a message stays one readable
    line)."""
    return (
        text
        if len(text) <= limit
        else f"{text[: limit - 30]}...{text[-20:]} ({len(text)} characters)"
    )


def shown(value: object) -> str:
    """The value as the user wrote it, for messages."""
    if isinstance(value, (YInt, YFloat)) and value.text:
        return short(value.text)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return short(repr(value))


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return (
        "int"
        if isinstance(value, YInt)
        else "float"
        if isinstance(value, YFloat)
        else type(value).__name__
    )


def coerce(key: str, value: object, tp: object) -> Any:
    """``value`` as type ``tp`` or a UserError naming the key, the value and the type."""
    origin = typing.get_origin(tp)
    if (value is None and origin is not dict) or (value == "" and tp in (int, float, bool)):
        raise UserError(f"{key} is empty; give it a value, or remove the key to use its default")
    bad = UserError(f"{key} = {shown(value)}: expected {type_name(tp)}, got {_kind(value)}")
    # A union: the first member that takes the value (mining.threshold: a number or auto).
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(tp):
            try:
                return coerce(key, value, member)
            except UserError as exc:
                if not str(exc).startswith(f"{key} = {shown(value)}: expected "):
                    # A value of that type, but a bad one ("inf": not finite), not a value of
                    # another type.
                    raise
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "true",
            "false",
            "yes",
            "no",
            "1",
            "0",
            "on",
            "off",
        ):
            return value.lower() in ("true", "yes", "1", "on")
        raise bad
    if tp is int:
        return _integer(key, value, bad)
    if tp is float:
        return _number(key, value, bad)
    if tp is str:
        return _text(key, value, bad)
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise bad
        (item,) = typing.get_args(tp)
        return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise bad
        _check_plain(key, value)
        return plain(value)
    # A programming error, not a user one.
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _integer(key: str, value: object, bad: UserError) -> int:
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        out = int(value)
    elif isinstance(value, (str, YFloat)) or (isinstance(value, float) and math.isfinite(value)):
        text = (
            value.text
            if isinstance(value, YFloat)
            else value
            if isinstance(value, str)
            else repr(value)
        )
        try:
            exact = Decimal(text.strip().replace("_", ""))
        except InvalidOperation:
            raise bad from None
        if not exact.is_finite() or exact != exact.to_integral_value():
            raise UserError(
                f"{key} = {shown(value)}: expected an integer (a whole number such as 3 or 1e3)"
            )
        if exact.adjusted() > 18:
            raise UserError(f"{key} = {shown(value)}: out of range; at most {INT_MAX} (2**63-1)")
        out = int(exact)
    else:
        raise bad
    if abs(out) > INT_MAX:
        raise UserError(f"{key} = {shown(value)}: out of range; at most {INT_MAX} (2**63-1)")
    return out


def _number(key: str, value: object, bad: UserError) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    try:
        out = float(value)
    except ValueError:
        raise bad from None
    except OverflowError:  # an integer beyond any float
        out = math.inf
    if not math.isfinite(out):
        raise UserError(f"{key} = {shown(value)}: must be a finite number")
    return out


def _text(key: str, value: object, bad: UserError) -> str:
    if isinstance(value, (YInt, YFloat)) and value.text:
        value = value.text  # a partition named 007 or a run dir 2024.10 is kept as written
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise bad
    for i, ch in enumerate(value):
        if "\ud800" <= ch <= "\udfff":
            raise UserError(
                f"{key} = {value!r}: holds text that is not valid UTF-8 (at position {i}); "
                f"write it in UTF-8 (check the terminal's locale, e.g. LANG=C.UTF-8)"
            )
        if (ch < " " and ch != "\t") or ch == "\x7f":
            raise UserError(
                f"{key} = {value!r}: holds the control character {ch!r} at position {i}, "
                f"which would break the job script or a file name; remove it"
            )
    return value


def _check_plain(key: str, value: object) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise UserError(
                    f"{key} has the key {shown(k)} ({_kind(k)}); "
                    f"keys are names: quote it, e.g. '{k}'"
                )
            _check_plain(f"{key}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(f"{key}[{i}]", v)
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise UserError(
            f"{key} = {value!r}: expected a plain value (a string, number, true/false, "
            f"list or mapping), got {type(value).__name__}; quote it to pass it as a string"
        )
