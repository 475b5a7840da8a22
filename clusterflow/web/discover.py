"""Which runs and sweeps the dashboard shows: the PATHs it was given, searched as they change.

A PATH is a run dir (it holds config.yaml), a sweep dir (sweep.json) or a folder of them, found
at any depth below it (up to :data:`MAX_DEPTH`). Searching again costs one ``stat`` per folder
known: a folder is listed again only when its modification time changed (a new run dir inside
it, a config.yaml written into it, a sweep index rewritten). Nothing outside the PATHs is ever
taken: symbolic links are not followed, hidden folders are passed over, and a sweep member whose
name would lead out of its sweep dir is left out.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from clusterflow import rundir
from clusterflow.errors import UserError
from clusterflow.sweeps import index as sweep_index

MAX_DEPTH = 8
# Folders listed per search at most: a PATH such as $HOME must not take minutes.
MAX_FOLDERS = 20_000

RUN, SWEEP, FOLDER = "run", "sweep", "folder"


@dataclass(frozen=True)
class Found:
    """A run or a sweep: ``root`` its real path, ``name`` as the pages show it (relative to the
    PATH given, the PATH's own name first), ``sweep`` the sweep's root for a member."""

    kind: str
    root: str
    name: str
    sweep: str | None = None

    @property
    def id(self) -> str:
        return ident(self.root)


def ident(root: str) -> str:
    """The id of a run or sweep in URLs: its path never appears in one."""
    return hashlib.sha1(root.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def inside(root: str, path: str) -> bool:
    """Whether ``path``, symbolic links resolved, lies within ``root`` (a real path)."""
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def check_paths(given: list[str]) -> list[str]:
    """The PATHs as real paths; a missing one or a file is refused in one line."""
    out = []
    for p in given:
        if not os.path.isdir(p):
            what = "is a file" if os.path.exists(p) else "does not exist"
            raise UserError(
                f"{p!r} {what}; pass a run dir, a sweep dir or a folder that holds them "
                "(the run.dir you submitted, or its parent)"
            )
        out.append(os.path.realpath(p))
    return out


def _kind(folder: str) -> str:
    paths = rundir.RunPaths(folder)
    if os.path.isfile(paths.sweep_index):
        return SWEEP
    if os.path.isfile(paths.config):
        return RUN
    return FOLDER


def _mtime(folder: str) -> int | None:
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    return st.st_mtime_ns


class Finder:
    """``Finder(paths).scan()``: every run and sweep under ``paths``, by root."""

    def __init__(self, given: list[str]) -> None:
        self.roots = check_paths(given)
        self.labels = {r: os.path.basename(r.rstrip(os.sep)) or r for r in self.roots}
        # folder -> (its mtime when listed, its kind, its subfolders or a sweep's member names)
        self._seen: dict[str, tuple[int, str, list[str]]] = {}
        self.truncated = False  # MAX_FOLDERS was reached in the last search
        self.searched = 0  # folders looked at in the last search (0: none yet)

    def scan(self) -> dict[str, Found]:
        found: dict[str, Found] = {}
        visited: set[str] = set()
        budget = [MAX_FOLDERS]
        for root in self.roots:
            self._visit(root, root, 0, found, visited, budget)
        self.truncated = budget[0] <= 0
        self.searched = len(visited)
        self._seen = {k: v for k, v in self._seen.items() if k in visited}
        return found

    def _name(self, root: str, folder: str) -> str:
        rel = os.path.relpath(folder, root)
        return self.labels[root] if rel == "." else os.path.join(self.labels[root], rel)

    def _visit(
        self,
        root: str,
        folder: str,
        depth: int,
        found: dict[str, Found],
        visited: set[str],
        budget: list[int],
    ) -> None:
        if budget[0] <= 0 or folder in visited:
            return
        budget[0] -= 1
        mtime = _mtime(folder)
        if mtime is None:
            return
        visited.add(folder)
        seen = self._seen.get(folder)
        if seen is None or seen[0] != mtime:
            kind = _kind(folder)
            seen = (mtime, kind, self._list(folder, kind, depth))
            self._seen[folder] = seen
        _, kind, listed = seen
        name = self._name(root, folder)
        if kind == RUN:
            found[folder] = Found(RUN, folder, name)
        elif kind == SWEEP:
            found[folder] = Found(SWEEP, folder, name)
            for member in self._members(folder, name, listed):
                found[member.root] = member
        else:
            for sub in listed:
                self._visit(root, sub, depth + 1, found, visited, budget)

    def _list(self, folder: str, kind: str, depth: int) -> list[str]:
        """A folder's subfolders to search, or a sweep's member names (none for a run)."""
        if kind == SWEEP:
            try:
                index = sweep_index.read_index(rundir.RunPaths(folder)) or {}
            except UserError:
                return []  # a damaged index: the sweep's row says so
            members = index.get("members") if isinstance(index.get("members"), list) else []
            names = [m.get("name") if isinstance(m, dict) else None for m in members]
            return [n for n in names if isinstance(n, str) and n]
        if kind == RUN or depth >= MAX_DEPTH:
            return []
        try:
            with os.scandir(folder) as it:
                subs = [
                    e.path
                    for e in it
                    if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
                ]
        except OSError:
            return []
        return sorted(subs)

    def _members(self, sweep: str, name: str, members: list[str]) -> list[Found]:
        """A sweep's members that have a run dir (a member not submitted yet has none)."""
        paths = rundir.RunPaths(sweep)
        out = []
        for member in members:
            target = paths.member(member)
            if os.path.islink(target) or not inside(sweep, target):
                continue
            if os.path.isfile(rundir.RunPaths(target).config):
                out.append(Found(RUN, os.path.realpath(target), os.path.join(name, member), sweep))
        return out
