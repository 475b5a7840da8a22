"""Reading a config file as YAML, defensively: whatever the file holds, the result is a value or a
:class:`UserError` naming the file, the line and the fix, never a traceback.

- :func:`read_text`: a regular file (or a pipe that is written to) of at most :data:`MAX_BYTES`,
  decoded as UTF-8, or UTF-16/32 recognised by a byte-order mark or by the zero bytes of its first
  characters (the YAML 1.2 rule, so a file saved as "Unicode" by a Windows editor reads the same).
- :func:`parse`: PyYAML's safe loader (on libyaml's parser) with four changes. Numbers as people
  write them (``3e-4``, ``1e10``, ``+1E-3``) are floats, as in YAML 1.2 (YAML 1.1 reads them as
  strings). A key given twice in one mapping is an error naming both lines (YAML keeps the last
  one silently). Nesting deeper than :data:`MAX_DEPTH` and anchors/aliases that expand to more
  than :data:`MAX_NODES` values ("billion laughs") are refused before anything is built from
  them, as are integers longer than Python reads. Every number keeps the text it was written as
  (``.text``), so a string field given ``007`` or ``2024.10`` gets exactly that, not ``7`` or
  ``2024.1``.

No torch here: this runs on the login node.
"""

from __future__ import annotations

import codecs
import os
import re
import select
import stat
from typing import Any

import yaml

from clusterflow.errors import UserError

MAX_BYTES = 1 << 20  # a config is a few KB; large data belongs in a file the task reads
MAX_DEPTH = 100  # far more than any config needs, far below Python's recursion limit
MAX_NODES = 100_000  # values after expanding aliases
MAX_INT_DIGITS = 4300  # Python's limit for int(str) (sys.get_int_max_str_digits)
PIPE_WAIT_S = 10.0  # how long a named pipe may stay silent before we give up on it

_FIX = "fix the file (indentation and ':' after each key)"


class YInt(int):
    """An integer as written in the file; ``text`` is what was written."""

    text = ""


class YFloat(float):
    """A float as written in the file; ``text`` is what was written."""

    text = ""


class _Refused(yaml.MarkedYAMLError):
    """A well-formed file we refuse to build a config from; ``fix`` says what to do."""

    def __init__(self, problem: str, mark: yaml.Mark | None, fix: str) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.fix = fix


def _too_deep(mark: yaml.Mark | None) -> _Refused:
    return _Refused(
        f"nesting deeper than {MAX_DEPTH} levels",
        mark,
        "a config is a few levels deep: sections, keys, and task parameters",
    )


# Python float syntax with an exponent (YAML 1.1 needs a dot and a signed exponent: 1.0e+10).
_FLOAT_EXP = re.compile(
    r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9][0-9_]*$"
)
_MERGE = "tag:yaml.org,2002:merge"


