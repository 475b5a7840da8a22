import json
import os
import re
import threading

import pytest
import torch

from clusterflow.storage.store import CheckpointStore
from clusterflow.storage.tensors import TORCH, serialize


def files(v):
    return {
        "model.pt": serialize({"w": torch.full((4,), float(v))}),
        "train_state.pt": serialize({"step": v}),
    }


def test_commit_latest_and_retention(store):
    assert store.latest() is None
    for s in (10, 20, 30):
        assert store.save(s, files(s), {"epoch": 0})
    assert store.steps() == [20, 30]  # keep_last=2
    store.wait_for_pruning()  # old steps are deleted off the caller's path, locally
    assert sorted(
        e.rstrip("/").rsplit("/", 1)[-1] for e in store.fs.ls(store.root, detail=False)
    ) == ["step-20", "step-30"]
    ck = store.latest()
    assert ck.step == 30 and ck.manifest["epoch"] == 0
    assert torch.equal(ck.load("model.pt")["w"], torch.full((4,), 30.0))
    assert set(ck.manifest["files"]) == {"model.pt", "train_state.pt"}
    assert (
        len(ck.manifest["files"]["model.pt"]["blake3"]) == 64
    )  # each file's record names its algorithm


def test_committed_step_is_never_overwritten(store):
    store.save(5, files(5))
    assert store.save(5, files(6)) is None
    assert torch.equal(store.latest().load("model.pt")["w"], torch.full((4,), 5.0))


def test_plain_model_pt_loads_without_clusterflow(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(1, files(1))
    sd = torch.load(os.path.join(tmp_path, "step-1", "model.pt"), weights_only=True)
    assert torch.equal(sd["w"], torch.full((4,), 1.0))


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "manifest", "missing"])
def test_damaged_newest_is_skipped(tmp_path, caplog, damage):
    store = CheckpointStore(str(tmp_path), keep_last=3, codec=TORCH)
    store.save(1, files(1))
    store.save(2, files(2))
    newest = tmp_path / "step-2"
    target = newest / "model.pt"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        b = bytearray(data)
        b[len(b) // 2] ^= 0x01
        target.write_bytes(bytes(b))
    elif damage == "manifest":
        (newest / "manifest.json").write_text("{not json")
    else:
        target.unlink()
    with caplog.at_level("WARNING"):
        ck = store.latest()
    assert ck.step == 1
    assert "step-2" in caplog.text and "skipping damaged checkpoint" in caplog.text


def test_folder_without_manifest_is_not_a_checkpoint_and_debris_is_cleaned(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(1, files(1))
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "model.pt").write_bytes(b"partial")
    (tmp_path / ".tmp-step-10-abcd").mkdir()
    assert store.steps() == [1]
    assert store.clean_debris() == [".tmp-step-10-abcd"]
    assert store.save(9, files(9))  # a manifest-less folder is debris, replaced by the real commit
    assert store.latest().step == 9
    assert json.loads((tmp_path / "step-9" / "manifest.json").read_text())["step"] == 9


def test_damaged_step_is_moved_aside_when_the_run_reaches_it_again(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path), keep_last=3, codec=TORCH)
    store.save(1, files(1))
    store.save(2, files(2))
    (tmp_path / "step-2" / "model.pt").write_bytes(b"torn")
    assert store.latest().step == 1  # the run resumes from step 1 ...
    with caplog.at_level("WARNING"):
        assert store.save(2, files(22))  # ... and commits step 2 again when it gets there
    assert "moving it to" in caplog.text
    assert torch.equal(store.latest().load("model.pt")["w"], torch.full((4,), 22.0))
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("damaged-step-2-")]
    assert len(aside) == 1 and (tmp_path / aside[0] / "model.pt").read_bytes() == b"torn"
    assert store.steps() == [1, 2]


OLD_STORE = os.path.join(
    os.path.dirname(__file__), "data", "sha256-store"
)  # written by the code of 19ebe49


