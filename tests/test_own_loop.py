"""A plain PyTorch DDP script converted to clusterflow (tests/ownloop/: plain_ddp.py and
converted_ddp.py, started as torchrun starts them, through ``python -m clusterflow.run
--script``): at most 15 changed lines; killed with SIGKILL at a random step in mid-epoch and
resumed, bitwise equal to its uninterrupted run, its batches after the resume those of the
uninterrupted run; stopped in mid-epoch and resumed on another world size, every sample trained
once per epoch as the script itself recorded it; every misuse refused with one line."""

import difflib
import glob
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time

import launch
import numpy as np
import pytest
import torch
from conftest import REPO, run_cli, weights_equal
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from clusterflow import rundir
from clusterflow.config import load
from clusterflow.distributed.sampler import EpochPlan
from clusterflow.errors import UserError
from clusterflow.observe.context import JobContext
from clusterflow.rundir import timeline
from clusterflow.storage.store import CheckpointStore
from clusterflow.train.preemption import Preemption
from clusterflow.train.session import Run, RunInternals

HERE = os.path.join(REPO, "tests", "ownloop")
PLAIN, CONVERTED = os.path.join(HERE, "plain_ddp.py"), os.path.join(HERE, "converted_ddp.py")
# 200 samples, 16 a rank: 6 steps an epoch on 2 ranks; saves every 4 steps (in the background).
CONFIG = ("checkpoint.every_steps=4", "train.log_every_steps=2", "dist.heartbeat_s=1")
EPOCHS = 3
ARGS = ("--epochs", str(EPOCHS))


def start(world, run_dir, env=None, config=CONFIG):
    """``world`` ranks of the converted script, as torchrun starts ``python -m clusterflow.run
    --script converted_ddp.py ... -- --epochs 3``."""
    seen = os.path.join(run_dir + "-seen")
    os.makedirs(seen, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "clusterflow.run",
        "--script",
        CONVERTED,
        f"run.dir={run_dir}",
        *config,
        "--",
        *ARGS,
    ]
    return launch.start(
        world, None, None, run_dir + "-logs", command=command, env={"SEEN_DIR": seen, **(env or {})}
    )


def seen(run_dir):
    """What the script recorded: rank -> [{"epoch", "pid", "index"}, ...] in the order trained."""
    out = {}
    for path in glob.glob(os.path.join(run_dir + "-seen", "rank*.jsonl")):
        rank = int(os.path.basename(path)[4:-6])
        out[rank] = [json.loads(line) for line in open(path)]
    return out


def wait_for(path, procs, timeout=300):
    t0 = time.time()
    while not os.path.exists(path):
        codes = [p.poll() for p in procs]
        assert all(c is None for c in codes), f"a rank ended before {path}: {codes}"
        assert time.time() - t0 < timeout, f"no {path} after {timeout} s"
        time.sleep(0.1)


def rank0_log(run_dir):
    return "".join(
        open(p).read() for p in sorted(glob.glob(os.path.join(run_dir, "logs", "rank0.*.log")))
    )


def restored_step(run_dir, attempt):
    """The step attempt ``attempt`` resumed from, as its timeline records it. A run killed while a
    background write renames its folder can leave that step complete but uncommitted; the
    resume publishes it, so this can be newer than the steps committed when the run died."""
    return timeline.read_all(rundir.RunPaths(run_dir)).records[attempt]["restored_step"]


def records(run_dir):
    """rank -> what a test script recorded in SEEN_DIR (``RUN_DIR-seen/rank<R>.jsonl``), in
    order."""
    out = {}
    for path in glob.glob(os.path.join(run_dir + "-seen", "rank*.jsonl")):
        out[int(os.path.basename(path)[4:-6])] = [json.loads(line) for line in open(path)]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("own-loop") / "run")
    assert launch.wait(start(2, d)) == [0, 0], rank0_log(d)[-3000:]
    return d


