"""What a checkpoint manifest must hold before any file it names is read.

A manifest is JSON that anything may have written: a torn copy, a hand edit, a folder copied
from another run. Valid JSON is not enough: ``[]``, ``{"files": {}}``, an entry without
``size``, ``"files": "model.pt"`` or a file name that climbs out of the folder each make the
checkpoint *damaged*. :func:`check` names what is wrong (``ValueError``), and the store skips
that checkpoint for the previous one, as it does for a file whose digest does not match.
``checkpoint_id`` (32 hex digits, random per save) is what each file of the checkpoint carries
inside it too (``checkpoint/identity.py``); manifests of older versions have none.
No torch here: ``status`` reads manifests on the login node.
"""

from __future__ import annotations

import re
from typing import Any

from clusterflow.storage.durable import HASHES

# A manifest lists a checkpoint's files: kilobytes, megabytes for a sharded one of thousands of
# ranks. A larger file is no manifest, and is not read.
MAX_BYTES = 64 * 2**20
_DIGEST = re.compile(r"^[0-9a-f]{64}$")  # sha256 and blake3 (its default 32-byte output) alike
_ID = re.compile(r"^[0-9a-f]{32}$")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(name: object, info: object) -> None:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"the manifest names a file that is not in its folder: {name!r}")
    if not isinstance(info, dict):
        raise ValueError(
            f"the manifest entry of {name} is {type(info).__name__}, not {{size, digest}}"
        )
    size = info.get("size")
    if not _is_int(size) or size < 0:
        raise ValueError(f"the manifest entry of {name} has no valid size ({size!r})")
    algorithm = next((a for a in HASHES if a in info), None)
    digest = info.get(algorithm) if algorithm else None
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ValueError(
            f"the manifest entry of {name} has no valid digest ({', '.join(HASHES)}): {digest!r}"
        )


def check(manifest: object, step: int | None = None) -> dict[str, Any]:
    """``manifest`` itself when its schema holds, else ValueError naming the first lie.
    ``step``: the step of the folder it was read from (``step-<N>``), when known."""
    if not isinstance(manifest, dict):
        raise ValueError(f"the manifest is a JSON {type(manifest).__name__}, not an object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError(
            f"the manifest's 'files' is {type(files).__name__}, "
            f"not a mapping of name -> {{size, digest}}"
        )
    if not files:
        raise ValueError("the manifest lists no files")
    for name, info in files.items():
        _check_entry(name, info)
    if step is not None and "step" in manifest and manifest["step"] != step:
        raise ValueError(
            f"the manifest says step {manifest['step']!r}, but its "
            f"folder is step-{step} (a copied or renamed folder?)"
        )
    ident = manifest.get("checkpoint_id")
    if ident is not None and not (isinstance(ident, str) and _ID.match(ident)):
        raise ValueError(f"the manifest's checkpoint_id {ident!r} is not 32 hex digits")
    pos = manifest.get("position")
    if pos is not None and not (isinstance(pos, list) and all(_is_int(p) for p in pos)):
        raise ValueError(f"the manifest's position {pos!r} is not a list of integers")
    return manifest
