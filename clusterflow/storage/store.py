"""Checkpoint store over fsspec: a checkpoint exists only once it is committed.

Layout under the store root (``RUN_DIR/checkpoints`` by default, or any fsspec URL)::

    step-<N>/model.pt         plain state_dict (torch.load(..., weights_only=True) works
                              without clusterflow)
    step-<N>/train_state.pt   optimizer, scheduler, scaler, counters, RNG states, pseudo-labels, ...
    step-<N>/manifest.json    written last: files (size and digest each), step, position, config,
                              versions

Commit protocol: every file is written into ``.tmp-step-<N>-<random>/``, flushed and fsynced, the
manifest is written last, and the folder is renamed to ``step-<N>`` (atomic on a POSIX
filesystem; on object stores the manifest check below covers a partial copy). A reader trusts
only a step whose manifest lists exactly the files its folder holds, each with the recorded size
and digest (BLAKE3, or sha256 in manifests of older versions: each file's record names its
algorithm), and which passes the owner's ``check`` (the checkpoint id inside every file,
``checkpoint/identity.py``); anything else is skipped with a warning naming it, and the previous
step is used. A file the manifest does not list makes the step damaged too: nothing checks it,
and a reader that finds files by name (DCP) would load it.

One step, two states: at the last step of an epoch the trainer holds a state before and one after
the end-of-epoch work (eval, mining). A stop there commits the first; the second must still
replace it, or a finished mining round is redone after a later crash. So a save whose manifest
``position`` is greater than the committed step's *supersedes* it: the new folder is staged
completely, the old ``step-<N>`` is renamed to ``.superseded-step-<N>-*``, the new one is renamed
in, and the old one is deleted in the background. Every other save of a committed step is refused:
a committed state is never overwritten. ``clean_debris`` finishes whatever a crash interrupted:
a complete staged folder (its manifest verifies) is published by the same rule, an incomplete
one is removed, and set-aside folders are deleted. Pruned steps are renamed to
``.pruned-step-<N>-*``, a name that is never published again. docs/preemption.md walks through
every crash point.

A damaged committed step is never deleted: when the run reaches that step again it is renamed to
``damaged-step-<N>-<random>/`` (kept for inspection) and the step is written anew.

Sharded checkpoints (``train.parallel=fsdp``) use the same folders and the same commit: rank 0
``begin``s a staging folder, every rank writes its shards into it and hashes them, and rank 0
``commit``s it with a manifest listing every rank's files (``format: dcp``); ``verify`` checks the
shards' sizes and digests without loading them (every rank reads its part later).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec

from clusterflow.storage import confined, diskfull, durable, private
from clusterflow.storage import manifest as schema
from clusterflow.storage.names import DCP, MANIFEST
from clusterflow.storage.worker import Worker
from clusterflow.version import __version__

log = logging.getLogger("clusterflow.store")

_STEP = re.compile(r"^step-(\d+)$")
_STAGED = re.compile(r"^\.tmp-step-(\d+)-[0-9a-f]+$")
# Never published; deleted by clean_debris.
_SET_ASIDE = (".superseded-step-", ".pruned-step-", ".tmp-step-")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    manifest: dict[str, Any]
    # Each file, deserialized with weights_only=True while its hash was checked.
    objects: dict[str, Any]

    def load(self, name: str) -> Any:
        return self.objects[name]


def position(manifest: Mapping[str, Any] | None) -> tuple[int, ...]:
    """Order of two states saved at the same step; a manifest without one sorts first."""
    return tuple((manifest or {}).get("position") or ())


def _versions(codec: durable.Codec | None) -> dict[str, str]:
    versions = dict(codec.versions) if codec is not None else {}
    return {"python": sys.version.split()[0], **versions, "clusterflow": __version__}


# Deletes set-aside folders of local stores, off the caller's path.
_DELETER = Worker("clusterflow-deleter")


@dataclass(frozen=True)
class AlsoKeep:
    """The steps a store keeps besides its newest ``keep_last``: ``every``: the multiples of it
    (0: none); ``best``: (metric, "min" | "max"), the step whose manifest's ``metrics`` holds the
    best value (``checkpoint.keep_every_steps`` and ``checkpoint.keep_best``)."""

    every: int = 0
    best: tuple[str, str] | None = None


class CheckpointStore:
    def __init__(
        self,
        root: str,
        keep_last: int = 3,
        fsync: bool = True,
        *,
        also_keep: AlsoKeep | None = None,
        check: Callable[[Checkpoint], None] | None = None,
        codec: durable.Codec | None = None,
        readable: bool = True,
        private: bool = False,
    ) -> None:
        """``also_keep``: the steps kept besides the newest ``keep_last`` (none when None);
        ``check``: what a step must satisfy beyond its manifest, sizes and digests to be read
        (raises ValueError naming what is wrong); ``codec``: how the files' objects are written
        and read (``storage.tensors.TORCH`` in the job); None where only steps and manifests are
        read (the login side), or only bytes saved; ``readable``: manifests indented for a human
        who opens one, else compact (json's C encoder: several times faster for a manifest that
        holds the config, which snapshots every few steps write); ``private``: a local store that
        only this user may read, on a node others share (snapshots in memory): its folders are
        made private (``private.py``: exclusive creation, mode 0700; the root is used only when
        it is private), its files 0600."""
        self.check = check
        self.private = private
        self.readable = readable
        self.codec = codec
        if keep_last < 2:
            raise ValueError("keep_last must be >= 2")
        self.keep_every, self.best = (also_keep.every, also_keep.best) if also_keep else (0, None)
        # Called with the step as soon as a save published it, before pruning (rank 0: the
        # attempt's timeline records the commit, RUN_DIR/best points at the best step).
        self.after_publish: Callable[[int], None] | None = None
        self.url = root
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.keep_last = keep_last
        self.fsync = fsync
        self.local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )
        # What durable.* takes for "not a local path".
        self._remote_fs = None if self.local else self.fs
        self._deleting: list[threading.Event] = []  # set when deleted
        # step -> why its reader refused it: damaged too, moved aside when reached.
        self._refused: dict[int, str] = {}

    # -- paths --------------------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def step_path(self, step: int) -> str:
        return self._p(f"step-{step}")

    def url_of(self, step: int) -> str:
        """The user-facing location (with protocol for non-local stores)."""
        path = self.step_path(step)
        return path if self.local else f"{self.fs.unstrip_protocol(path)}"

    # -- listing ------------------------------------------------------------------------------
    def _entries(self) -> list[str]:
        try:
            return self._names(self.root)
        except FileNotFoundError:
            return []

    def _names(self, folder: str) -> list[str]:
        """The names in ``folder`` (files and folders)."""
        if self.local:
            return os.listdir(folder)
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(folder, detail=False)]

    def _exists(self, path: str) -> bool:
        # A local store asks the OS itself: fsspec's local calls normalise every path first, and
        # a store that snapshots every few steps asks this a dozen times per save.
        return os.path.exists(path) if self.local else self.fs.exists(path)

    def _only_listed(self, path: str, manifest: Mapping[str, Any]) -> None:
        """ValueError when the folder ``path`` holds anything but its manifest and the files it
        lists: a file nothing checked would otherwise be read."""
        extra = sorted(set(self._names(path)) - set(manifest["files"]) - {MANIFEST})
        if extra:
            raise ValueError(
                f"{', '.join(extra[:5])}{'...' if len(extra) > 5 else ''} "
                f"{'is' if len(extra) == 1 else 'are'} in the folder but not in its manifest "
                "(nothing checks such a file: copied in, or the manifest of another save?)"
            )

    def steps(self) -> list[int]:
        """Steps whose folder carries a manifest, ascending (not yet verified)."""
        out = []
        for name in self._entries():
            m = _STEP.match(name)
            if m and self._exists(self._p(name, MANIFEST)):
                out.append(int(m.group(1)))
        return sorted(out)

    def damaged(self) -> list[str]:
        """Folders of steps that failed verification and were set aside (``damaged-step-<N>-*``)."""
        return sorted(self._p(name) for name in self._entries() if name.startswith("damaged-step-"))

    # -- writing ------------------------------------------------------------------------------
    def save(
        self, step: int, files: Mapping[str, Any], meta: Mapping[str, Any] | None = None
    ) -> str | None:
        """Commit ``files`` (name -> bytes, or an object for the store's codec) as step
        ``step``. Returns the step path, or None when that step is already committed with a state
        at least as late (``meta["position"]``): a committed state is never overwritten."""
        if not self._may_write(step, meta or {}):
            return None
        staged = self._stage(step, files, meta or {})
        self._publish(staged, step)
        self._settle(step)
        return self.step_path(step)

    def _may_write(self, step: int, meta: Mapping[str, Any]) -> bool:
        """False when step-N holds a sound state that the new one does not supersede."""
        if not self._exists(self._p(f"step-{step}", MANIFEST)):
            # Nothing there, or a folder without manifest: debris that _publish replaces.
            if self._exists(self.step_path(step)):
                log.warning(
                    "%s has no manifest.json: it was never committed, so never loaded (it holds "
                    "%s); it is replaced by the step %d being saved",
                    self.url_of(step),
                    ", ".join(sorted(self._names(self.step_path(step)))[:5]) or "nothing",
                    step,
                )
            return True
        try:
            # Verified, but the reader could not load it (checkpoint/restore.py).
            if step in self._refused:
                raise ValueError(self._refused.pop(step))
            old = self.verify(step).manifest
        except ValueError as exc:
            # A run that resumed from an older step because this one was damaged reaches it again:
            # keep the damaged folder for inspection, out of the way, and commit the step anew.
            aside = self._p(f"damaged-step-{step}-{uuid.uuid4().hex[:8]}")
            log.warning(
                "checkpoint %s is damaged (%s); moving it to %s and committing step %d anew",
                self.url_of(step),
                exc,
                aside,
                step,
            )
            self.fs.mv(self.step_path(step), aside, recursive=True)
            return True
        if position(meta) > position(old):
            log.info(
                "step %d: the state after the end-of-epoch "
                "work supersedes the one committed before it",
                step,
            )
            return True
        log.info(
            "checkpoint step %d is already committed at %s; not overwriting it",
            step,
            self.step_path(step),
        )
        return False

    def _stage(self, step: int, files: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
        """Write every file, then the manifest, into a fresh ``.tmp-step-<N>-*`` folder."""
        tmp = self._new_staging(step, files)
        self._fill(tmp, step, files, {}, meta)
        return tmp

    def begin(self, step: int, meta: Mapping[str, Any]) -> str | None:
        """A sharded save, first part (rank 0): a fresh staging folder for every rank to write its
        files into, or None when step ``step`` is committed with a state at least as late."""
        if not self._may_write(step, meta):
            return None
        return self._new_staging(step, {})

    def commit(
        self,
        staged: str,
        step: int,
        files: Mapping[str, Any],
        listed: Mapping[str, Mapping[str, Any]],
        meta: Mapping[str, Any],
    ) -> str:
        """A sharded save, last part (rank 0, once every rank has written and hashed its files
        into ``staged``): write ``files``, then the manifest listing them and ``listed`` (the
        ranks' files, name -> size and digest), and publish. Returns the step path."""
        self._fill(staged, step, files, listed, meta)
        self._publish(staged, step)
        self._settle(step)
        return self.step_path(step)

    def _settle(self, step: int) -> None:
        """After a save published ``step``: the caller's hook at once (a kill after the publish
        leaves its record of the commit as short a time behind as can be), then pruning, so the
        hook never names a folder the pruning removed."""
        if self.after_publish is not None:
            self.after_publish(step)
        self.prune()

    def abandon(self, staged: str) -> None:
        """Remove a staging folder whose save failed on some rank."""
        self._rm(staged.rsplit("/", 1)[-1])

    def _new_staging(self, step: int, files: Mapping[str, Any]) -> str:
        tmp = self._p(f".tmp-step-{step}-{uuid.uuid4().hex[:8]}")
        try:
            if self.local and self.private:
                private.make(self.root)
                private.make(tmp)
            elif self.local:
                os.makedirs(tmp)  # with the root; the random name is new
            else:
                self.fs.makedirs(self.root, exist_ok=True)
                self.fs.makedirs(tmp, exist_ok=True)
        except BaseException as exc:
            self._failed(tmp, step, files, exc)
            raise
        return tmp

    def _fill(
        self,
        tmp: str,
        step: int,
        files: Mapping[str, Any],
        listed: Mapping[str, Mapping[str, Any]],
        meta: Mapping[str, Any],
    ) -> None:
        """Write ``files`` and the manifest (``listed`` and ``files``) into ``tmp``."""
        try:
            listing = {name: dict(info) for name, info in listed.items()}
            listing.update(
                {
                    name: durable.write_file(
                        f"{tmp}/{name}",
                        payload,
                        self.fsync,
                        self._remote_fs,
                        self.codec,
                        private=self.private,
                    )
                    for name, payload in files.items()
                }
            )
            manifest = {
                "step": step,
                **dict(meta),
                "files": listing,
                "versions": _versions(self.codec),
                "committed_at": time.time(),
            }
            durable.write_file(
                f"{tmp}/{MANIFEST}",
                json.dumps(manifest, indent=1 if self.readable else None, sort_keys=True),
                self.fsync,
                self._remote_fs,
                private=self.private,
            )
            if self.local and self.fsync:
                durable.fsync_dir(tmp)
        except BaseException as exc:
            self._failed(tmp, step, files, exc)
            raise

    def _failed(self, tmp: str, step: int, files: Mapping[str, Any], exc: BaseException) -> None:
        """A failed write (a full disk, an object store error) gives its space back at once; a
        kill leaves the folder to the next clean_debris. A full disk raises one line naming the
        device, the size and the free space."""
        self._rm(tmp.rsplit("/", 1)[-1])
        if isinstance(exc, Exception):
            diskfull.raise_if_full(
                exc,
                f"checkpoint step {step}",
                self.url_of(step),
                diskfull.payload_bytes(files),
                self.local,
            )

    def _publish(self, staged: str, step: int) -> None:
        """Rename a complete staged folder to ``step-<N>``; whatever held that name is set aside
        first (an older state, or debris without a manifest) and deleted in the background."""
        final = self.step_path(step)
        if self._exists(final):
            aside = self._p(f".superseded-step-{step}-{uuid.uuid4().hex[:8]}")
            self.fs.mv(final, aside, recursive=True)
            self._delete_later([aside])
        if self.local:
            os.rename(staged, final)  # atomic publish
            if self.fsync:
                durable.fsync_dir(self.root)
        else:
            self.fs.mv(staged, final, recursive=True)

    def kept(self, steps: list[int]) -> set[int]:
        """Which of ``steps`` (ascending) stay: the newest ``keep_last`` (a resume takes the newest
        that verifies, and a damaged newest one has a predecessor), the multiples of
        ``keep_every``, and the best one."""
        keep = set(steps[-self.keep_last :])
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        best = self.best_step(steps)
        if best is not None:
            keep.add(best)
        return keep

    def best_step(self, steps: list[int] | None = None) -> int | None:
        """The committed step with the best value of ``best``'s metric in its manifest (the
        earliest of equal ones); None when off or when no manifest holds the metric."""
        if self.best is None:
            return None
        metric, mode = self.best
        scored = []
        for step in self.steps() if steps is None else steps:
            try:
                value = self._read_manifest(self.step_path(step), step).get("metrics", {})
            except ValueError:
                continue
            value = value.get(metric) if isinstance(value, dict) else None
            if isinstance(value, (int, float)) and math.isfinite(value):
                scored.append((value if mode == "min" else -value, step))
        return min(scored)[1] if scored else None

    def prune(self) -> None:
        """Keep the steps :meth:`kept` names.

        An old step is renamed to ``.pruned-step-N-*`` (atomic locally: it stops being a checkpoint
        at once) and deleted on a background thread, off the training loop's path; a deletion cut
        short by the process ending is finished by the next ``clean_debris``.
        """
        doomed = []
        steps = self.steps()
        keep = self.kept(steps)
        for step in (s for s in steps if s not in keep):
            if not self.local:
                self.fs.rm(self.step_path(step), recursive=True)
                continue
            aside = self._p(f".pruned-step-{step}-{uuid.uuid4().hex[:8]}")
            self.fs.mv(self.step_path(step), aside, recursive=True)
            doomed.append(aside)
        self._delete_later(doomed)

    def _delete_later(self, paths: list[str]) -> None:
        if not paths:
            return
        if not self.local:
            for p in paths:
                self.fs.rm(p, recursive=True)
            return
        self._deleting = [done for done in self._deleting if not done.is_set()]
        self._deleting.append(_DELETER.submit(functools.partial(_remove_trees, paths)))

    def wait_for_pruning(self) -> None:
        """Wait for background deletions (call before the process exits)."""
        while self._deleting:
            self._deleting.pop().wait()

    def clean_debris(self) -> list[str]:
        """Finish what a killed writer left; call before writing anew. A staged folder whose files
        all match its manifest is published by the rule of ``save`` (it was complete, only its
        rename was cut short); the other staged folders are removed and returned; set-aside
        folders (superseded, pruned) are deleted."""
        self.wait_for_pruning()
        removed, complete = [], {}
        for name in self._entries():
            m = _STAGED.match(name)
            manifest = self._complete(self._p(name), int(m.group(1))) if m else None
            if manifest is not None:
                complete.setdefault(int(m.group(1)), []).append(
                    (position(manifest), name, manifest)
                )
            elif name.startswith(_SET_ASIDE):
                self._rm(name)
                if name.startswith(".tmp-step-"):
                    removed.append(name)
        for step, candidates in sorted(complete.items()):
            candidates.sort(key=lambda c: c[0])
            (_, best, manifest), rest = candidates[-1], candidates[:-1]
            if self._may_write(step, manifest):
                self._publish(self._p(best), step)
                log.warning(
                    "published %s as step-%d: it was complete, "
                    "but its writer was killed before the rename",
                    best,
                    step,
                )
            else:
                rest.append(candidates[-1])
            for _, name, _ in rest:
                self._rm(name)
                removed.append(name)
        self.wait_for_pruning()
        return sorted(removed)

    def _rm(self, name: str) -> None:
        try:
            self.fs.rm(self._p(name), recursive=True)
        except FileNotFoundError:
            pass

    def _complete(self, path: str, step: int) -> dict[str, Any] | None:
        """The manifest of a folder whose files all match it (size and digest), else None."""
        try:
            manifest = self._read_manifest(path, step)
            self._only_listed(path, manifest)
            for name, info in manifest["files"].items():
                algorithm, digest = durable.recorded_digest(info)
                if (
                    self.fs.size(f"{path}/{name}") != info["size"]
                    or durable.hash_file(f"{path}/{name}", algorithm, self._remote_fs) != digest
                ):
                    return None
        except (ValueError, OSError):
            return None
        return manifest

    # -- reading ------------------------------------------------------------------------------
    def _read_manifest(self, path: str, step: int | None = None) -> dict[str, Any]:
        """The manifest, its schema checked (manifest.check): ValueError naming what is wrong."""
        target = f"{path}/{MANIFEST}"
        try:
            if self.local:  # never through a link out of the store, never a FIFO's wait
                data = json.loads(confined.read_bytes(target, self.root, schema.MAX_BYTES))
            else:
                with self.fs.open(target, "rb") as f:
                    data = json.loads(f.read(schema.MAX_BYTES + 1))
        except confined.Refused as exc:
            raise ValueError(f"unreadable manifest: {MANIFEST} {exc.why}") from None
        except (OSError, ValueError, RecursionError) as exc:
            # Missing, a directory, unreadable, not JSON, not UTF-8.
            raise ValueError(f"unreadable manifest ({exc.__class__.__name__})") from None
        return schema.check(data, step)

    def verify(self, step: int) -> Checkpoint:
        """Read and check one step; raises ValueError naming what is wrong."""
        path = self.step_path(step)
        manifest = self._read_manifest(path, step)
        self._only_listed(path, manifest)
        objects = {}
        # A sharded checkpoint's shards are read by every rank later: here only their digests.
        shards = manifest.get("format") == DCP
        for name, info in manifest["files"].items():
            file = f"{path}/{name}"
            try:
                size = self.fs.size(file)
                if size != info["size"]:
                    raise ValueError(f"{name} has {size} bytes, the manifest says {info['size']}")
                if shards and not name.endswith(".pt"):
                    _check_digest(name, file, info, self._remote_fs)
                    continue
                objects[name] = self._load(name, file, info)
            except FileNotFoundError:
                raise ValueError(f"{name} is missing") from None
            except OSError as exc:  # a directory where a file should be, a permission, an I/O error
                raise ValueError(f"{name} cannot be read ({type(exc).__name__}: {exc})") from None
        ckpt = Checkpoint(step=step, path=self.url_of(step), manifest=manifest, objects=objects)
        if self.check is not None:
            self.check(ckpt)
        return ckpt

    def _load(self, name: str, file: str, info: Mapping[str, Any]) -> Any:
        if self.codec is None:
            raise TypeError("reading a checkpoint's files needs a codec (storage.tensors.TORCH)")
        return durable.load_checked(name, file, info, self.codec, self._remote_fs)

    def newest_manifest(self) -> dict[str, Any] | None:
        """The manifest of the newest committed step, unverified (one small read; None when
        none)."""
        steps = self.steps()
        return self.manifest(steps[-1]) if steps else None

    def manifest(self, step: int) -> dict[str, Any] | None:
        """Step ``step``'s manifest, unverified (one small read; None when missing or
        unreadable)."""
        try:
            return self._read_manifest(self.step_path(step))
        except ValueError:
            return None

    def candidates(
        self, skip: set[int] | frozenset[int] = frozenset(), damaged: dict[int, str] | None = None
    ) -> Iterator[Checkpoint]:
        """Verified checkpoints, newest first, but for the steps in ``skip``; damaged ones are
        skipped with a warning naming them (and put in ``damaged``, step -> why, when given)."""
        for step in reversed(self.steps()):
            if step in skip:
                continue
            try:
                ckpt = self.verify(step)
            except ValueError as exc:
                log.warning(
                    "skipping damaged checkpoint %s: %s; %s",
                    self.url_of(step),
                    exc,
                    self.fallback(step, skip),
                )
                if damaged is not None:
                    damaged[step] = str(exc)
                continue
            yield ckpt

    def refuse(self, step: int, why: str) -> None:
        """The reader could not load committed ``step`` (``why``), though it verified: damaged
        too, so a save that reaches the step again moves it aside and commits it anew."""
        self._refused[step] = why

    def fallback(self, step: int, skip: set[int] | frozenset[int] = frozenset()) -> str:
        """What a reader that skips ``step`` does next, for its warning: an older committed step
        (not in ``skip``) to try, or none."""
        if any(s < step and s not in skip for s in self.steps()):
            return "falling back to the previous one"
        return "no older checkpoint to fall back to"

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose manifest verifies; damaged ones are skipped with a
        warning."""
        return next(self.candidates(), None)


def _remove_trees(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _check_digest(
    name: str, path: str, info: Mapping[str, Any], fs: fsspec.AbstractFileSystem | None
) -> None:
    algorithm, expected = durable.recorded_digest(info)
    if durable.hash_file(path, algorithm, fs) != expected:
        raise ValueError(
            f"{name} does not match its {algorithm} digest (bit rot or a partial write)"
        )