class _Checks(yaml.composer.Composer, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """PyYAML's Python composer and safe constructor with the limits and rules above, over an
    event parser chosen by the subclass."""

    def _init_loading(self) -> None:
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                raise _too_deep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> yaml.Node | None:
        """The document's root node. A parser with a nesting limit of its own (libyaml 0.2.6 stops
        at 1000 levels while scanning ahead in a flow collection, before the composer above sees
        level 101) is answered with the same refusal, so the message does not depend on which
        PyYAML or libyaml pip installed."""
        try:
            return super().get_single_node()
        except yaml.MarkedYAMLError as exc:
            if isinstance(exc, _Refused) or "nesting" not in str(exc.problem):
                raise
            raise _too_deep(exc.problem_mark) from None

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    first = seen[key].line + 1
                    raise _Refused(
                        f"duplicate key {key!r} (first given at line {first})",
                        key_node.start_mark,
                        "remove one of them; YAML would keep only the last one, silently",
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> YInt:
        digits = sum(c.isdigit() for c in node.value)
        if digits > MAX_INT_DIGITS:
            raise _Refused(
                f"an integer of {digits} digits",
                node.start_mark,
                f"numbers have at most {MAX_INT_DIGITS} digits "
                "(Python's limit); quote it if it is a string",
            )
        out = YInt(super().construct_yaml_int(node))
        out.text = node.value
        return out

    def construct_yaml_float(self, node: yaml.ScalarNode) -> YFloat:
        out = YFloat(super().construct_yaml_float(node))
        out.text = node.value
        return out


class _PyLoader(_Checks, yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):
    """Over PyYAML's own parser, where libyaml is not compiled in."""

    def __init__(self, text: str) -> None:
        yaml.reader.Reader.__init__(self, text)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        self._init_loading()


_LOADERS: list[type[_Checks]] = [_PyLoader]
if yaml.__with_libyaml__:

    class _CLoader(_Checks, yaml.cyaml.CParser):
        """Over libyaml's event parser: 5x faster than PyYAML's own, which matters for the fuzz
        test's thousands of configs."""

        def __init__(self, text: str) -> None:
            yaml.cyaml.CParser.__init__(self, text)
            self._init_loading()

    _LOADERS.append(_CLoader)

_Loader = _LOADERS[-1]

# Dates stay strings: a config has no use for date objects, and they do not survive JSON
# (manifests).
for _cls in _LOADERS:
    _cls.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
    }
    _cls.add_constructor("tag:yaml.org,2002:int", _Checks.construct_yaml_int)
    _cls.add_constructor("tag:yaml.org,2002:float", _Checks.construct_yaml_float)
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_EXP, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """Quotes every string that :func:`parse` would read as something else (``'1e3'``), so a
    config written and read back is the same config."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_EXP, list("-+0123456789."))


def dump(data: object) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def _check_expansion(root: yaml.Node) -> None:
    """Count the values ``root`` expands to, aliases followed, without building them (a node shared
    through an alias is counted once per use). Iterative: the graph may be deeper than the stack."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = (
            []
            if isinstance(node, yaml.ScalarNode)
            else (
                [n for pair in node.value for n in pair]
                if isinstance(node, yaml.MappingNode)
                else list(node.value)
            )
        )
        if done:
            open_.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_NODES:
                raise _Refused(
                    f"anchors and aliases here expand to more than {MAX_NODES} values",
                    node.start_mark,
                    "use fewer aliases (an alias copies its anchor's whole value)",
                )
            continue
        if key in sizes:
            continue
        if key in open_:
            raise _Refused(
                "an alias refers to a value that contains it (an endless structure)",
                node.start_mark,
                "remove the alias from inside its own anchor",
            )
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


def _where(source: str, mark: yaml.Mark | None) -> str:
    return f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source


def _char_at(text: str, mark: yaml.Mark | None) -> str:
    lines = text.split("\n")
    if mark is None or mark.line >= len(lines) or mark.column >= len(lines[mark.line]):
        return ""
    return lines[mark.line][mark.column]


def parse(text: str, source: str, lenient: bool = False) -> Any:
    """The value the YAML ``text`` holds; ``source`` names it in errors (a file, an override).
    ``lenient``: text that is not YAML at all is returned as the string it is (an override's value),
    while the limits above still apply."""
    loader = None
    try:
        loader = _Loader(text)
        loader.name = source
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except _Refused as exc:
        raise UserError(f"{_where(source, exc.problem_mark)}: {exc.problem}; {exc.fix}") from None
    except yaml.reader.ReaderError as exc:
        if lenient:
            return text
        line = text.count("\n", 0, exc.position) + 1
        char = chr(exc.character) if isinstance(exc.character, int) else exc.character
        raise UserError(
            f"{source}: line {line} holds the character {char!r}, which YAML does not allow "
            f"(is it a binary file?); a config is plain text"
        ) from None
    except yaml.MarkedYAMLError as exc:
        if lenient:
            return text
        problem = exc.problem or exc.context or "not valid YAML"
        fix = (
            "YAML indents with spaces, not tabs: replace the tab"
            if _char_at(text, exc.problem_mark) == "\t"
            else _FIX
        )
        raise UserError(
            f"malformed YAML at {_where(source, exc.problem_mark)}: {problem}; {fix}"
        ) from None
    except yaml.YAMLError as exc:
        raise UserError(f"malformed YAML in {source}: {str(exc).splitlines()[0]}; {_FIX}") from None
    except (ValueError, OverflowError) as exc:
        # A tagged value PyYAML cannot build (!!timestamp 2001-02-30).
        raise UserError(
            f"{source}: cannot read a value ({exc}); quote it to keep it as a string"
        ) from None
    except UnicodeEncodeError:  # a lone surrogate: only from text that never was UTF-8
        raise UserError(
            f"{source}: holds text that is not valid UTF-8; write it in UTF-8"
        ) from None
    except RecursionError:
        # A guard we did not foresee; the limits above should make this unreachable.
        raise UserError(f"{source}: nested too deeply to read; flatten it") from None
    finally:
        if loader is not None:
            loader.dispose()


