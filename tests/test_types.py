"""Names as types: no parameter of a clusterflow function is typed ``Any``. A value that truly
may be anything, and is inspected at run time (a config value being checked, a JSON record's
fields, an object pickled whole), is ``object``; everything else names its real type (a module,
a device, a task, a store, the run dir's ``RunPaths``). docs/architecture.md says why."""

import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "clusterflow")
ANY = {"Any", "typing.Any", "Any | None", "None | Any", "Optional[Any]", "typing.Optional[Any]"}


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    rest = [x for x in (a.vararg, a.kwarg) if x is not None]
    return a.posonlyargs + a.args + a.kwonlyargs + rest


def typed_any() -> tuple[int, list[str]]:
    """(parameters seen, "file:line function(param)" for each typed Any)."""
    seen, found = 0, []
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for arg in _parameters(fn):
                    if arg.arg in ("self", "cls"):
                        continue
                    seen += 1
                    if arg.annotation is not None and ast.unparse(arg.annotation) in ANY:
                        where = os.path.relpath(path, REPO)
                        found.append(f"{where}:{arg.lineno} {fn.name}({arg.arg})")
    return seen, found


def test_no_parameter_is_typed_any():
    seen, found = typed_any()
    assert seen > 1000  # the walk found the package's functions
    assert found == [], f"{len(found)} of {seen} parameters typed Any: {found[:20]}"


def test_every_parameter_is_annotated():
    """An unannotated parameter is an ``Any`` nobody wrote down."""
    bare = []
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            for fn in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                bare.extend(
                    f"{os.path.relpath(path, REPO)}:{arg.lineno} {fn.name}({arg.arg})"
                    for arg in _parameters(fn)
                    if arg.annotation is None and arg.arg not in ("self", "cls")
                )
    assert bare == [], f"{len(bare)} parameters without a type: {bare[:20]}"
