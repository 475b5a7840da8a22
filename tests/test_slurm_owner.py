"""clusterflow/slurm/ is the only package that talks to Slurm: it alone starts sbatch, squeue,
scontrol, sacct, scancel and sinfo (by subprocess, or through submitit's SlurmExecutor) and uses
submitit's private sbatch rendering. And it stays low in the layers: no run dirs, no launching."""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "clusterflow")
SLURM = os.path.join(PACKAGE, "slurm")
COMMANDS = {"sbatch", "squeue", "scontrol", "sacct", "scancel", "sinfo"}
# the ways to start a program: a module that uses one of these and names a Slurm command runs it
RUNNERS = {
    "subprocess",
    "os.system",
    "os.popen",
    "os.execv",
    "os.execvp",
    "os.execvpe",
    "os.execl",
    "os.execlp",
    "os.spawnv",
    "os.spawnvp",
    "os.posix_spawn",
    "os.posix_spawnp",
    "pty.spawn",
    "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell",
}
# submitit's way to Slurm (AutoExecutor picks Slurm where sbatch is), and its private renderer
SUBMITIT_SLURM = {"SlurmExecutor", "AutoExecutor", "_make_sbatch_string"}
# what clusterflow/slurm may import from clusterflow (the layers below it)
SLURM_MAY_IMPORT = (
    "clusterflow.slurm",
    "clusterflow.config",
    "clusterflow.distributed.env",
    "clusterflow.storage",
    "clusterflow.errors",
)


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _docstrings(tree):
    out = set()
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def imported(tree):
    """Every module an import names (at any depth, function bodies too)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def offences(source):
    """What in this source does a job that belongs to clusterflow/slurm."""
    tree = ast.parse(source)
    found = []
    modules = imported(tree)
    used = {_dotted(n) for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))}
    names = modules + sorted(d for d in used if d)
    runs = any(m == r or m.startswith(r + ".") for m in names for r in RUNNERS)
    skip = _docstrings(tree)
    # a string that starts with a Slurm command (its path too): an argv[0] or a shell command line
    words = [
        n.value.split()[:1]
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
    ]
    named = sorted({os.path.basename(w[0]) for w in words if w} & COMMANDS)
    if runs and named:
        found.append(f"starts a program and names {', '.join(named)}")
    found += [
        f"imports {m}" for m in modules if m == "submitit.slurm" or m.startswith("submitit.slurm.")
    ]
    for n in ast.walk(tree):
        name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else None
        if name in SUBMITIT_SLURM:
            found.append(f"uses {name} (line {n.lineno})")
    for m in modules:
        if m.split(".")[-1] in SUBMITIT_SLURM:
            found.append(f"imports {m}")
    return found


def package_modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_only_clusterflow_slurm_talks_to_slurm():
    bad = {}
    for path in package_modules():
        if os.path.commonpath([path, SLURM]) == SLURM:
            continue
        with open(path, encoding="utf-8") as f:
            found = offences(f.read())
        if found:
            bad[os.path.relpath(path, REPO)] = found
    assert not bad, f"Slurm commands and submitit's Slurm side belong in clusterflow/slurm/: {bad}"


@pytest.mark.parametrize(
    "source",
    [
        "import subprocess\ndef f(j):\n    subprocess.run(['scancel', j])\n",
        "from subprocess import run\ndef f():\n    return run(['/usr/bin/sinfo', '-h'])\n",
        (
            "import subprocess\nCMD = 'squeue -h -j {}'\n"
            "def f(j):\n    subprocess.check_output(CMD.format(j), shell=True)\n"
        ),
        "import os\ndef f(j):\n    os.system('scontrol requeue ' + j)\n",
        "import submitit\nex = submitit.SlurmExecutor(folder='x')\n",
        "from submitit import AutoExecutor\n",
        "from submitit.slurm.slurm import _make_sbatch_string\n",
        "def f():\n    import submitit.slurm\n",
    ],
)
def test_the_scan_finds_each_way_of_talking_to_slurm(source):
    assert offences(source)


@pytest.mark.parametrize(
    "source",
    [
        '"""Says ``scancel``."""\nimport subprocess\nsubprocess.run(["git", "rev-parse"])\n',
        "import shutil\nshutil.which('sbatch')\n",  # looking is not starting
        "import submitit\nex = submitit.LocalExecutor(folder='x')\n",
    ],
)
def test_the_scan_lets_the_rest_be(source):
    assert offences(source) == []


def test_clusterflow_slurm_imports_only_the_layers_below_it():
    bad = {}
    for name in sorted(os.listdir(SLURM)):
        if name.endswith(".py"):
            with open(os.path.join(SLURM, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            wrong = [
                m
                for m in imported(tree)
                if m.startswith("clusterflow.")
                and not any(m == ok or m.startswith(ok + ".") for ok in SLURM_MAY_IMPORT)
            ]
            if wrong:
                bad[name] = wrong
    assert not bad, f"clusterflow/slurm may import only {', '.join(SLURM_MAY_IMPORT)}: {bad}"
