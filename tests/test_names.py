"""Shared names have one owner each: no run state, stop reason, stall cause, job outcome,
checkpoint file name, checkpoint format, checkpoints folder or lease file name is written as a
string literal outside the module that defines it (the others import the name).

The package is read with ``ast``, so docstrings, comments and words inside a longer message (an
f-string's text) do not count; a literal equal to a name does, wherever it stands (a comparison,
a dict key, a return value). ``ALLOWED`` lists the few places where such a word is something
else, each with why.
"""

from __future__ import annotations

import ast
import os

import clusterflow
from clusterflow.config.job_config import CHECKPOINTS
from clusterflow.job.requeue import REQUEUE_OUTSIDE
from clusterflow.rundir.states import Cause, State, StopReason
from clusterflow.storage import names

PACKAGE = os.path.dirname(clusterflow.__file__)

# literal -> the module (relative to the package's parent) that owns it
OWNERS = {
    # Cause.ERROR ("error") is also every record's key for a message: only the stall is owned.
    **{str(s): "clusterflow/rundir/states.py" for s in (*State, *StopReason, Cause.STALL)},
    REQUEUE_OUTSIDE: "clusterflow/job/requeue.py",
    **{
        n: "clusterflow/storage/names.py"
        for n in (names.MANIFEST, names.MODEL, names.TRAIN_STATE, names.DCP)
    },
    CHECKPOINTS: "clusterflow/config/job_config.py",
}
# A lease record's name is built by one function (any text holding "gen-", f-strings included).
LEASE_PREFIX, LEASE_OWNER = "gen-", ("clusterflow/rundir/lease.py", {"gen_file", "<module>"})

ALLOWED = {
    # errors.py is below rundir/ in the layers: the word every command prints on Ctrl-C.
    ("clusterflow/errors.py", "interrupted"),
    # status --json's key for the list of kept checkpoints, not the folder's name.
    ("clusterflow/manage/status.py", "checkpoints"),
    # the same key of status's, read by the dashboard's run page.
    ("clusterflow/web/views.py", "checkpoints"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _literals(tree: ast.AST):
    """(string constant, line, enclosing function name or <module>, inside an f-string's text)."""
    skip = _docstrings(tree)

    def walk(node, where, in_fstring):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, child.name, False)
            elif isinstance(child, ast.JoinedStr):
                yield from walk(child, where, True)
            elif isinstance(child, ast.FormattedValue):
                yield from walk(child, where, False)
            elif isinstance(child, ast.Constant):
                if isinstance(child.value, str) and id(child) not in skip:
                    yield child.value, child.lineno, where, in_fstring
            else:
                yield from walk(child, where, in_fstring)

    yield from walk(tree, "<module>", False)


def _misplaced(package: str) -> list[str]:
    out = []
    root = os.path.dirname(package)
    for folder, _, files in os.walk(package):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for value, line, where, in_fstring in _literals(tree):
                owner = None if in_fstring else OWNERS.get(value)
                if owner and owner != rel and (rel, value) not in ALLOWED:
                    out.append(f"{rel}:{line}: {value!r} (import it from {owner})")
                if LEASE_PREFIX in value and (rel != LEASE_OWNER[0] or where not in LEASE_OWNER[1]):
                    out.append(f"{rel}:{line}: {value!r} (use lease.gen_file / lease.generation)")
    return out


def test_no_shared_name_is_a_literal_outside_its_owner():
    misplaced = _misplaced(PACKAGE)
    assert not misplaced, "shared names written as literals:\n" + "\n".join(misplaced)


def test_the_scan_finds_a_literal_and_skips_docstrings_and_messages(tmp_path):
    pkg = tmp_path / "clusterflow"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        '"""A docstring may say running and model.pt."""\n'
        "def f(state, n):\n"
        '    """completed"""\n'
        '    print(f"stopped at {n}; model.pt kept")\n'
        '    return state == "running", "model.pt", f"gen-{n}.json"\n'
    )
    assert _misplaced(str(pkg)) == [
        "clusterflow/mod.py:5: 'running' (import it from clusterflow/rundir/states.py)",
        "clusterflow/mod.py:5: 'model.pt' (import it from clusterflow/storage/names.py)",
        "clusterflow/mod.py:5: 'gen-' (use lease.gen_file / lease.generation)",
    ]