def test_the_conversion_changes_at_most_15_lines_and_the_docs_show_its_diff():
    diff = list(
        difflib.unified_diff(
            open(PLAIN).read().splitlines(),
            open(CONVERTED).read().splitlines(),
            "plain_ddp.py",
            "converted_ddp.py",
            n=1,
            lineterm="",
        )
    )
    added = [line for line in diff[2:] if line.startswith("+")]
    removed = [line for line in diff[2:] if line.startswith("-")]
    print(f"\nconverted_ddp.py: {len(added)} lines added or changed, {len(removed)} removed")
    assert 0 < len(added) <= 15 and len(removed) <= 15, "\n".join(diff)
    assert any("clusterflow.start()" in line for line in added)
    page = open(os.path.join(REPO, "docs", "own-loop.md")).read()
    shown = page.split("```diff\n", 1)[1].split("```", 1)[0].rstrip("\n").splitlines()
    assert shown == diff, "docs/own-loop.md's diff is stale"
    assert f"**{len(added)} lines added or changed, {len(removed)} removed**" in page


def test_sigkill_at_a_random_mid_epoch_step_resumes_bitwise(uninterrupted, tmp_path):
    # Mid-epoch steps of epochs 2 and 3 (6 steps each) whose last save (every 4 steps) is in
    # mid-epoch too: the kill comes before run.step, and the resumed attempt starts in mid-epoch,
    # where the script's look at the epoch's first batch (next(iter(loader))) must not move the
    # random streams its augmentation draws from.
    k = random.choice([s for s in range(7, 18) if s % 6 and (s - 1) // 4 * 4 % 6])
    print(f"\nSIGKILL of both ranks at global step {k}")
    d = str(tmp_path / "run")
    procs = start(2, d, env={"HOLD_AT_STEP": str(k)})
    wait_for(os.path.join(d + "-seen", "held"), procs)
    launch.kill(procs)
    assert launch.wait(procs) == [-signal.SIGKILL] * 2
    committed = CheckpointStore(os.path.join(d, "checkpoints")).steps()
    assert committed and max(committed) < k, committed
    assert launch.wait(start(2, d)) == [0, 0], rank0_log(d)[-3000:]

    resumed = restored_step(d, 1)
    assert max(committed) <= resumed < k, (committed, resumed)
    assert (
        f"/step-{resumed}: epoch {resumed // 6 + 1}, step {resumed % 6} of the epoch"
        in rank0_log(d)
    )
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(uninterrupted, "model.pt"))
    # What the script saw after the resume: the uninterrupted run's batches from that step on.
    mine, plain = seen(d), seen(uninterrupted)
    for rank in (0, 1):
        second = [r for r in mine[rank] if r["pid"] != mine[rank][0]["pid"]]
        assert [(r["epoch"], r["index"]) for r in second] == [
            (r["epoch"], r["index"]) for r in plain[rank][resumed:]
        ]


def test_loader_batch_size_is_the_value_passed_and_a_look_at_a_batch_counts_nothing(
    uninterrupted,
):
    # Each epoch's start, on each of 2 ranks: len(loader) batches, the first looked at, and
    # loader.batch_size as the DataLoader it replaces has it (16 a rank, not the step's 32).
    for rank in (0, 1):
        log = "".join(
            open(p).read()
            for p in glob.glob(os.path.join(uninterrupted, "logs", f"rank{rank}.attempt0.log"))
        )
        for epoch in range(EPOCHS):
            assert f"[rank {rank}] epoch {epoch}: 6 batches of 16 (16)" in log, log[-2000:]
    # The looks trained nothing: each epoch's samples once, 6 steps of 32, the last of 40.
    ledger = json.load(open(os.path.join(uninterrupted, "sample_ledger.json")))
    assert [[(r["start"], r["end"]) for r in e["ranges"]] for e in ledger["epochs"]] == [
        [(0, 200)]
    ] * EPOCHS
    assert (
        json.loads(run_cli("clusterflow.status", uninterrupted, "--json").stdout)["global_step"]
        == 6 * EPOCHS
    )


def test_the_scripts_own_seed_is_kept_on_every_rank(uninterrupted):
    # converted_ddp.py seeds torch itself after clusterflow.start() (torch.manual_seed(0), as
    # plain_ddp.py does on every rank): run.setup keeps it, so both ranks' streams, drawn the same
    # number of times (dropout, the noise augmentation), end alike; per-rank streams would not.
    store = CheckpointStore(os.path.join(uninterrupted, "checkpoints"))
    state = torch.load(
        os.path.join(store.step_path(max(store.steps())), "train_state.pt"), weights_only=True
    )
    first, second = state["rng"]
    assert torch.equal(first["torch"], second["torch"])
    assert first["python"] != second["python"]  # not seeded by the script: a stream per rank


def test_a_completed_run_launched_again_on_two_ranks_trains_nothing(uninterrupted):
    before = open(os.path.join(uninterrupted, "attempts.jsonl")).read()
    status = open(os.path.join(uninterrupted, "status.json")).read()
    procs = start(2, uninterrupted)
    assert launch.wait(procs) == [0, 0]
    said = "".join(open(p).read() for p in glob.glob(uninterrupted + "-logs/launch-rank0-*"))
    assert f"run dir {uninterrupted} already completed at step 18: nothing to train" in said
    assert open(os.path.join(uninterrupted, "attempts.jsonl")).read() == before
    assert open(os.path.join(uninterrupted, "status.json")).read() == status


def test_stopped_mid_epoch_and_resumed_on_three_ranks_each_sample_is_trained_once_per_epoch(
    tmp_path,
):
    d = str(tmp_path / "run")
    # Steps of 0.3 s: the stop agreement reads every rank's flag at each step boundary.
    procs = start(2, d, env={"HOLD_AT_STEP": "8", "STEP_SLEEP_S": "0.3"})
    wait_for(os.path.join(d + "-seen", "held"), procs)
    launch.kill(procs, signal.SIGTERM)
    open(os.path.join(d + "-seen", "release"), "w").close()
    assert launch.wait(procs) == [0, 0], rank0_log(d)[-3000:]
    stopped = int(rank0_log(d).split("saving at global step ")[1].split()[0])
    assert 8 <= stopped <= 10, stopped  # in mid-epoch 2 (the signal came at step 8)
    assert launch.wait(start(3, d)) == [0, 0, 0], rank0_log(d)[-3000:]

    records = seen(d)
    assert sorted(records) == [0, 1, 2]  # the resumed attempt ran on three ranks
    for epoch in range(EPOCHS):
        trained = [
            i for rs in records.values() for r in rs if r["epoch"] == epoch for i in r["index"]
        ]
        assert sorted(trained) == list(range(200)), (epoch, len(trained))
    # The ledger says the same: epoch 2 half on 2 ranks (32 a step), the rest on 3 (48 a step).
    position = (stopped - 6) * 32
    ledger = json.load(open(os.path.join(d, "sample_ledger.json")))
    second = ledger["epochs"][1]["ranges"]
    assert [(r["start"], r["end"], r["world_size"]) for r in second] == [
        (0, position, 2),
        (position, 200, 3),
    ], second
    steps = 6 + EpochPlan.of(200, 32).with_batch(position, 48).steps() + 200 // 48
    status = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert status["state"] == "completed" and status["attempts"] == 2, status
    assert status["world_size"] == 3 and status["global_step"] == steps, status


# -- misuse ---------------------------------------------------------------------------------------


class Items(Dataset):
    def __init__(self, n=64):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i


def a_run(tmp_path, name):
    cfg = load(None, [f"run.dir={tmp_path / name}", "script.path=train.py"])
    os.makedirs(cfg.run.dir)
    return Run(
        JobContext(cfg, rundir.RunPaths(cfg.run.dir)),
        torch.device("cpu"),
        Preemption(),
        lambda outcome: (outcome, 0),
    )


def set_up(run):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return (*run.setup(model, opt), model)


def train_step(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def refused(fn, *args, **kwargs):
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def documented_api():
    """The names ``run.NAME`` that docs/own-loop.md documents in "What each call does and
    guarantees" (up to the next page section): the first column of its tables (the calls, the
    helpers) and its "Also:" paragraph."""
    with open(os.path.join(REPO, "docs", "own-loop.md")) as f:
        text = f.read()
    _, found, rest = text.partition("\n## What each call does and guarantees\n")
    assert found, "docs/own-loop.md lost its section 'What each call does and guarantees'"
    section = rest.split("\n## ", 1)[0]
    cells = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| ")]
    also = [par for par in section.split("\n\n") if par.startswith("Also:")]
    return set(re.findall(r"\brun\.(\w+)", " ".join(cells + also)))


def test_runs_public_names_are_exactly_the_api_docs_own_loop_documents(tmp_path):
    """A script sees the library API and nothing else: what clusterflow's own code needs beyond
    it is RunInternals."""
    run = a_run(tmp_path, "surface")
    public = {name for name in dir(run) if not name.startswith("_")}
    documented = documented_api()
    assert public == documented, (
        f"public, not in docs/own-loop.md: {sorted(public - documented)}; "
        f"documented, not public: {sorted(documented - public)}"
    )


def test_a_dataloader_of_the_users_own_is_refused_naming_run_loader(tmp_path):
    run = a_run(tmp_path, "own")
    model, opt, _ = set_up(run)
    run.loader(Items(), batch_size=8)
    run.restore(model=model, optimizer=opt)
    mine = DataLoader(Items(), batch_size=8, shuffle=True)
    for _ in run.epochs(1):
        for x, _i in mine:
            train_step(model, opt, x)
            message = refused(run.step)
            break
        break
    assert "a DataLoader of your own" in message and "run.loader(dataset" in message
    for key, value in (
        ("shuffle", True),
        ("sampler", DistributedSampler(Items(), num_replicas=1, rank=0)),
        ("drop_last", True),
    ):
        message = refused(a_run(tmp_path, key).loader, Items(), 8, **{key: value})
        assert f"run.loader(..., {key}=...)" in message and "bypass" in message
    message = refused(lambda: a_run(tmp_path, "dl").loader(DataLoader(Items()), 8))
    assert "takes a dataset, not a DataLoader" in message


def test_finish_stops_the_workers_a_loop_left_in_mid_epoch(tmp_path):
    """Persistent workers of a loop of run.steps that ends in mid-epoch: still running after
    the loop (the loader keeps its iterator), stopped by run.finish() (the exit would send them
    a SIGTERM they outlive and wait for them: tests/test_own_loop_stream.py runs that)."""
    run = a_run(tmp_path, "workers")
    model, opt, _ = set_up(run)
    loader = run.loader(Items(), batch_size=4, num_workers=1, persistent_workers=True)
    run.restore(model=model, optimizer=opt)
    for x, _i in run.steps(loader, 3):  # 3 of the epoch's 16 steps
        train_step(model, opt, x)
        run.step()
    workers = [p for p in multiprocessing.active_children() if p.is_alive()]
    assert len(workers) == 1, workers
    assert run.finish() == "completed"
    assert not [p for p in workers if p.is_alive()], workers


def test_a_resume_with_max_steps_below_the_step_reached_says_so_in_one_line(tmp_path, caplog):
    def steps(run, max_steps):
        model, opt, _ = set_up(run)
        loader = run.loader(Items(), batch_size=4)
        run.restore(model=model, optimizer=opt)
        for x, _i in run.steps(loader, max_steps):
            train_step(model, opt, x)
            run.step()
        return run.finish()

    first = a_run(tmp_path, "steps")
    assert steps(first, 6) == "completed" and first.global_step == 6
    first_of = RunInternals(first)
    again = Run(
        JobContext(first_of.config, first_of.paths, 1),
        torch.device("cpu"),
        Preemption(),
        lambda o: (o, 0),
    )
    caplog.clear()
    assert steps(again, 4) == "completed" and again.global_step == 6
    said = [r.getMessage() for r in caplog.records if "max_steps" in r.getMessage()]
    line = (
        "run.steps(loader, 4): the run has taken 6 steps already, more than max_steps, so this "
        "loop trains none and run.finish() ends the run at step 6; to train 4 steps, start a new "
        "run.dir"
    )
    assert said == [line], said


def test_a_look_at_a_batch_counts_nothing_and_batch_size_is_the_value_passed(tmp_path):
    run = a_run(tmp_path, "look")
    model, opt, _ = set_up(run)
    loader = run.loader(Items(), batch_size=8)
    assert (loader.batch_size, loader.global_batch_size, len(loader)) == (8, 8, 8)
    grouped = a_run(tmp_path, "global").loader(Items(), global_batch_size=16, accumulate=2)
    assert (grouped.batch_size, grouped.global_batch_size) == (8, 16)
    _, first = next(iter(loader))  # before run.restore: the batch the loop trains first
    run.restore(model=model, optimizer=opt)
    trained = []
    for _ in run.epochs(2):
        _, look = next(iter(loader))  # at the epoch's start: its first batch, counted nowhere
        for x, index in loader:
            trained.append(index)
            if len(trained) == 1:
                assert torch.equal(index, first) and torch.equal(index, look)
            train_step(model, opt, x)
            run.step()
        assert torch.equal(trained[-8], look)
    assert run.global_step == 16
    assert sorted(torch.cat(trained[:8]).tolist()) == list(range(64))
    ledger = RunInternals(run).state.ledger.epochs
    assert [[(r["start"], r["end"]) for r in e["ranges"]] for e in ledger] == [[(0, 64)]] * 2


def test_a_batch_that_reached_the_model_is_a_steps_and_a_stream_cannot_be_looked_at(tmp_path):
    run = a_run(tmp_path, "reached")
    model, opt, _ = set_up(run)
    loader = run.loader(Items(), batch_size=8)
    looking = iter(loader)
    x, _ = next(looking)
    model(x)  # a forward on a batch outside the loop, then the next: a loop of the script's own
    message = refused(next, looking)
    assert message.startswith("run.loader is iterated inside `for epoch in run.epochs(n):`")
    run.restore(model=model, optimizer=opt)
    for _ in run.epochs(1):
        x, _ = next(iter(loader))
        train_step(model, opt, x)  # trained on, and no run.step
        assert "run.step() was not called after global step 1" in refused(next, iter(loader))
        break

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(100))

    stream = a_run(tmp_path, "stream").loader(Stream(), batch_size=4)
    assert "would move each rank's position in its stream" in refused(next, iter(stream))


def test_a_step_missing_or_twice_is_refused(tmp_path):
    run = a_run(tmp_path, "steps")
    model, opt, _ = set_up(run)
    loader = run.loader(Items(), batch_size=8)
    run.restore(model=model, optimizer=opt)
    for _ in run.epochs(1):
        batches = iter(loader)
        x, _i = next(batches)
        train_step(model, opt, x)
        run.step()
        assert "called twice" in refused(run.step)
        next(batches)
        assert "run.step() was not called after global step 2" in refused(next, batches)
        break


def test_state_after_restore_and_a_model_not_set_up_are_refused(tmp_path):
    run = a_run(tmp_path, "state")
    model, opt, original = set_up(run)
    run.loader(Items(), batch_size=8)
    other = torch.nn.Linear(4, 2)
    assert "was not passed to run.setup" in refused(lambda: run.restore(model=other))
    assert "cannot be saved" in refused(lambda: run.restore(model=model, extra=object()))
    with open(os.devnull) as f:  # refused here, not at the first save (nor at the resume)
        message = refused(lambda: run.restore(model=model, extra={"n": [1, {"f": f}]}))
    assert "run.restore(extra=...): extra['n'][1]['f'] is a TextIOWrapper" in message, message
    message = refused(lambda: run.restore(model=model, extra={"a": np.zeros(2)}))
    assert "extra['a'] is a ndarray, which a checkpoint cannot hold" in message, message
    assert "before run.restore" in refused(lambda: next(iter(run.epochs(1))))
    assert not run.restore(model=original, optimizer=opt, counters={"seen": 0})
    assert "called twice" in refused(lambda: run.restore(model=model, optimizer=opt))
    assert "came after run.restore" in refused(lambda: run.setup(torch.nn.Linear(4, 2)))
    other_run = a_run(tmp_path, "reserved")
    message = refused(other_run.restore, model=set_up(other_run)[0], train={})
    assert "'train' is a name the checkpoint keeps" in message


def test_a_loader_after_restore_and_a_bad_batch_are_refused_naming_run_loaders_argument(tmp_path):
    run = a_run(tmp_path, "late")
    model, opt, _ = set_up(run)
    run.restore(model=model, optimizer=opt)
    message = refused(run.loader, Items(), 8)
    assert message.startswith("run.loader(...) came after run.restore") and "digest" in message
    # A script's batch is run.loader's argument (the one it passed), never the config's
    # train.batch_size.
    said = [
        refused(a_run(tmp_path, "zero").loader, Items(), 0),
        refused(a_run(tmp_path, "odd").loader, Items(), global_batch_size=8, accumulate=3),
        refused(a_run(tmp_path, "big").loader, Items(), 40, accumulate=2),
        refused(a_run(tmp_path, "gbig").loader, Items(), global_batch_size=128),
        refused(a_run(tmp_path, "both").loader, Items(), 8, global_batch_size=8),
        refused(a_run(tmp_path, "none").loader, Items()),
    ]
    assert said[0].startswith("run.loader(..., batch_size=0): must be an int >= 1"), said[0]
    assert said[1].startswith(
        "run.loader(..., global_batch_size=8) must be divisible by world size x accumulate = 3"
    ) and said[1].endswith("try run.loader(..., global_batch_size=6)"), said[1]
    assert said[2] == (
        "run.loader(..., batch_size=40) takes 80 samples a step (world size x accumulate = 1 x 2 "
        "batches of 40), more than the training set of the dataset holds (64 samples), so an "
        "epoch has no full step; lower batch_size to at most 32"
    ), said[2]
    assert (
        said[3].startswith(
            "run.loader(..., global_batch_size=128) is larger than the training set of the "
            "dataset (64 samples)"
        )
        and "lower global_batch_size to at most 64" in said[3]
    ), said[3]
    assert said[4].startswith("run.loader(dataset, ...) got both of batch_size and global_"), said
    assert said[5].startswith("run.loader(dataset, ...) got neither of batch_size and"), said
    assert not any("train." in m for m in said), said


def test_a_script_with_its_own_shuffled_loader_fails_with_one_line(tmp_path):
    script = tmp_path / "own_loader.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "import clusterflow\n"
        "run = clusterflow.start()\n"
        "model, opt = run.setup(torch.nn.Linear(2, 1), None), None\n"
        "run.loader(TensorDataset(torch.zeros(8, 2)), batch_size=4)\n"
        "run.restore(model=model)\n"
        "for epoch in run.epochs(1):\n"
        "    mine = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4, shuffle=True)\n"
        "    for (x,) in mine:\n"
        "        run.step()\n"
        "run.finish()\n"
    )
    d = str(tmp_path / "run")
    out = run_cli("clusterflow.run", "--script", str(script), f"run.dir={d}")
    assert out.returncode == 2, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: run.step(): no batch of run.loader came before this step"), last
    assert "Traceback" not in out.stderr
    status = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert status["state"] == "failed" and "a DataLoader of your own" in status["error"], status


