"""Code frozen at submission: the task's package is copied into the run dir, and every attempt
(requeues included) imports it from there, so editing the code while a job waits changes nothing
it runs.

What is copied: the top-level package of ``task.target`` (or its single module file), found with
``importlib.util.find_spec`` of the top-level name, which imports nothing (no torch on the login
node); for a script of the user's own (``script.path``), the Python files beside it and the
packages in its folder (what ``python SCRIPT`` imports from there), and the job runs the copy.
Every file of it except caches and hidden files, up to :data:`MAX_BYTES` in all (a package
holding a dataset or weights is refused, naming the largest files). Not copied: code installed in
site-packages or the standard library (pip versions it), and clusterflow itself (it runs the job
from where it is installed). Other top-level modules the task imports are not frozen: keep task
code in one package.

What is recorded, in ``RUN_DIR/code/<version>/``: the copy, ``snapshot.json`` (module, source
path, file count, and when the code lives in a git repo: root, commit, branch, dirty flag, the
untracked files of the package) and ``git.diff`` (``git diff HEAD`` of the repo). ``<version>``
hashes all of it, so a resubmission with unchanged code reuses it and one with changed code adds a
version. ``RUN_DIR/code/current.json`` names the version the next attempt imports; it is replaced
atomically and holds a relative path, so a moved run dir keeps working.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import MutableMapping
from typing import Any

from clusterflow.errors import UserError
from clusterflow.rundir import records as rundir
from clusterflow.rundir.paths import RunPaths
from clusterflow.storage import durable

MAX_BYTES = 20 * 2**20
MAX_FILES = 2000
MAX_DIFF_BYTES = 5 * 2**20
GIT_TIMEOUT_S = 20


def _installed_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = [paths.get(k) for k in ("purelib", "platlib", "stdlib", "platstdlib")]
    roots += list(getattr(site, "getsitepackages", list)()) + [site.getusersitepackages()]
    return [os.path.realpath(r) for r in roots if r]


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def locate(target: str) -> tuple[str, str] | None:
    """(top-level module name, its package dir or .py file) to copy for ``task.target``, or None
    when the code is installed (site-packages, standard library) or is clusterflow's own."""
    top = target.partition(":")[0].split(".")[0]
    if top == "clusterflow":
        return None
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: finds the file, executes nothing
    except (ImportError, ValueError) as exc:
        raise UserError(f"task.target={target!r}: module {top!r} cannot be found ({exc})") from None
    if spec is None:
        raise UserError(
            f"task.target={target!r}: no module named {top!r} on the Python path of this shell "
            f"(cwd {os.getcwd()}); install the package, run from its directory, or set PYTHONPATH"
        )
    locations = list(spec.submodule_search_locations or [])
    if len(locations) > 1:
        raise UserError(
            f"task.target={target!r}: {top!r} is a namespace package spread over "
            f"{', '.join(locations)}; snapshot one directory (add an __init__.py) "
            "or set run.snapshot_code=false"
        )
    path = locations[0] if locations else spec.origin
    if not path or not os.path.exists(path) or (not locations and not path.endswith(".py")):
        return None  # built-in, frozen or a compiled extension: nothing we can copy
    path = os.path.realpath(path)
    if any(_inside(path, root) for root in _installed_roots()):
        return None
    return top, path


def locate_script(script: str) -> tuple[str, str]:
    """(the script's module name, its folder) to copy for ``script.path``."""
    path = os.path.realpath(script)
    if not os.path.isfile(path):
        raise UserError(f"script.path = {script!r}: no such file (looked in {os.getcwd()})")
    return os.path.splitext(os.path.basename(path))[0], os.path.dirname(path)


def _script_files(folder: str) -> list[tuple[str, str]]:
    """(absolute path, path inside the snapshot) of the Python files in ``folder`` and of every
    file of the packages (folders with an ``__init__.py``) in it, sorted."""
    out = []
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if _skipped(name) or name == "clusterflow":  # it runs the job from where it is installed
            continue
        if name.endswith(".py") and os.path.isfile(full):
            out.append((full, name))
        elif os.path.isfile(os.path.join(full, "__init__.py")):
            out.extend(_files(full))
    return out