def test_checkpoints_of_the_sha256_format_still_verify_and_their_damage_is_found(tmp_path):
    """tests/data/sha256-store holds checkpoints of the sha256-digest format (the one before BLAKE3,
    written by the store of 19ebe49): steps 4 and 6 committed, and a complete step 8 whose rename a
    kill cut short."""
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(OLD_STORE, root)
    store = CheckpointStore(str(root), keep_last=2, codec=TORCH)
    assert (
        "sha256" in json.loads((root / "step-6" / "manifest.json").read_text())["files"]["model.pt"]
    )
    assert store.latest().step == 6 and torch.equal(
        store.latest().load("model.pt")["w"], torch.full((4,), 6.0)
    )
    assert (
        store.clean_debris() == []
    )  # the complete staged step 8 verifies by its sha256 and is published
    assert store.latest().step == 8
    data = bytearray((root / "step-8" / "train_state.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (root / "step-8" / "train_state.pt").write_bytes(bytes(data))
    assert store.latest().step == 6  # a flipped bit is found by the old digest too
    store.save(10, files(10))  # a new save next to old ones gets the new digest
    assert (
        "blake3"
        in json.loads((root / "step-10" / "manifest.json").read_text())["files"]["model.pt"]
    )
    assert store.latest().step == 10


def test_a_record_naming_an_unknown_algorithm_is_damaged_not_trusted(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=2, codec=TORCH)
    store.save(1, files(1))
    store.save(2, files(2))
    manifest = json.loads((tmp_path / "step-2" / "manifest.json").read_text())
    manifest["files"]["model.pt"] = {"size": manifest["files"]["model.pt"]["size"], "md5": "0" * 32}
    (tmp_path / "step-2" / "manifest.json").write_text(json.dumps(manifest))
    assert store.latest().step == 1


@pytest.mark.parametrize("extra", ["model.pt.orig", "__1_0.distcp", "sub/model.pt"])
def test_a_file_its_manifest_does_not_list_makes_the_checkpoint_damaged(store, extra):
    """A file the manifest leaves out would be read unchecked (a DCP shard is found by its name,
    not by the manifest): the folder must hold exactly what its manifest lists."""
    store.save(1, files(1))
    store.save(2, files(2))
    store.fs.makedirs(store._p("step-2", os.path.dirname(extra)), exist_ok=True)
    store.fs.pipe(store._p("step-2", extra), serialize({"w": torch.zeros(4)}))
    listed = extra.split("/")[0]
    with pytest.raises(ValueError, match=rf"^{re.escape(listed)} is in the folder but not in"):
        store.verify(2)
    assert store.latest().step == 1


def test_a_folder_without_manifest_is_replaced_with_a_warning_naming_it(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path), keep_last=3, codec=TORCH)
    store.save(1, files(1))
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "model.pt").write_bytes(b"partial")
    with caplog.at_level("WARNING"):
        assert store.save(2, files(2))
    said = [r.getMessage() for r in caplog.records if "step-2" in r.getMessage()]
    assert len(said) == 1, said
    assert f"{tmp_path}/step-2 has no manifest.json" in said[0] and "model.pt" in said[0]
    assert "never committed, so never loaded" in said[0] and "replaced" in said[0]
    assert torch.equal(store.latest().load("model.pt")["w"], torch.full((4,), 2.0))


def test_pruning_many_saves_uses_one_deleting_thread_and_waits_for_it(tmp_path):
    """Set-aside steps of local stores are deleted by one long-lived thread: a store saving every
    few steps starts no thread per save; wait_for_pruning still waits for its own deletions."""
    stores = [CheckpointStore(str(tmp_path / f"s{i}"), keep_last=2, fsync=False) for i in (0, 1)]
    before = {t.ident for t in threading.enumerate()}
    for step in range(1, 30):
        for s in stores:
            s.save(step, files(step))
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert [t.name for t in started] in ([], ["clusterflow-deleter"])
    for s in stores:
        s.wait_for_pruning()
        assert sorted(os.listdir(s.root)) == ["step-28", "step-29"]


def test_a_forked_child_prunes_on_a_thread_of_its_own(tmp_path):
    parent = CheckpointStore(str(tmp_path / "parent"), keep_last=2, fsync=False)
    for step in (1, 2, 3):
        parent.save(step, files(step))
    parent.wait_for_pruning()  # the deleting thread runs in the parent now
    pid = os.fork()
    if pid == 0:  # the child inherits the deleter, not its thread
        code = 1
        try:
            child = CheckpointStore(str(tmp_path / "child"), keep_last=2, fsync=False)
            for step in (1, 2, 3):
                child.save(step, files(step))
            child.wait_for_pruning()
            code = 0 if sorted(os.listdir(child.root)) == ["step-2", "step-3"] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