def test_import_clusterflow_stays_light_until_start_is_asked_for():
    code = (
        "import sys, clusterflow\n"
        "assert 'torch' not in sys.modules, 'import clusterflow loaded torch'\n"
        "assert callable(clusterflow.start) and 'torch' in sys.modules\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr


# -- submit --script / run --script: the script's own arguments -----------------------------------

ARGV_SCRIPT = """
import json, sys
import torch
import clusterflow
run = clusterflow.start()
with open(sys.argv[0] + ".argv.json", "w") as f:
    json.dump(sys.argv[1:], f)
model = run.setup(torch.nn.Linear(2, 1))
loader = run.loader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
run.restore(model=model)
for epoch in run.epochs(1):
    for (x,) in loader:
        run.step()
run.finish()
"""


def test_a_completed_run_launched_again_trains_nothing_and_says_how_to_train_on(tmp_path):
    script = tmp_path / "argv.py"
    script.write_text(ARGV_SCRIPT)
    d = str(tmp_path / "run")
    launch_it = ("--script", str(script), f"run.dir={d}", "--", "--lr", "0.1")
    assert run_cli("clusterflow.run", *launch_it).returncode == 0
    attempts = open(os.path.join(d, "attempts.jsonl")).read()
    for command in ("clusterflow.run", "clusterflow.submit"):
        local = ("--local",) if command == "clusterflow.submit" else ()
        out = run_cli(command, *local, *launch_it)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.strip().splitlines()[-1] == (
            f"run dir {d} already completed at step 2: nothing to train; to train on, launch it "
            "with more epochs or steps (the script's arguments, or train.epochs, may change on a "
            "completed run: docs/own-loop.md#a-completed-run)"
        ), out.stdout
        assert open(os.path.join(d, "attempts.jsonl")).read() == attempts, command
    # Other arguments train on (here: nothing more to train, the script's one epoch is done).
    out = run_cli("clusterflow.run", *launch_it[:-2], "--lr", "0.2")
    assert out.returncode == 0, out.stderr
    said = 'completed at step 2 and trains on: script.args ["--lr", "0.1"] -> ["--lr", "0.2"]'
    assert said in out.stderr, out.stderr
    assert json.loads(run_cli("clusterflow.status", d, "--json").stdout)["attempts"] == 2


def test_the_scripts_own_arguments_reach_it_untouched(tmp_path):
    script = tmp_path / "argv.py"
    script.write_text(ARGV_SCRIPT)
    args = ["--lr", "0.1", "--", "x=1,2", "with space", "--name=é'\"", "-v", "run.dir=not-ours"]
    d = str(tmp_path / "run")
    out = run_cli("clusterflow.run", "--script", str(script), f"run.dir={d}", "--", *args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.load(open(str(script) + ".argv.json")) == args
    status = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert status["state"] == "completed" and status["script"]["args"] == args, status


def test_a_sweep_of_a_scripts_argument_sets_it_in_each_member(tmp_path):
    from clusterflow.sweeps import sweep

    script = tmp_path / "train.py"
    script.write_text("")
    sw = sweep.expand(
        None,
        [f"run.dir={tmp_path / 'sweep'}"],
        ["arg:--lr=0.1,0.3", "arg:depth=2,4"],
        str(script),
        ["--lr=0.01", "--epochs", "3", "depth=1"],
    )
    got = {m.name.rsplit("-", 1)[0]: m.config.script.args for m in sw.members}
    assert got == {
        "lr=0.1,depth=2": ["--lr=0.1", "--epochs", "3", "depth=2"],
        "lr=0.1,depth=4": ["--lr=0.1", "--epochs", "3", "depth=4"],
        "lr=0.3,depth=2": ["--lr=0.3", "--epochs", "3", "depth=2"],
        "lr=0.3,depth=4": ["--lr=0.3", "--epochs", "3", "depth=4"],
    }
    assert sweep.with_arg(["--lr", "1", "--x"], "--lr", "2") == ["--lr", "2", "--x"]
    assert sweep.with_arg(["--x"], "--lr", "2") == ["--x", "--lr", "2"]
    assert sweep.with_arg([], "lr", "2") == ["lr=2"]
    with pytest.raises(UserError, match="give the script with --script"):
        sweep.expand(None, [f"run.dir={tmp_path / 's2'}"], ["arg:--lr=1,2"])


def test_the_converted_script_trains_sharded_with_fsdp(tmp_path):
    """train.parallel=fsdp: run.setup shards the model, the optimizer follows its parameters into
    the shards, checkpoints are sharded (DCP) and model.pt is the whole plain state_dict."""
    d = str(tmp_path / "run")
    config = (*CONFIG, "train.parallel=fsdp")
    assert launch.wait(start(2, d, config=config)) == [0, 0], rank0_log(d)[-3000:]
    store = CheckpointStore(os.path.join(d, "checkpoints"))
    assert store.newest_manifest()["format"] == "dcp"
    state = torch.load(os.path.join(d, "model.pt"), weights_only=True)
    plain = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    plain.load_state_dict(state)  # every key, every shape
    assert json.loads(run_cli("clusterflow.status", d, "--json").stdout)["global_step"] == 18


# Each example at toy size on 2 ranks, with the batch flags it documents, and the samples one
# optimizer step trains on all ranks as its flags say: ddp_classifier's --batch is per rank (as
# DataLoader's), pretrain's --global-batch is the whole step's (--accum micro-batches).
EXAMPLES = {
    "ddp_classifier.py": (["--epochs", "1", "--width", "8", "--batch", "24"], 24 * 2, 1437),
    "pretrain.py": (  # a stream: 4 steps of 64 sequences
        ["--steps", "4", "--seq-len", "16", "--d-model", "16", "--layers", "1"]
        + ["--global-batch", "64", "--accum", "2", "--warmup", "2"],
        64,
        4 * 64,
    ),
}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_example_trains_the_batch_its_flags_say(tmp_path, example):
    args, per_step, samples = EXAMPLES[example]
    d = str(tmp_path / "run")
    command = [sys.executable, "-m", "clusterflow.run", "--script"]
    command += [os.path.join(REPO, "examples", example), f"run.dir={d}", "--", *args]
    assert launch.wait(launch.start(2, None, None, d + "-logs", command=command)) == [0, 0], (
        rank0_log(d)[-3000:]
    )
    status = json.loads(run_cli("clusterflow.status", d, "--json").stdout)
    assert status["state"] == "completed" and status["epoch"] == 1, status
    assert status["global_step"] == samples // per_step, (status["global_step"], per_step)
    (epoch,) = json.load(open(os.path.join(d, "sample_ledger.json")))["epochs"]
    assert [(r["start"], r["end"], r["world_size"], r["batch_size"]) for r in epoch["ranges"]] == [
        (0, samples, 2, per_step)
    ]


def test_a_batch_the_world_does_not_divide_names_the_scripts_argument(tmp_path):
    script = os.path.join(REPO, "examples", "pretrain.py")
    args = ["--steps", "2", "--global-batch", "63", "--accum", "2"]
    out = run_cli("clusterflow.run", "--script", script, f"run.dir={tmp_path / 'r'}", "--", *args)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: run.loader(..., global_batch_size=63) must be divisible by world size x "
        "accumulate = 2"
    ), last
    assert last.endswith("try run.loader(..., global_batch_size=62)") and "train." not in last
