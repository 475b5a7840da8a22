"""train.parallel=fsdp on real gloo ranks: training through submit --local and `run` under a
torchrun-style launch, sharded checkpoints written by every rank, kills and stops resumed to
weights bitwise equal to an uninterrupted run, and config errors caught at submit."""

import glob
import hashlib
import json
import os
import re
import time

import launch
import pytest
import torch
from clihelp import call
from conftest import REPO

from clusterflow.checkpoint.export import main as export_main
from clusterflow.launch import submit

FSDP = ["train.parallel=fsdp"]


def weights(run_dir):
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rank0_log(run_dir):
    return "".join(
        open(p).read()
        for p in sorted(glob.glob(os.path.join(run_dir, "logs", "rank0.attempt*.log")))
    )


def digests(folder):
    return {
        p: hashlib.sha256(open(p, "rb").read()).hexdigest()
        for p in sorted(glob.glob(os.path.join(folder, "step-*", "*")))
    }


def live_status(run_dir):
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def wait_for(what, predicate, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted fsdp run of tiny.yaml on 2 ranks (`run` under a torchrun-style launch)."""
    d = str(tmp_path_factory.mktemp("ref") / "run")
    assert launch.run(2, "configs/tiny.yaml", [f"run.dir={d}", *FSDP], d) == [0, 0]
    return d


@pytest.fixture
def tasks_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(REPO, "tests"))


def test_submit_local_trains_sharded_and_model_pt_is_the_plain_models_state(
    reference, tmp_path, cli
):
    d = str(tmp_path / "run")
    out = cli("clusterflow.submit", "configs/tiny.yaml", "--local", f"run.dir={d}", *FSDP)
    assert out.returncode == 0, out.stdout + out.stderr
    assert same_weights(weights(d), weights(reference))  # submit --local and torchrun agree
    from clusterflow.tasks.pseudo_id import PseudoIDTask

    plain = PseudoIDTask(
        seed=1, identities=24, samples_per_identity=8, input_dim=32, hidden=64, embed_dim=16
    ).build_model()
    plain.load_state_dict(weights(d))  # strict: every name, every shape, plain tensors
    assert all(type(v) is torch.Tensor for v in weights(d).values())
    step = os.path.join(d, "checkpoints", "step-18")
    manifest = json.load(open(os.path.join(step, "manifest.json")))
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"] + [
        "train_state.pt"
    ]
    for name, info in manifest["files"].items():
        assert os.path.getsize(os.path.join(step, name)) == info["size"]


def test_sigterm_mid_epoch_resumes_bitwise(reference, tmp_path, tasks_path):
    """Both ranks are told to stop at step 7 (the first of epoch 2): they agree on a step of epoch
    2 (agreements run every 0.2 s), every rank writes its shards of it and the job ends; the next
    attempt loads them and ends bitwise equal."""
    d = str(tmp_path / "run")
    over = [
        f"run.dir={d}",
        *FSDP,
        "task.target=testtasks:Signals",
        f"task.params.run_dir={d}",
        "task.params.signals=0:7:TERM",
    ]
    assert launch.run(2, "configs/tiny.yaml", over, d) == [0, 0]
    stop = int(re.search(r"saving at global step (\d+) and stopping", rank0_log(d)).group(1))
    assert 7 <= stop <= 12
    assert not os.path.exists(os.path.join(d, "model.pt"))
    assert launch.run(2, "configs/tiny.yaml", over, d) == [0, 0]
    assert re.search(
        rf"resumed from \S+/step-{stop}: epoch 2, step {stop - 6} of the epoch", rank0_log(d)
    )
    assert same_weights(weights(d), weights(reference))


@pytest.mark.parametrize("background", ["true", "false"], ids=["async", "sync"])
def test_sigkill_during_a_sharded_write_keeps_the_previous_checkpoint(
    reference, tmp_path, tasks_path, background
):
    """Rank 1 has written its shards of step 8 and hangs before rank 0 commits (on the writer's
    thread with checkpoint.async, the ranks training on); every process is SIGKILLed. The
    committed steps are untouched, the next attempt removes the staging folder, resumes from
    step 6 and ends bitwise equal to the uninterrupted run."""
    d = str(tmp_path / "run")
    ckpts = os.path.join(d, "checkpoints")
    over = [
        f"run.dir={d}",
        *FSDP,
        "task.target=testtasks:HangInShardedSave",
        "task.params.step_sleep=0.05",
        "task.params.hang_at_step=8",
        f"checkpoint.async={background}",
    ]
    procs = launch.start(2, "configs/tiny.yaml", over, d)
    try:
        wait_for("rank 1 hanging in the write", lambda: os.path.exists(f"{d}/hang-in-save.done"))
        wait_for(
            "both ranks' shards of step 8",
            lambda: len(glob.glob(os.path.join(ckpts, ".tmp-step-8-*", "__*_0.distcp"))) == 2,
        )
        if background == "true":
            wait_for(
                "training past step 8 while it is written",
                lambda: live_status(d).get("global_step", 0) >= 10,
            )
        committed = digests(ckpts)
        assert sorted({os.path.basename(os.path.dirname(p)) for p in committed}) == [
            "step-4",
            "step-6",
        ]
    finally:
        launch.kill(procs)
        launch.wait(procs)
    assert digests(ckpts) == committed  # the kill touched no committed step
    assert launch.run(2, "configs/tiny.yaml", over, d) == [0, 0]
    logs = rank0_log(d)
    assert "removed unfinished checkpoint folders left by a killed writer: .tmp-step-8-" in logs
    assert re.search(r"resumed from \S+/step-6: epoch 2, step 0 of the epoch", logs)
    assert same_weights(weights(d), weights(reference))


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["task.target=testtasks:NoShard"],
            "train.parallel=fsdp: task 'testtasks:NoShard' cannot be sharded",
        ),
        (["train.amp=fp16"], "train.amp = 'fp16': fp16 loss scaling is not supported"),
        (["checkpoint.dir=memory://ck"], "checkpoint.dir = 'memory://ck': train.parallel=fsdp"),
    ],
)
def test_submit_refuses_what_fsdp_cannot_run(tmp_path, monkeypatch, overrides, says):
    """In-process (tests/clihelp.call, as python -m runs it): a refusal ends before anything
    starts."""
    d = str(tmp_path / "run")
    monkeypatch.chdir(REPO)
    code, out, err = call(
        submit.main, ["configs/tiny.yaml", "--local", f"run.dir={d}", *FSDP, *overrides]
    )
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not os.path.exists(d)  # nothing written


def test_submit_refuses_an_unknown_parallel_mode(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    code, _, err = call(submit.main, ["configs/tiny.yaml", "--local", "train.parallel=zero3"])
    assert code == 2
    assert "train.parallel = 'zero3': must be one of ddp, fsdp" in err, err


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) - 7)


def _lie_about_size(path):
    folder, name = os.path.split(path)
    mpath = os.path.join(folder, "manifest.json")
    manifest = json.load(open(mpath))
    manifest["files"][name]["size"] += 1
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _forge(path):
    """Garbage in a shard where its tensors are (the entries before them, its checkpoint id among
    them, kept), and a manifest that agrees with it (size and digest): intact by its manifest and
    of this checkpoint, it does not load."""
    import blake3
    from torch.distributed.checkpoint import FileSystemReader

    folder, name = os.path.split(path)
    meta = FileSystemReader(folder).read_metadata()
    keep = max(
        info.offset + info.length
        for index, info in meta.storage_data.items()
        if info.relative_path == name and index.fqn.startswith("checkpoint.")
    )
    with open(path, "rb") as f:
        data = f.read()[:keep] + b"not a shard" * 1000
    with open(path, "wb") as f:
        f.write(data)
    mpath = os.path.join(folder, "manifest.json")
    manifest = json.load(open(mpath))
    manifest["files"][name] = {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _copy_from_step_16(path):
    """The file and its manifest entry from step 16 (the same layout): size and digest agree."""
    import shutil

    folder, name = os.path.split(path)
    older = os.path.join(os.path.dirname(folder), "step-16")
    shutil.copyfile(os.path.join(older, name), path)
    entry = json.load(open(os.path.join(older, "manifest.json")))["files"][name]
    mpath = os.path.join(folder, "manifest.json")
    manifest = json.load(open(mpath))
    manifest["files"][name] = entry
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _unlist(path):
    folder, name = os.path.split(path)
    mpath = os.path.join(folder, "manifest.json")
    manifest = json.load(open(mpath))
    del manifest["files"][name]
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _stopped_copy_damaged(reference, tmp_path, name, damage):
    """The finished reference run, copied as a run stopped after its last checkpoint (model.pt
    removed, state stopped: a completed run would train nothing); ``name`` of step 18 damaged."""
    import shutil

    d = str(tmp_path / "run")
    shutil.copytree(reference, d, ignore=shutil.ignore_patterns("model.pt"))
    status = json.load(open(os.path.join(d, "status.json")))
    with open(os.path.join(d, "status.json"), "w") as f:
        json.dump({**status, "state": "stopped"}, f)
    damage(os.path.join(d, "checkpoints", "step-18", name))
    return d


@pytest.mark.parametrize(
    "name, damage, says",
    [
        ("__1_0.distcp", _flip, "__1_0.distcp does not match its blake3 digest"),
        ("__1_0.distcp", _forge, "its shards do not load on rank "),
    ],
    ids=["flipped-byte", "forged-shard"],
)
def test_a_damaged_shard_is_skipped_named_and_the_previous_checkpoint_used(
    reference, tmp_path, name, damage, says
):
    """One file of the last checkpoint (step 18) damaged: the run is resumed from step 16 with a
    warning naming the file, and ends with the same weights. Two real resumes: a shard its
    manifest's digest refuses (the store's verification, which every reader shares) and a forged
    shard that verifies but does not load (only a real DCP load on the ranks finds it); the other
    damage the verification finds is checked in-process below."""
    d = _stopped_copy_damaged(reference, tmp_path, name, damage)
    assert launch.run(2, "configs/tiny.yaml", [f"run.dir={d}", *FSDP], d) == [0, 0]
    logs = rank0_log(d)
    assert re.search(rf"skipping damaged checkpoint \S+/step-18: {re.escape(says)}", logs), logs
    assert re.search(r"resumed from \S+/step-16: epoch 3, step 4 of the epoch", logs), logs
    assert same_weights(weights(d), weights(reference))


@pytest.mark.parametrize(
    "name, damage, says",
    [
        ("__0_0.distcp", _truncate, "__0_0.distcp has "),
        ("__1_0.distcp", os.remove, "__1_0.distcp is missing"),
        (".metadata", os.remove, ".metadata is missing"),
        ("__0_0.distcp", _lie_about_size, "__0_0.distcp has "),
        ("__1_0.distcp", _copy_from_step_16, "__1_0.distcp belongs to step 16's checkpoint"),
    ],
    ids=["truncated", "missing-shard", "missing-metadata", "lying-manifest", "shard-of-step-16"],
)
def test_a_damaged_shard_fails_the_verification_a_resume_skips_it_by(
    reference, tmp_path, caplog, name, damage, says
):
    """The same damage to step 18, read in-process through the store's verification that a
    resume reads its candidates by (CheckpointStore.candidates, as the flipped byte above shows
    end to end): step 18 is refused naming the file, skipped with the resume's warning, and step
    16 is the newest that verifies."""
    from clusterflow.checkpoint.export import model_state
    from clusterflow.errors import UserError

    d = _stopped_copy_damaged(reference, tmp_path, name, damage)
    with pytest.raises(UserError, match=re.escape(says)):
        model_state(d, 18)
    assert model_state(d)[1] == 16
    skipped = rf"skipping damaged checkpoint \S+/step-18: {re.escape(says)}.*falling back to the"
    assert re.search(skipped, caplog.text), caplog.text


@pytest.mark.parametrize(
    "name, damage, says",
    [
        ("__1_0.distcp", _unlist, "__1_0.distcp is in the folder but not in its manifest"),
        ("__0_0.distcp", _copy_from_step_16, "__0_0.distcp belongs to step 16's checkpoint"),
        (".metadata", _copy_from_step_16, ".metadata belongs to another checkpoint"),
    ],
    ids=["unlisted-shard", "shard-of-step-16", "metadata-of-step-16"],
)
def test_every_shard_read_is_listed_and_of_this_checkpoint(reference, tmp_path, name, damage, says):
    """A shard the manifest leaves out, or one copied with its manifest entry from the previous
    checkpoint (same layout, so DCP would read it without a word): export, init_from and a
    resume (the same verification) refuse the step, naming the file."""
    import shutil

    from clusterflow.checkpoint.export import model_state
    from clusterflow.errors import UserError
    from clusterflow.tasks.pseudo_id import PseudoIDTask
    from clusterflow.train.builders import init_weights

    d = str(tmp_path / "run")
    shutil.copytree(reference, d, ignore=shutil.ignore_patterns("model.pt"))
    step18 = os.path.join(d, "checkpoints", "step-18")
    damage(os.path.join(step18, name))
    with pytest.raises(UserError, match=re.escape(says)):
        model_state(d, 18)
    plain = PseudoIDTask(
        seed=7, identities=24, samples_per_identity=8, input_dim=32, hidden=64, embed_dim=16
    ).build_model()
    with pytest.raises(UserError, match=re.escape(says)):
        init_weights(plain, step18)
    assert model_state(d)[1] == 16  # the newest that verifies


def test_init_from_a_sharded_step_folder_takes_its_whole_model(reference, tmp_path):
    from clusterflow.tasks.pseudo_id import PseudoIDTask
    from clusterflow.train.builders import init_weights

    plain = PseudoIDTask(
        seed=7, identities=24, samples_per_identity=8, input_dim=32, hidden=64, embed_dim=16
    ).build_model()
    step16 = os.path.join(reference, "checkpoints", "step-16")
    saved = saved_model(step16, tmp_path)
    assert not same_weights(plain.state_dict(), saved)
    init_weights(plain, step16)
    assert same_weights(plain.state_dict(), saved)


def saved_model(step_dir, tmp_path):
    """The whole model of a sharded checkpoint, read in this process (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / "saved.pt")
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=True)["model"]


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory):
    """A fsdp run on 4 ranks stopped (SIGTERM) in epoch 2: (its run dir, a copy of it as the stop
    left it, the stop step). Each test resumes a fresh copy at the same path (the run dir is a
    task parameter)."""
    import shutil

    d = str(tmp_path_factory.mktemp("four") / "run")
    over = [
        f"run.dir={d}",
        *FSDP,
        *RESHARD,
        "cluster.tasks_per_node=4",
        f"task.params.run_dir={d}",
        "task.params.signals=0:9:TERM",
    ]
    env = {"PYTHONPATH": os.path.join(REPO, "tests")}
    launch.run(4, "configs/tiny.yaml", over, d + ".launch", env=env)
    stop = re.search(r"saving at global step (\d+) and stopping", rank0_log(d))
    assert stop, rank0_log(d)
    shutil.copytree(d, d + ".saved")
    return d, d + ".saved", int(stop.group(1))


