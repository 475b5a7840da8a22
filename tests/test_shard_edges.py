"""The edges of tar shards: a rank keeps a bounded set of shards open (and a process out of file
descriptors says so, wherever it runs out); a shard swapped for another of the same layout, an
index of another packing, or a shard that is a folder is one line naming it; the writer refuses a
bad SRC or OUT in one line, before writing anything; a sample_ledger.json that cannot be written
does not stop training."""

import os
import resource
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, run_cli, tmpfs
from PIL import Image

from clusterflow.errors import UserError
from clusterflow.tasks import shard_format
from clusterflow.tasks.images import ImageShardsTask
from clusterflow.tasks.shards import write_shards

RUN_CONFIG = (
    "run: {{seed: 3}}\n"
    "train: {{epochs: 1, batch_size: 12, lr: 0.003, log_every_steps: 1, progress_bar: false}}\n"
    "checkpoint: {{every_steps: 100, async: false}}\n"
    "mining: {{enabled: false}}\n"
    "task:\n"
    "  target: {target}\n"
    "  params: {{{params}}}\n"
)


def _images(root, per_class, ext="png", classes=("a", "b", "c")):
    """``per_class`` random 8x8 images in each class folder; BMP files all have one size, so the
    shards of a packing all have one layout (every member at the same offsets)."""
    rng = np.random.default_rng(0)
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                os.path.join(root, c, f"{i}.{ext}")
            )
    return str(root)