def _skipped(name: str) -> bool:
    """Caches, hidden files and build metadata are not code."""
    return (
        name.startswith(".")
        or name == "__pycache__"
        or name.endswith((".pyc", ".pyo", ".egg-info"))
    )


def _files(source: str) -> list[tuple[str, str]]:
    """(absolute path, path inside the snapshot) of every file to copy, sorted."""
    if os.path.isfile(source):
        return [(source, os.path.basename(source))]
    base = os.path.basename(source)
    out = []
    for root, dirs, names in os.walk(source):  # symlinked directories are not followed
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        for name in sorted(names):
            if _skipped(name):
                continue
            full = os.path.join(root, name)
            if os.path.isfile(full):
                out.append((full, os.path.join(base, os.path.relpath(full, source))))
    return out


def _check_size(files: list[tuple[str, str]], source: str, max_bytes: int) -> int:
    sizes = [(os.path.getsize(f), rel) for f, rel in files]
    total = sum(s for s, _ in sizes)
    if total > max_bytes or len(files) > MAX_FILES:
        biggest = ", ".join(
            f"{rel} ({s / 2**20:.1f} MiB)" for s, rel in sorted(sizes, reverse=True)[:5]
        )
        raise UserError(
            f"the task's code at {source} is {total / 2**20:.1f} MiB in {len(files)} files, "
            f"over the snapshot limit of {max_bytes / 2**20:.0f} MiB / {MAX_FILES} files "
            f"(largest: {biggest}); move data and weights out of the package, "
            "or set run.snapshot_code=false to run the code in place"
        )
    return total