# 24 samples per step: divisible by 4, 3 and 2 ranks (8 steps per epoch).
RESHARD = ["task.target=testtasks:DumpRestored", "train.batch_size=24"]


@pytest.mark.parametrize("world", [3, 2])
def test_a_run_saved_on_4_ranks_resumes_on_fewer_with_the_saved_values(saved_on_4, tmp_path, world):
    """The stop checkpoint of 4 ranks, resumed with 3 or 2 ranks (tests/launch.py: resharding is
    the ranks' own work, whatever started them): DCP reshards it, the parameters the resumed
    ranks hold before their first step equal the saved ones exactly, and the run completes."""
    import shutil

    d, saved_copy, stop = saved_on_4
    shutil.rmtree(d)
    shutil.copytree(saved_copy, d)
    env = {"PYTHONPATH": os.path.join(REPO, "tests")}
    over = [
        f"run.dir={d}",
        *FSDP,
        *RESHARD,
        f"cluster.tasks_per_node={world}",
        f"task.params.run_dir={d}",
        "task.params.signals=0:9:TERM",
    ]
    codes = launch.run(world, "configs/tiny.yaml", over, str(tmp_path / "launch"), env=env)
    logs = rank0_log(d)
    assert codes == [0] * world, logs
    assert f"resuming with {world} ranks from a checkpoint of 4" in logs, logs
    assert re.search(rf"resumed from \S+/step-{stop}: ", logs), logs
    saved = saved_model(os.path.join(saved_copy, "checkpoints", f"step-{stop}"), tmp_path)
    restored = torch.load(os.path.join(d, "restored-attempt1.pt"), weights_only=True)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert os.path.exists(os.path.join(d, "model.pt"))


