"""The shape of the package: its layers and the login side's freedom from torch and faiss
(import-linter), no import cycles at any depth, no function-level import of a clusterflow module
except where a module says why, lines within 100 characters. docs/architecture.md shows the
contracts."""

import ast
import os
import shutil
import subprocess
import sys

from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

PACKAGE = os.path.join(REPO, "clusterflow")
LOGIN_CONTRACT = "the login side imports neither torch nor faiss"
# Function-level imports of clusterflow modules, each for a reason other than a cycle: the
# console script loads only the command asked for, the login node loads the job's code
# (torch) only when it hands a job to submitit, and `import clusterflow` loads the library API
# (torch) only when a script asks for clusterflow.start (a PEP 562 __getattr__).
LAZY_ALLOWED = {
    ("clusterflow", "clusterflow.job.script"),
    ("clusterflow", "clusterflow.train.session"),
    ("clusterflow.cli", "clusterflow.launch.submit"),
    ("clusterflow.cli", "clusterflow.job.run"),
    ("clusterflow.cli", "clusterflow.manage.status"),
    ("clusterflow.cli", "clusterflow.manage.logs"),
    ("clusterflow.cli", "clusterflow.manage.cancel"),
    ("clusterflow.cli", "clusterflow.web.server"),
    ("clusterflow.launch.jobs", "clusterflow.job.job"),
    ("clusterflow.launch.jobs", "clusterflow.train.memory_estimate"),
}


def modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], REPO).replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(importer, imported, inside a function) for every import of a clusterflow module."""
    out = []
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            out.extend(_imports_of(name, ast.parse(f.read()), mods))
    return out


def _imports_of(name: str, tree: ast.AST, mods: dict[str, str]) -> list[tuple[str, str, bool]]:
    out = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("clusterflow"):
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    out.append((name, full if full in mods else child.module, nested))
            elif isinstance(child, ast.Import):
                out.extend(
                    (name, a.name, nested) for a in child.names if a.name.startswith("clusterflow")
                )
            funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
            visit(child, nested or isinstance(child, funcs))

    visit(tree, False)
    return out


def lint_imports(root: str) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package and pyproject.toml found in ``root``."""
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which(
        "lint-imports"
    )
    assert lint, "import-linter is not installed (pip install -e '.[test]')"
    env = {**os.environ, "PYTHONPATH": root}
    return subprocess.run(
        [lint], check=False, cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_layer_contracts_hold():
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def login_side_modules() -> list[str]:
    """Every module the forbidden contract covers: its source_modules and what they hold."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (login,) = [c for c in contracts if c["name"] == LOGIN_CONTRACT]
    return sorted(
        m
        for m in modules()
        if any(m == s or m.startswith(s + ".") for s in login["source_modules"])
    )


def test_torch_at_the_top_of_any_login_side_module_breaks_the_forbidden_contract(tmp_path):
    """A copy of the package where every login-side module imports torch at its top (and one
    imports faiss): lint-imports names each of them; the unchanged copy passes."""
    copy = str(tmp_path)
    shutil.copytree(PACKAGE, os.path.join(copy, "clusterflow"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), copy)
    clean = lint_imports(copy)
    assert clean.returncode == 0 and "0 broken" in clean.stdout, clean.stdout + clean.stderr

    mods = modules()
    login = login_side_modules()
    assert {"clusterflow.rundir.paths", "clusterflow.submit", "clusterflow.slurm.commands"} <= set(
        login
    )
    for name in login:
        path = os.path.join(copy, os.path.relpath(mods[name], REPO))
        lines = open(path, encoding="utf-8").read().splitlines(keepends=True)
        # After the docstring and ``from __future__``, where an ordinary import would go.
        at = next((i + 1 for i, line in enumerate(lines) if line.startswith("from __future__")), 0)
        heavy = "faiss" if name == "clusterflow.sweeps.index" else "torch"
        lines.insert(at, f"import {heavy}\n")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(lines)
    broken = lint_imports(copy)
    assert broken.returncode != 0
    report = broken.stdout.replace("\n", " ")
    assert f"{LOGIN_CONTRACT} BROKEN" in report
    named = {n for n in login if f"{n} -> torch" in report or f"{n} -> faiss" in report}
    assert named == set(login), sorted(set(login) - named)


def test_importing_every_login_side_module_loads_neither_torch_nor_faiss():
    """What import-linter cannot see: importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``
    first, so a package that re-exports a heavy module would load torch at run time."""
    login = [m for m in login_side_modules() if not m.endswith("__main__")]
    code = (
        f"import importlib, sys\nfor m in {login!r}:\n    importlib.import_module(m)\n"
        "print(sorted({'torch', 'torchvision', 'faiss'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_import_cycle_at_any_depth():
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for src, dst, _ in imports(mods):
        if dst in mods and dst != src and not src.startswith(dst + "."):  # its own package's face
            graph[src].add(dst)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            connect(v)
    assert cycles == []


def test_function_level_imports_have_a_reason():
    lazy = {(src, dst) for src, dst, nested in imports(modules()) if nested}
    assert lazy - LAZY_ALLOWED == set()


def test_torch_is_imported_at_module_level_only():
    """torch is a hard dependency of the job side: a module that needs it imports it at its top,
    where the forbidden contract sees it. Only optional extras (faiss, mlflow, wandb, pynvml,
    matplotlib, submitit) may be imported inside a function; and torch's sharding stack (FSDP2,
    DTensor, DCP: a second of every rank's start-up) in the one module that owns it,
    clusterflow.distributed.sharding, which imports torch itself at its top."""
    nested = []
    for name, path in modules().items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        if name == "clusterflow.distributed.sharding":
            top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
            assert "torch" in top, top
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    targets = [node.module or ""]
                else:
                    continue
                heavy = [t for t in targets if t.split(".")[0] in ("torch", "torchvision")]
                nested.extend(f"{name}:{node.lineno} {t}" for t in heavy)
    assert nested == []


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
    return name == "TYPE_CHECKING"


def test_type_checking_blocks_name_only_packages_outside_clusterflow():
    """import-linter skips imports under ``if TYPE_CHECKING:`` (they never run), so a torch-free
    module may name torch's types there. A clusterflow module named there would be an import the
    layer and cycle checks cannot see: refused."""
    hidden = []
    for name, path in modules().items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for block in ast.walk(tree):
            if not (isinstance(block, ast.If) and _is_type_checking(block.test)):
                continue
            for node in ast.walk(block):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = ["." * node.level + (node.module or "")]
                else:
                    continue
                hidden.extend(
                    f"{name}:{node.lineno} {t}"
                    for t in targets
                    if t.startswith(".") or t.split(".")[0] == "clusterflow"
                )
    assert hidden == []