def plain(value: object) -> Any:
    """``value`` with every number as a plain int or float (for task params, which leave the
    config)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


# -- reading the file --------------------------------------------------------------------------

_KINDS = (
    (stat.S_ISCHR, "a character device (like /dev/zero)"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _read_bytes(path: str) -> bytes:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(
            f"config file not found: {path!r} (cwd is {os.getcwd()}); "
            f"pass the path of a YAML file such as configs/demo.yaml"
        ) from None
    except OSError as exc:
        raise UserError(
            f"cannot read config file {path!r}: {exc.strerror}; pass a readable YAML file"
        ) from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(
            f"config path {path!r} is a directory; pass a YAML file such as configs/demo.yaml"
        )
    for test, kind in _KINDS:
        if test(st.st_mode):
            raise UserError(
                f"config path {path!r} is {kind}, not a file; "
                "pass a YAML file such as configs/demo.yaml"
            )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except PermissionError:
        raise UserError(
            f"config file {path!r} is not readable by this user (permission denied); "
            f"check its permissions with ls -l, or copy it somewhere readable"
        ) from None
    except OSError as exc:
        raise UserError(f"cannot open config file {path!r}: {exc.strerror}") from None
    try:
        if stat.S_ISFIFO(st.st_mode):
            _wait_for_writer(fd, path)
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= MAX_BYTES and (chunk := os.read(fd, min(1 << 16, MAX_BYTES + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise UserError(
            f"cannot read config file {path!r}: {exc.strerror}; pass a readable YAML file"
        ) from None
    finally:
        os.close(fd)
    if size > MAX_BYTES:
        raise UserError(
            f"config file {path!r} is larger than {MAX_BYTES >> 20} MiB (or endless); "
            "a config is a few KB of YAML: keep large data in a file that the task reads"
        )
    return b"".join(chunks)


def _wait_for_writer(fd: int, path: str) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    if not poller.poll(PIPE_WAIT_S * 1000):
        raise UserError(
            f"config path {path!r} is a named pipe and nothing wrote "
            f"to it within {PIPE_WAIT_S:.0f} s; pass a YAML file"
        )


_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)


def _encoding(data: bytes) -> tuple[str, int]:
    """(encoding, length of its byte-order mark): a BOM, else the zero bytes of the first
    characters (YAML 1.2, section 5.2), else UTF-8."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            return name, len(bom)
    head = data[:4]
    if len(head) == 4 and head[:3] == b"\0\0\0":
        return "utf-32-be", 0
    if len(head) == 4 and head[1:] == b"\0\0\0":
        return "utf-32-le", 0
    if len(head) >= 2 and head[0] == 0:
        return "utf-16-be", 0
    if len(head) >= 2 and head[1] == 0:
        return "utf-16-le", 0
    return "utf-8", 0


def read_text(path: str) -> str:
    """The text of the config file ``path`` (see the module doc for what is accepted)."""
    data = _read_bytes(path)
    name, skip = _encoding(data)
    try:
        text = data[skip:].decode(name)
    except UnicodeDecodeError as exc:
        at = skip + exc.start
        raise UserError(
            f"config file {path!r} is not {name.upper()} text (byte 0x{data[at]:02x} "
            f"at offset {at}): is it a binary file? save the config as UTF-8 text"
        ) from None
    if "\0" in text:
        raise UserError(
            f"config file {path!r} holds a NUL character at offset {text.index(chr(0))}: "
            f"is it a binary file? a config is UTF-8 text"
        )
    return text