def test_init_from_an_unfinished_sharded_run_takes_its_newest_checkpoint(saved_on_4, tmp_path):
    """task.init_from names the fsdp run stopped on 4 ranks (no model.pt yet, its checkpoints are
    DCP shards): a plain model starts from the stop checkpoint's whole parameters."""
    from clusterflow.tasks.pseudo_id import PseudoIDTask
    from clusterflow.train.builders import init_weights

    _, saved_copy, stop = saved_on_4
    assert not os.path.exists(os.path.join(saved_copy, "model.pt"))
    plain = PseudoIDTask(
        seed=7, identities=24, samples_per_identity=8, input_dim=32, hidden=64, embed_dim=16
    ).build_model()
    saved = saved_model(os.path.join(saved_copy, "checkpoints", f"step-{stop}"), tmp_path)
    assert not same_weights(plain.state_dict(), saved)
    init_weights(plain, saved_copy)
    assert same_weights(plain.state_dict(), saved)


def test_export_writes_one_file_equal_to_the_gathered_weights(reference, tmp_path):
    """A sharded checkpoint (the newest, and --step 16), as .pt and as safetensors, in fp32 and
    bf16: each loads into the plain model and equals the weights (a one-file checkpoint's export
    is test_export.py's). `clusterflow export` runs in-process (tests/clihelp.call, as python -m
    runs it)."""
    from safetensors.torch import load_file

    from clusterflow.tasks.pseudo_id import PseudoIDTask

    def export(run_dir, *args):
        code, out, err = call(export_main, [run_dir, *args])
        assert code == 0, out + err
        return out

    final = weights(reference)
    pt, st, bf = (str(tmp_path / n) for n in ("m.pt", "m.safetensors", "bf16.pt"))
    assert "checkpoint step 18" in export(reference, pt)
    assert same_weights(torch.load(pt, weights_only=True), final)
    export(reference, st, "--format", "safetensors")
    assert same_weights(load_file(st), final)
    export(reference, bf, "--dtype", "bf16")
    assert same_weights(
        torch.load(bf, weights_only=True), {k: v.to(torch.bfloat16) for k, v in final.items()}
    )
    plain = PseudoIDTask(
        seed=1, identities=24, samples_per_identity=8, input_dim=32, hidden=64, embed_dim=16
    ).build_model()
    plain.load_state_dict(load_file(st))
    old = str(tmp_path / "16.pt")
    export(reference, old, "--step", "16")
    step16 = saved_model(os.path.join(reference, "checkpoints", "step-16"), tmp_path)
    assert same_weights(torch.load(old, weights_only=True), step16)
    assert not same_weights(step16, final)