def _run(tmp_path, params, target="clusterflow.tasks.images:ImageShardsTask", nofile=None, **kw):
    """One rank of ``python -m clusterflow.run`` (a new process), with at most ``nofile`` open
    files (``ulimit -n``). Returns (exit status, its output)."""
    config = tmp_path / "config.yaml"
    config.write_text(RUN_CONFIG.format(target=target, params=params))
    run_dir = kw.pop("run_dir", str(tmp_path / "run"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update(PYTHONPATH=os.path.join(REPO, "tests"), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)

    def limit():
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    out = subprocess.run(
        [sys.executable, "-m", "clusterflow.run", str(config), f"run.dir={run_dir}"],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit,
    )
    return out.returncode, out.stdout + out.stderr


def _error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error: ")]


# -- open files ----------------------------------------------------------------------------------


def test_a_reader_keeps_a_bounded_set_of_shards_open(tmp_path):
    """18 images in 18 shards, read in random batches by a reader allowed 3 open shards: every
    sample reads as it should, and the process never holds more than 3 shard descriptors."""
    out = str(tmp_path / "shards")
    write_shards(_images(tmp_path / "images", 6), out, 1)
    index = shard_format.ShardIndex.load(out)
    whole = shard_format.ShardReader(index)
    expected = whole.read(list(range(18)))
    whole.close()
    reader = shard_format.ShardReader(index, max_open=3)
    rng = np.random.default_rng(0)
    most = 0
    for _ in range(10):
        batch = rng.choice(18, size=7, replace=False).tolist()
        assert reader.read(batch) == [expected[i] for i in batch]
        most = max(most, len(_open_shards()))
    assert most == 3
    reader.close()
    assert _open_shards() == []


def _open_shards():
    """The shard files this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.endswith(".tar"):
            found.append(target)
    return found


def test_more_shards_than_the_open_file_limit_train(tmp_path):
    """120 images in 120 shards of one, one rank under ``ulimit -n 96``: one descriptor a shard
    would run out (Too many open files); a bounded set trains the epoch."""
    shards = str(tmp_path / "shards")
    write_shards(_images(tmp_path / "images", 40), shards, 1)
    params = f"root: {shards}, image_size: 8, width: 4, embed_dim: 4, mix_shards: 2"
    code, text = _run(tmp_path, params, nofile=96)
    assert code == 0, text[-3000:]
    assert "Too many open files" not in text


def test_running_out_of_file_descriptors_is_named_wherever_it_happens(tmp_path):
    """A task that leaks descriptors until two are left: whatever clusterflow opens next fails
    with EMFILE, and the job says so in one line with the limit and the fix (not a traceback
    blaming the file it happened to open)."""
    code, text = _run(
        tmp_path,
        "identities: 24, samples_per_identity: 2, input_dim: 8, hidden: 16, embed_dim: 4",
        target="testtasks:LeakFiles",
        nofile=256,
    )
    assert code == 1, text[-3000:]
    lines = _error_lines(text)
    # One line; no traceback through clusterflow's code (TensorBoard's own writer thread may
    # print its own when its file fails).
    assert len(lines) == 1 and os.path.join(REPO, "clusterflow") not in text, text[-3000:]
    assert lines[0].startswith("error: too many open files (EMFILE)"), lines
    assert "its limit (ulimit -n) is 256" in lines[0], lines


# -- shards that are not what their index says ---------------------------------------------------


@pytest.fixture
def same_layout(tmp_path):
    """30 BMP images (all one size) in 3 shards of 10: every shard the same size, every member at
    the same offsets; and a second packing of them with another seed."""
    src = _images(tmp_path / "images", 10, ext="bmp")
    out, other = str(tmp_path / "shards"), str(tmp_path / "other")
    write_shards(src, out, 10)
    write_shards(src, other, 10, seed=5)
    sizes = {os.path.getsize(os.path.join(out, f"shard-00000{k}.tar")) for k in range(3)}
    assert len(sizes) == 1
    return out, other


def test_a_shard_swapped_for_another_of_the_same_layout_is_refused(same_layout):
    out, _ = same_layout
    shutil.copyfile(os.path.join(out, "shard-000002.tar"), os.path.join(out, "shard-000001.tar"))
    ds = ImageShardsTask(root=out).train_dataset()
    ds[5]  # shard 0 is as its index says
    with pytest.raises(UserError) as exc:
        ds[12]
    assert "shard-000001.tar" in str(exc.value) and "000000022" in str(exc.value)
    assert "not the one its index describes" in str(exc.value) and "\n" not in str(exc.value)


def test_a_shard_of_another_packing_is_refused(same_layout):
    """The same sample numbers in the same places, other images: the packing each member carries
    tells them apart."""
    out, other = same_layout
    shutil.copyfile(os.path.join(other, "shard-000001.tar"), os.path.join(out, "shard-000001.tar"))
    with pytest.raises(UserError) as exc:
        ImageShardsTask(root=out).train_dataset()[12]
    assert "shard-000001.tar" in str(exc.value) and "another packing" in str(exc.value)


def test_an_index_of_another_packing_is_named_not_blamed_on_an_image(tmp_path):
    """PNG images of different sizes: the other packing's index points into the middle of
    members; the reader says the index and the shards do not belong together."""
    src = _images(tmp_path / "images", 10)
    out, other = str(tmp_path / "shards"), str(tmp_path / "other")
    write_shards(src, out, 10)
    write_shards(src, other, 10, seed=5)
    for name in (shard_format.INDEX_JSON, shard_format.INDEX_ARRAYS):
        shutil.copyfile(os.path.join(other, name), os.path.join(out, name))
    ds = ImageShardsTask(root=out).train_dataset()
    with pytest.raises(UserError) as exc:
        for i in range(len(ds)):
            ds[i]
    text = str(exc.value)
    assert "not the one its index describes" in text or "another packing" in text, text
    assert "truncated" not in text and "cannot decode" not in text, text


def test_a_swapped_shard_stops_a_run_in_one_line(tmp_path, same_layout):
    out, _ = same_layout
    shutil.copyfile(os.path.join(out, "shard-000000.tar"), os.path.join(out, "shard-000001.tar"))
    code, text = _run(tmp_path, f"root: {out}, image_size: 8, width: 4, embed_dim: 4")
    lines = _error_lines(text)
    assert code == 2 and len(lines) == 1, text[-3000:]
    assert "shard-000001.tar" in lines[0] and "not the one its index describes" in lines[0]


def test_a_shard_that_is_a_folder_is_one_line(tmp_path):
    out = str(tmp_path / "shards")
    write_shards(_images(tmp_path / "images", 4), out, 4)
    os.remove(os.path.join(out, "shard-000001.tar"))
    os.makedirs(os.path.join(out, "shard-000001.tar"))
    with pytest.raises(UserError, match=r"shard-000001.tar is a folder, not a shard file"):
        ImageShardsTask(root=out).train_dataset()[5]


# -- the writer ----------------------------------------------------------------------------------


def _refused(src, out, *more):
    res = run_cli("clusterflow.tasks.shards", str(src), str(out), "--shard-size", "4", *more)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_the_writer_refuses_a_bad_out_before_writing_anything(tmp_path):
    src = _images(tmp_path / "images", 2)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    line = _refused(src, a_file)
    assert "OUT" in line and "is a file" in line and a_file.read_text() == "x"
    line = _refused(src, a_file / "shards")
    assert "OUT" in line and "which is a file" in line
    line = _refused(src, "nosuch://bucket/shards")
    assert "OUT" in line and "no protocol 'nosuch'" in line
    assert "task.params" not in line


def test_the_writer_refuses_a_read_only_out_before_writing_anything(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        line = _refused(_images(tmp_path / "images", 2), os.path.join(ro, "shards"))
        assert "OUT" in line and "read-only" in line


def test_the_writer_refuses_a_broken_link_in_src_before_writing_anything(tmp_path):
    src = _images(tmp_path / "images", 5)
    os.symlink(tmp_path / "gone.png", os.path.join(src, "b", "2-link.png"))
    out = tmp_path / "shards"
    line = _refused(src, out)
    assert "SRC" in line and "b/2-link.png" in line and "broken symbolic link" in line, line
    assert not out.exists()


def test_the_writers_src_errors_speak_of_src(tmp_path):
    line = _refused(tmp_path / "missing", tmp_path / "shards")
    assert line.startswith("error: SRC=") and "does not exist" in line
    assert "task.params" not in line and "make_digits" not in line
    assert not (tmp_path / "shards").exists()


# -- the sample ledger is a hint -------------------------------------------------------------------


def test_a_sample_ledger_that_cannot_be_written_does_not_stop_training(tmp_path):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "sample_ledger.json")
    code, text = _run(
        tmp_path,
        "identities: 24, samples_per_identity: 2, input_dim: 8, hidden: 16, embed_dim: 4",
        target="clusterflow.tasks.pseudo_id:PseudoIDTask",
        run_dir=str(run_dir),
    )
    assert code == 0, text[-3000:]
    assert "sample_ledger.json cannot be written" in text
