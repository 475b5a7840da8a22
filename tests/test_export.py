"""`python -m clusterflow.export` and `task.init_from` on a one-file (DDP) run: where OUT may be
(never inside the run, never over a file without --force, never a half file), which format it
gets, which steps it offers, and which checkpoints and files init_from accepts (verified like a
resume). Sharded checkpoints: tests/test_sharded.py."""

import hashlib
import os
import shutil

import pytest
import torch
from conftest import tmpfs
from safetensors.torch import load_file

from clusterflow.checkpoint.export import main
from clusterflow.tasks.pseudo_id import PseudoIDTask
from clusterflow.train.builders import init_weights


@pytest.fixture
def run(tiny_one_process_model):
    """The session's finished one-process tiny run (steps 12, 16 and 18): read it, never write."""
    return os.path.dirname(tiny_one_process_model)


@pytest.fixture
def own_run(run, tmp_path):
    """A copy of that run, to damage."""
    d = str(tmp_path / "own")
    shutil.copytree(run, d)
    return d


def newest_weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def refused(capsys, *args):
    """The one `error:` line of a refused export (exit 2)."""
    with pytest.raises(SystemExit) as stop:
        main(list(args))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def tree_digest(folder):
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def test_an_out_that_cannot_be_written_is_one_line_and_nothing_is_left(run, tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("a file")
    for out, says in [
        (tmp_path / "folder", f"OUT {str(tmp_path / 'folder')!r} is a folder"),
        (f"{tmp_path}/new/", f"OUT '{tmp_path}/new/' names no file"),
        (
            tmp_path / "file" / "m.pt",
            f"OUT's folder = {str(tmp_path / 'file')!r} is a file, not a directory",
        ),
    ]:
        line = refused(capsys, run, str(out))
        assert says in line, line
    assert os.listdir(tmp_path / "folder") == [] and (tmp_path / "file").read_text() == "a file"
    assert not os.path.exists(tmp_path / "new")
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        line = refused(capsys, run, f"{ro}/m.pt")
        assert f"OUT's folder = {ro!r}" in line and "is on a read-only filesystem" in line, line


def test_a_full_disk_mid_write_leaves_no_half_file_at_out(run, tmp_path, capsys):
    with tmpfs(tmp_path / "small", "size=64k") as small:
        size = os.path.getsize(os.path.join(run, "model.pt"))
        with open(f"{small}/filler", "wb") as f:  # leaves less than the model needs
            f.write(b"x" * (64 * 1024 - size // 2))
        line = refused(capsys, run, f"{small}/m.pt")
        assert "no space left on tmpfs" in line and f"{small}/m.pt" in line, line
        assert "free space there or pick another OUT" in line, line
        assert os.listdir(small) == ["filler"]  # no OUT, no hidden temporary file


def test_the_format_comes_from_the_suffix_and_a_contradiction_is_refused(run, tmp_path, capsys):
    st = str(tmp_path / "m.safetensors")
    assert main([run, st]) == 0
    assert same(load_file(st), newest_weights(run))
    line = refused(capsys, run, str(tmp_path / "x.safetensors"), "--format", "pt")
    assert "--format pt contradicts OUT's suffix .safetensors" in line, line
    line = refused(capsys, run, str(tmp_path / "x.pt"), "--format", "safetensors")
    assert "--format safetensors contradicts OUT's suffix .pt" in line, line
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    bare = str(tmp_path / "weights")  # no suffix: --format decides, pt by default
    assert main([run, bare]) == 0
    assert same(torch.load(bare, weights_only=True), newest_weights(run))


def test_out_inside_the_run_dir_is_refused_however_it_is_spelt(run, tmp_path, capsys):
    before = tree_digest(run)
    os.symlink(run, tmp_path / "link")
    (tmp_path / "sub").mkdir()
    for out in [
        os.path.join(run, "model.pt"),
        os.path.join(run, "checkpoints", "step-18", "model.pt"),
        os.path.join(run, "exported.pt"),
        str(tmp_path / "link" / "checkpoints" / "x.pt"),
        str(tmp_path / "sub" / ".." / "link" / "model.pt"),
    ]:
        line = refused(capsys, run, out, "--force")
        assert f"OUT {out!r} is inside the run dir {run}" in line, line
    assert tree_digest(run) == before


def test_an_existing_out_is_kept_unless_force(run, tmp_path, capsys):
    out = tmp_path / "m.pt"
    out.write_text("keep me")
    line = refused(capsys, run, str(out))
    assert f"OUT {str(out)!r} exists" in line and "--force" in line, line
    assert out.read_text() == "keep me"
    assert main([run, str(out), "--force"]) == 0
    assert same(torch.load(out, weights_only=True), newest_weights(run))
    assert main([run, str(out), "--format", "pt", "--force"]) == 0
    final = torch.load(os.path.join(run, "model.pt"), weights_only=True)
    assert same(torch.load(out, weights_only=True), final)  # the run's own final weights


def test_a_refused_step_is_not_offered_among_the_choices(own_run, tmp_path, capsys):
    flip(os.path.join(own_run, "checkpoints", "step-16", "model.pt"))
    line = refused(capsys, own_run, str(tmp_path / "m.pt"), "--step", "16")
    assert "--step 16: checkpoint" in line and "is damaged (model.pt does not match" in line
    assert line.endswith("pick one of the loadable steps: 18, 12"), line
    line = refused(capsys, own_run, str(tmp_path / "m.pt"), "--step", "7")
    assert line.endswith("has no committed step 7; loadable steps: 18, 12"), line
    assert not os.path.exists(tmp_path / "m.pt")


def plain_model():
    return PseudoIDTask(
        seed=7, identities=24, samples_per_identity=8, input_dim=32, hidden=64, embed_dim=16
    ).build_model()


def test_init_from_a_safetensors_export(run, tmp_path):
    st = str(tmp_path / "m.safetensors")
    assert main([run, st, "--format", "safetensors"]) == 0
    model = plain_model()
    init_weights(model, st)
    assert same(model.state_dict(), newest_weights(run))


def test_init_from_a_step_folder_is_verified_like_a_resume(own_run):
    """A checkpoints/step-N folder is taken when it verifies (its manifest, every file's size and
    digest, the checkpoint id each carries), refused in one line naming what is wrong else."""
    from clusterflow.errors import UserError

    step18 = os.path.join(own_run, "checkpoints", "step-18")
    model = plain_model()
    init_weights(model, step18)
    assert same(model.state_dict(), newest_weights(own_run))
    flip(os.path.join(step18, "model.pt"))
    with pytest.raises(UserError) as refusal:
        init_weights(plain_model(), step18)
    assert f"task.init_from={step18!r}: checkpoint {step18} is damaged (model.pt does not " in str(
        refusal.value
    )