def test_export_says_what_is_wrong_in_one_line(reference, tmp_path):
    for args, says in [
        (
            (reference, str(tmp_path / "x.pt"), "--step", "7"),
            "no committed step 7; loadable steps: 18, 16, 12",
        ),
        ((str(tmp_path), str(tmp_path / "x.pt")), "is not a run dir"),
    ]:
        code, out, err = call(export_main, list(args))
        assert code == 2, out + err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], err
        assert not os.path.exists(tmp_path / "x.pt")


def test_one_process_trains_sharded_too(tmp_path, cli):
    """No launcher, one process: a one-rank mesh; its checkpoints are sharded like any other."""
    d = str(tmp_path / "run")
    out = cli(
        "clusterflow.run", "configs/tiny.yaml", f"run.dir={d}", "cluster.tasks_per_node=1", *FSDP
    )
    assert out.returncode == 0, out.stdout + out.stderr
    manifest = json.load(open(os.path.join(d, "checkpoints", "step-18", "manifest.json")))
    assert manifest["format"] == "dcp" and "__0_0.distcp" in manifest["files"]
    assert all(type(v) is torch.Tensor for v in weights(d).values())


def _round_key_inside_the_gathered_window():
    from clusterflow.mining.rounds import round_key
    from clusterflow.train import parallel

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    m = parallel.wrap_fsdp(m, parallel.default_units(m), torch.device("cpu"), 2, None)
    with parallel.gathered(m):
        key = round_key(m, 1, 2, 10, {})
        kind = type(m[0].weight).__name__
    return kind, key


def test_the_mining_rounds_key_leaves_the_gathered_model_gathered():
    """The embed runs on the gathered model with no collective per batch: hashing the weights for
    the round's files (mining.resume) must not reshard it."""
    from multirank import run_ranks

    out = run_ranks(2, _round_key_inside_the_gathered_window)
    assert [out[r][0] for r in (0, 1)] == ["Parameter", "Parameter"], out
    assert out[0][1] == out[1][1]  # the whole model's bytes: the same key on every rank
