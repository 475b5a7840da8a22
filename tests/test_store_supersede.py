"""Two states at one step: the later one supersedes the committed one, and every crash point of
that replacement (and of a plain commit) is finished by clean_debris without losing a state."""

import os

import torch

from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH, serialize


def files(v):
    return {
        "model.pt": serialize({"w": torch.full((4,), float(v))}),
        "train_state.pt": serialize({"step": v}),
    }


def value(store):
    return float(store.latest().load("model.pt")["w"][0])


def names(root):
    return sorted(os.listdir(root))


BEFORE, AFTER = (
    {"position": [0, 6]},
    {"position": [1, 0]},
)  # (epoch, step in epoch): before / after the end-of-epoch work


def test_a_later_state_at_the_same_step_supersedes_the_committed_one(store):
    assert store.save(6, files(1), BEFORE)
    assert store.save(6, files(2), AFTER)  # the end-of-epoch state replaces the stop checkpoint
    assert value(store) == 2 and store.latest().manifest["position"] == [1, 0]
    assert store.save(6, files(3), AFTER) is None  # the same state again: never overwritten
    assert store.save(6, files(4), BEFORE) is None  # an earlier one: never
    store.wait_for_pruning()
    assert value(store) == 2 and [
        e.rsplit("/", 1)[-1] for e in store.fs.ls(store.root, detail=False)
    ] == ["step-6"]


def test_crash_after_staging_the_later_state(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(6, files(1), BEFORE)
    store._stage(6, files(2), AFTER)  # killed before the old step-6 was moved aside
    assert value(store) == 1  # until clean-up, the committed state is the old one
    assert store.clean_debris() == []
    assert value(store) == 2 and names(tmp_path) == ["step-6"]


def test_crash_between_the_two_renames(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(4, files(0), {"position": [0, 4]})
    store.save(6, files(1), BEFORE)
    store._stage(6, files(2), AFTER)
    os.rename(
        tmp_path / "step-6", tmp_path / ".superseded-step-6-0123abcd"
    )  # killed here: no step-6 at all
    assert store.latest().step == 4
    assert store.clean_debris() == []
    assert value(store) == 2 and names(tmp_path) == ["step-4", "step-6"]


def test_crash_while_staging_keeps_the_old_state(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(6, files(1), BEFORE)
    staged = store._stage(6, files(2), AFTER)
    os.remove(os.path.join(staged, "manifest.json"))  # the manifest comes last: killed before it
    assert store.clean_debris() == [os.path.basename(staged)]
    assert value(store) == 1 and names(tmp_path) == ["step-6"]


def test_a_complete_commit_killed_before_its_rename_is_published(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(4, files(4), {"position": [0, 4]})
    staged = store._stage(8, files(8), {"position": [1, 2]})
    with open(os.path.join(staged, "model.pt"), "r+b") as f:  # ... but one torn file: not complete
        f.truncate(10)
    torn = os.path.basename(staged)
    store._stage(8, files(88), {"position": [1, 2]})
    assert store.clean_debris() == [torn]
    assert store.latest().step == 8 and value(store) == 88


def test_pruned_and_superseded_folders_are_deleted_never_published(tmp_path):
    """Complete folders set aside by prune and by a supersede, left by a process killed while it
    deleted them in the background."""
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    for s in (4, 6):
        store.save(s, files(s), {"position": [0, s]})
    os.rename(store._stage(2, files(2), {"position": [0, 2]}), tmp_path / ".pruned-step-2-0123abcd")
    os.rename(store._stage(6, files(5), BEFORE), tmp_path / ".superseded-step-6-0123abcd")
    assert store.clean_debris() == []
    assert names(tmp_path) == ["step-4", "step-6"] and value(store) == 6


def test_a_damaged_step_is_kept_aside_even_when_a_later_state_replaces_it(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(6, files(1), BEFORE)
    (tmp_path / "step-6" / "model.pt").write_bytes(b"torn")
    assert store.save(6, files(2), AFTER)
    store.wait_for_pruning()
    assert value(store) == 2 and [n[:14] for n in names(tmp_path)] == ["damaged-step-6", "step-6"]
