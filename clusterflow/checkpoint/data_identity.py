"""Which data a run trains on, as its checkpoints and its sample ledger record it, and what a
resume on other data does.

Everything a run keeps about its data is by sample index: the epoch's order and the position in
it (``distributed/sampler.py``), the ledger's ranges, the mined pseudo-labels. Resumed on data
whose indices name other samples (a shard folder packed again, an image folder that gained or
lost images, a user's dataset of another length), the run would carry on in mid-epoch training
some samples twice and others never, and give old labels to other samples. So each checkpoint
holds the identity of the data it trained on, and a resume compares it with the data now.

A dataset is known by its length and, when it offers one, a digest: a method
``data_digest() -> str`` on the train dataset, a hash of what names each of its samples in index
order (``ImageShardsTask``: its shard index; ``ImageFolderTask``: its file list). A dataset
without one is known by its length only. :func:`identify` and :func:`judge_resume` are all a
training loop needs, whatever builds its dataset.
"""

from __future__ import annotations

import logging
from collections.abc import Sized
from dataclasses import dataclass

from clusterflow.errors import UserError

log = logging.getLogger("clusterflow.checkpointer")

SHOWN = 12  # hex digits of a digest shown in messages


@dataclass(frozen=True)
class DataIdentity:
    """How many samples, and the dataset's own digest of them (None: it offers none)."""

    samples: int
    digest: str | None = None

    def record(self) -> dict[str, object]:
        """As a checkpoint's train state and the sample ledger hold it."""
        return {"samples": self.samples, "digest": self.digest}

    @classmethod
    def from_record(cls, rec: object) -> DataIdentity | None:
        """The identity a checkpoint recorded; None for a checkpoint that recorded none."""
        if not isinstance(rec, dict) or not isinstance(rec.get("samples"), int):
            return None
        digest = rec.get("digest")
        return cls(int(rec["samples"]), digest if isinstance(digest, str) else None)

    def same_as(self, other: DataIdentity) -> bool:
        """Whether both name the same samples by the same indices, as far as both can tell: the
        same length and, where both have a digest, the same digest."""
        if self.samples != other.samples:
            return False
        return self.digest is None or other.digest is None or self.digest == other.digest

    def __str__(self) -> str:
        shown = f" (digest {self.digest[:SHOWN]})" if self.digest else ""
        return f"{self.samples} samples{shown}"


def identify(dataset: Sized) -> DataIdentity:
    """The identity of ``dataset``: its length, and its ``data_digest()`` when it has one."""
    offer = getattr(dataset, "data_digest", None)
    digest = offer() if callable(offer) else None
    if digest is not None and not isinstance(digest, str):
        raise TypeError(
            f"{type(dataset).__name__}.data_digest() returned a {type(digest).__name__}, not a str"
        )
    return DataIdentity(len(dataset), digest)


@dataclass(frozen=True)
class Position:
    """Where the checkpoint being resumed stands in its epoch."""

    epoch: int  # epochs finished
    sample_in_epoch: int  # samples of the current epoch's order trained
    step_in_epoch: int

    @property
    def at_boundary(self) -> bool:
        """At the start of an epoch: nothing of it trained, and the previous epoch's work (eval,
        mining) done."""
        return self.sample_in_epoch == 0 and self.step_in_epoch == 0


def judge_resume(
    saved: DataIdentity | None,
    now: DataIdentity,
    where: str,
    position: Position,
    allow_change: bool,
) -> bool:
    """Whether a resume from the checkpoint ``where`` (which trained on ``saved``, None when it
    says nothing) onto ``now`` goes on as it is (False), or goes on with new data whose
    pseudo-labels the caller must drop (True: at an epoch boundary, with ``allow_change``).
    Otherwise a UserError in one line that names both."""
    if saved is None or saved.same_as(now):
        return False
    changed = (
        f"the data changed since {where}: it trained on {saved}, the task now gives {now}, "
        "and the epoch's order, the position in it and the pseudo-labels are by sample index"
    )
    if position.at_boundary and allow_change:
        log.warning(
            "%s; data.allow_change=true: resuming at epoch %d on the new data",
            changed,
            position.epoch + 1,
        )
        return True
    back = (
        "give the run the data it trained on (task.params as they were, the folder as it was "
        "packed or written), or start a new run.dir"
    )
    if position.at_boundary:
        raise UserError(
            f"{changed}; {back}; this checkpoint is at an epoch boundary, so "
            "data.allow_change=true would resume on the new data from epoch "
            f"{position.epoch + 1} on, without the pseudo-labels mined on the old data"
        )
    raise UserError(
        f"{changed}; {back}. The checkpoint is in mid-epoch ({position.sample_in_epoch} "
        f"samples of epoch {position.epoch + 1} trained), where other data cannot be taken, "
        "not even with data.allow_change=true (only at an epoch boundary)"
    )