def _git(args: list[str], cwd: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            check=False,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(source: str) -> tuple[dict[str, Any] | None, str]:
    """({root, commit, branch, dirty, untracked}, diff text) of the repo holding ``source``;
    (None, "") outside a repo or without git."""
    where = source if os.path.isdir(source) else os.path.dirname(source)
    root = _git(["rev-parse", "--show-toplevel"], where)
    if root is None:
        return None, ""
    root = root.strip()
    commit = (_git(["rev-parse", "--verify", "-q", "HEAD"], root) or "").strip() or None
    branch = (_git(["rev-parse", "--abbrev-ref", "HEAD"], root) or "").strip() or None
    diff = _git(["diff", "HEAD", "--binary"], root) if commit else ""
    rel = os.path.relpath(source, os.path.realpath(root))
    untracked = (_git(["ls-files", "--others", "--exclude-standard", "--", rel], root) or "").split(
        "\n"
    )
    untracked = [u for u in untracked if u and not any(_skipped(part) for part in u.split("/"))]
    # dirty is None (unknown) when git diff failed or did not answer in time
    dirty = None if diff is None else bool(diff.strip() or untracked or not commit)
    diff = diff or ""
    info = {
        "root": root,
        "commit": commit,
        "branch": branch,
        "dirty": dirty,
        "untracked": untracked,
        "diff_truncated": len(diff.encode()) > MAX_DIFF_BYTES,
    }
    return info, diff.encode()[:MAX_DIFF_BYTES].decode(errors="replace")


def take(
    paths: RunPaths,
    target: str,
    enabled: bool = True,
    max_bytes: int = MAX_BYTES,
    script: str = "",
) -> dict[str, Any] | None:
    """Called by submit (login node) before each submission. Returns the manifest, or None when
    nothing is frozen (disabled, installed code, clusterflow's own tasks); then the pointer is
    removed so that no older snapshot is imported by mistake. ``script``: a script of the user's
    own (``script.path``) is frozen instead of ``target``."""
    pointer = paths.code_pointer
    if not enabled:
        found = None
    elif script:
        found = locate_script(script)
    else:
        found = locate(target)
    if found is None:
        if os.path.exists(pointer):
            os.remove(pointer)
        return None
    module, source = found
    files = _script_files(source) if script else _files(source)
    total = _check_size(files, source, max_bytes)
    git, diff = git_state(source)
    os.makedirs(paths.code, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=paths.code)
    try:
        digest = hashlib.sha256()
        for full, rel in files:
            dest = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            # Contents only: a read-only source must not make the copy read-only.
            shutil.copyfile(full, dest)
            with open(dest, "rb") as f:
                digest.update(rel.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        digest.update(json.dumps([git and git["commit"], diff]).encode())
        version = digest.hexdigest()[:12]
        manifest = {
            "version": version,
            "module": module,
            **({"script": os.path.basename(script)} if script else {}),
            "source": source,
            "files": len(files),
            "bytes": total,
            "git": git,
            "taken_at": time.time(),
        }
        with open(os.path.join(tmp, "git.diff"), "w", encoding="utf-8") as f:
            f.write(diff)
        with open(os.path.join(tmp, "snapshot.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        final = paths.code_version(version)
        if os.path.isdir(final):
            # The same code was frozen before: keep that copy (a job may be reading it).
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say_if_changed(paths, rundir.read_json(pointer, within=paths.root), manifest)
    durable.write_atomic(pointer, json.dumps(manifest, indent=1))
    return manifest


def _version_words(manifest: dict[str, Any]) -> str:
    git = manifest.get("git") or {}
    commit = (git.get("commit") or "")[:10]
    dirty = " with uncommitted changes" if git.get("dirty") else ""
    return f"{manifest['version']}" + (f" (commit {commit}{dirty})" if commit else "")


def _say_if_changed(paths: RunPaths, before: dict[str, Any] | None, now: dict[str, Any]) -> None:
    """A resubmission that brings other code than the run last ran: said, with where the earlier
    copy stays (the run continues from its checkpoint with the new code)."""
    if not isinstance(before, dict) or before.get("version") in (None, now["version"]):
        return
    print(
        f"note: the task's code changed since the last submission to {paths.root}: "
        f"{now['module']} {_version_words(before)} -> {_version_words(now)}; the run continues "
        f"with the new code; the earlier copy stays in "
        f"{paths.code_version(before['version'])}",
        file=sys.stderr,
    )


def describe(paths: RunPaths, damaged: list[str] | None = None) -> dict[str, Any] | None:
    """For status: {module, version, commit, dirty, path} of the snapshot the next attempt
    imports; None when nothing was frozen, or when code/current.json does not fit its schema
    (named in ``damaged``, when given)."""
    manifest, said = rundir.read_checked(
        paths.code_pointer, rundir.CODE_POINTER, "code/current.json", within=paths.root
    )
    if damaged is not None:
        damaged += said
    if not manifest:
        return None
    git = manifest.get("git") or {}
    return {
        "module": manifest["module"],
        **({"script": manifest["script"]} if manifest.get("script") else {}),
        "version": manifest["version"],
        "commit": git.get("commit"),
        "dirty": git.get("dirty"),
        "path": paths.code_version(manifest["version"]),
    }


def activate(
    paths: RunPaths, environ: MutableMapping[str, str] | None = None
) -> dict[str, Any] | None:
    """Called by every rank of every attempt before the task is imported: put the frozen copy
    first on sys.path (and PYTHONPATH, for worker processes) and forget any copy imported
    before."""
    damaged: list[str] = []
    info = describe(paths, damaged)
    if damaged:
        raise UserError(
            f"{paths.code_pointer} is damaged ({'; '.join(damaged)}); "
            "submit the run again to take a new code snapshot"
        )
    if info is None:
        return None
    path = os.path.abspath(info["path"])
    if not os.path.isdir(os.path.join(path, info["module"])) and not os.path.isfile(
        os.path.join(path, info["module"] + ".py")
    ):
        raise UserError(
            f"the code snapshot {path} named by {paths.code_pointer} "
            "is missing or incomplete; submit the run again to take a new one"
        )
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    # A copy of the names first: another thread of this process may import meanwhile (a warm
    # standby's preloading leaves threads that do), and a dict must not change while iterated.
    for name in list(sys.modules):
        if name == info["module"] or name.startswith(info["module"] + "."):
            sys.modules.pop(name, None)
    importlib.invalidate_caches()
    env = os.environ if environ is None else environ
    env["PYTHONPATH"] = os.pathsep.join(
        [path, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != path]]
    )
    return info
