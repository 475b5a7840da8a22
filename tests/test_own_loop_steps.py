"""A loop without a loader (``run.steps(max_steps)``) and a script's own seeding, on real processes:
tests/ownloop/plain_gpt.py, a pretraining script in nanoGPT's style (random windows drawn with
torch.randint, its own seed per rank, its own gradient accumulation, a prefetch of the next
batch, an evaluation on rank 0, dropout), converted to converted_gpt.py in a few lines. On two
ranks and on one: the converted script logs the loss of the original at every iteration and ends
with its weights (the script's seeds kept); SIGKILL at a random step and a resume end bitwise
equal to the uninterrupted run, the losses after the resume its losses, with status, the ledger
and goodput in steps; the completed run launched again trains nothing (exit 0, no attempt), and
launched with more steps trains on, bitwise equal to a run that trained that long at once. In one
process each: the seeding rules in every order, the refusals of a loop without a loader."""

import difflib
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import launch
import pytest
import torch
from conftest import REPO, run_cli, weights_equal
from test_own_loop import a_run, refused, restored_step, set_up

from clusterflow import rundir
from clusterflow.config import load
from clusterflow.observe.context import JobContext
from clusterflow.rundir import timeline
from clusterflow.storage.store import CheckpointStore
from clusterflow.train.preemption import Preemption
from clusterflow.train.session import Run, RunInternals

HERE = os.path.join(REPO, "tests", "ownloop")
PLAIN, CONVERTED = os.path.join(HERE, "plain_gpt.py"), os.path.join(HERE, "converted_gpt.py")
STEPS = 24
# Saves every 5 steps (in the background): a kill loses the steps since the last one.
CONFIG = ("checkpoint.every_steps=5", "train.log_every_steps=4", "dist.heartbeat_s=1")


def converted(world, run_dir, args=(), env=None):
    """``world`` ranks of the converted script, as torchrun starts ``python -m clusterflow.run
    --script converted_gpt.py ...``."""
    command = [
        sys.executable,
        "-m",
        "clusterflow.run",
        "--script",
        CONVERTED,
        f"run.dir={run_dir}",
        *CONFIG,
        "--",
        *args,
    ]
    os.makedirs(run_dir + "-hold", exist_ok=True)
    env = {"HOLD_DIR": run_dir + "-hold", **(env or {})}
    return launch.start(world, None, None, run_dir + "-logs", command=command, env=env)


def plain(world, out_dir):
    """``world`` ranks of the original script, as torchrun starts it."""
    command = [sys.executable, PLAIN, "--out-dir", out_dir]
    return launch.start(world, None, None, out_dir + "-logs", command=command)


def losses(log_dir):
    """What rank 0 printed: [(iteration, loss), ...] in the order printed, over every launch.
    The loss has six decimals; a log line of clusterflow's background write may follow it before
    its newline (stdout and stderr share the file)."""
    files = sorted(glob.glob(os.path.join(log_dir, "launch-rank0-*.txt")), key=os.path.getmtime)
    text = "".join(open(f).read() for f in files)
    found = re.findall(r"^iter (\d+): loss (-?\d+\.\d{6}|nan|-?inf)", text, re.MULTILINE)
    return [(int(i), v) for i, v in found]


def printed(log_dir):
    return "".join(open(f).read() for f in glob.glob(os.path.join(log_dir, "launch-rank*.txt")))


def final_state(run_dir):
    store = CheckpointStore(os.path.join(run_dir, "checkpoints"))
    return torch.load(
        os.path.join(store.step_path(max(store.steps())), "train_state.pt"), weights_only=True
    )


def status(run_dir):
    return json.loads(run_cli("clusterflow.status", run_dir, "--json").stdout)


def both(world, tmp_path_factory, name):
    """The original and the converted script on ``world`` ranks, side by side."""
    base = tmp_path_factory.mktemp(name)
    ref, run_dir = str(base / "plain"), str(base / "run")
    procs = plain(world, ref), converted(world, run_dir)
    codes = [launch.wait(p) for p in procs]
    assert codes == [[0] * world] * 2, (
        codes,
        printed(ref + "-logs")[-2000:],
        printed(run_dir + "-logs")[-3000:],
    )
    return ref, run_dir


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return both(2, tmp_path_factory, "gpt2")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return both(1, tmp_path_factory, "gpt1")


def test_the_conversion_changes_a_few_lines_and_the_docs_show_its_diff():
    diff = list(
        difflib.unified_diff(
            open(PLAIN).read().splitlines(),
            open(CONVERTED).read().splitlines(),
            "plain_gpt.py",
            "converted_gpt.py",
            n=1,
            lineterm="",
        )
    )
    added = [line for line in diff[2:] if line.startswith("+")]
    removed = [line for line in diff[2:] if line.startswith("-")]
    print(f"\nconverted_gpt.py: {len(added)} lines added or changed, {len(removed)} removed")
    assert 0 < len(added) <= 15 and len(removed) <= 20, "\n".join(diff)
    assert any("run.steps(args.max_iters)" in line for line in added)
    page = open(os.path.join(REPO, "docs", "own-loop.md")).read()
    shown = page.split("```diff\n")[2].split("```", 1)[0].rstrip("\n").splitlines()
    assert shown == diff, "docs/own-loop.md's diff of the pretraining script is stale"
    assert f"**{len(added)} lines added or changed, {len(removed)} removed**" in page


def assert_same_as_the_original(ref, run_dir):
    mine, original = losses(run_dir + "-logs"), losses(ref + "-logs")
    assert [i for i, _ in original] == list(range(STEPS)), original
    assert mine == original
    assert weights_equal(os.path.join(run_dir, "model.pt"), os.path.join(ref, "model.pt"))


def test_converted_logs_the_originals_loss_at_every_iteration_on_two_ranks(two_ranks):
    assert_same_as_the_original(*two_ranks)


def test_converted_logs_the_originals_loss_at_every_iteration_on_one_rank(one_rank):
    assert_same_as_the_original(*one_rank)


def kill_and_resume(world, reference, tmp_path):
    """SIGKILL of every rank at a random step (before its run.step), then the same command: bitwise
    equal to the uninterrupted ``reference``; its steps in status, the ledger and goodput."""
    k = random.choice([s for s in range(6, STEPS) if s % 5])
    print(f"\nSIGKILL of {world} rank(s) at step {k}")
    d = str(tmp_path / "run")
    procs = converted(world, d, env={"HOLD_AT_STEP": str(k)})
    launch.wait_for_file(os.path.join(d + "-hold", "held"), procs)
    launch.kill(procs)
    assert launch.wait(procs) == [-signal.SIGKILL] * world
    # The newest save committed before the kill (one still written in the background is lost,
    # as a kill loses it): where the resume must start.
    saved = CheckpointStore(os.path.join(d, "checkpoints")).steps()
    assert launch.wait(converted(world, d)) == [0] * world, printed(d + "-logs")[-3000:]

    resumed = restored_step(d, 1)
    assert resumed == max(saved, default=0) and resumed % 5 == 0 and resumed < k, (resumed, k)
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(reference, "model.pt"))
    mine, ref = final_state(d), final_state(reference)
    moments = [s["exp_avg_sq"] for s in mine["optimizer"]["state"].values()]
    expected = [s["exp_avg_sq"] for s in ref["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, expected, strict=True))
    # Every rank's random streams at the end: the ones of the run that never stopped.
    for a, b in zip(mine["rng"], ref["rng"], strict=True):
        assert torch.equal(a["torch"], b["torch"])
    # The losses the resumed attempt logged are the uninterrupted run's from the step resumed.
    logged = losses(d + "-logs")
    assert logged[k:] == losses(reference + "-logs")[resumed:], (k, resumed)

    s = status(d)
    assert (s["state"], s["attempts"], s["global_step"], s["max_steps"]) == (
        "completed",
        2,
        STEPS,
        STEPS,
    ), s
    assert s["steps_left"] == 0 and s["samples"]["epochs"] == [], s
    assert [
        (r["start"], r["end"], r["attempt"], r["world_size"]) for r in s["samples"]["steps"]
    ] == [
        (0, resumed, 0, world),
        (resumed, STEPS, 1, world),
    ]
    text = run_cli("clusterflow.status", d).stdout
    assert f"progress     step {STEPS} of {STEPS}" in text and "epoch" not in text, text
    assert f"steps        {STEPS} trained: 1-{resumed} attempt 0 on {world} rank(s), " in text
    assert "samples" not in text.replace("samples/s", ""), text
    log = open(os.path.join(d, "logs", "rank0.attempt1.log")).read()
    assert f"step {STEPS}/{STEPS} loss " in log and "steps/s" in log, log[-2000:]
    book = json.loads(run_cli("clusterflow.goodput", d, "--json").stdout)
    again = book["attempts"][1]["steps"]
    assert again["restored"] == resumed and again["last"] == STEPS, again


@pytest.mark.slow
def test_sigkill_and_resume_on_two_ranks_is_bitwise_the_uninterrupted_run(two_ranks, tmp_path):
    kill_and_resume(2, two_ranks[1], tmp_path)


@pytest.mark.slow
def test_sigkill_and_resume_on_one_rank_is_bitwise_the_uninterrupted_run(one_rank, tmp_path):
    kill_and_resume(1, one_rank[1], tmp_path)


def nothing_more(world, run_dir):
    """The completed ``run_dir`` launched again as it was: one line, exit 0, nothing recorded."""
    before = {p: open(p, "rb").read() for p in glob.glob(os.path.join(run_dir, "*.json*"))}
    logs = sorted(os.listdir(os.path.join(run_dir, "logs")))
    procs = converted(world, run_dir)
    assert launch.wait(procs) == [0] * world
    said = printed(run_dir + "-logs")
    assert f"already completed at step {STEPS}: nothing to train; to train on" in said, said
    after = {p: open(p, "rb").read() for p in glob.glob(os.path.join(run_dir, "*.json*"))}
    assert after == before, "a launch that trains nothing writes nothing"
    assert sorted(os.listdir(os.path.join(run_dir, "logs"))) == logs


def test_a_completed_run_launched_again_trains_nothing_on_two_ranks(two_ranks):
    nothing_more(2, two_ranks[1])


def test_a_completed_run_launched_again_trains_nothing_on_one_rank(one_rank):
    nothing_more(1, one_rank[1])


@pytest.mark.slow
def test_a_completed_run_launched_with_more_steps_trains_on(one_rank, tmp_path):
    # A copy of the completed run (a run dir may be moved or copied), trained on to 30 steps,
    # beside a run of 30 steps at once.
    d, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    shutil.copytree(one_rank[1], d)
    more = ("--max-iters", "30")
    procs = converted(1, d, args=more), converted(1, ref, args=more)
    assert [launch.wait(p) for p in procs] == [[0], [0]], printed(d + "-logs")[-3000:]
    said = 'completed at step 24 and trains on: script.args [] -> ["--max-iters", "30"]'
    assert said in printed(d + "-logs"), printed(d + "-logs")[-3000:]
    assert weights_equal(os.path.join(d, "model.pt"), os.path.join(ref, "model.pt"))
    assert losses(d + "-logs") == losses(ref + "-logs")[STEPS:]
    s = status(d)
    assert (s["state"], s["global_step"], s["max_steps"], s["attempts"]) == (
        "completed",
        30,
        30,
        2,
    )
    assert [(r["start"], r["end"]) for r in s["samples"]["steps"]] == [(0, 24), (24, 30)]


# -- the script's own seeds, in one process each -------------------------------------------------

SEEDS = """
import random, sys
import clusterflow
import numpy as np, torch
from clusterflow.checkpoint.rng import rank_seed
from clusterflow.train.seeds import GlobalSeeds

order = sys.argv[1]
SEEDED = (11, 12, 13)  # the script's own seeds of torch, numpy, python

def seed(which):
    for gen, on, value in zip(("torch", "numpy", "python"), which, SEEDED):
        if on:
            {"torch": torch.manual_seed, "numpy": np.random.seed, "python": random.seed}[gen](value)

def draws():
    return [torch.rand(1).item(), float(np.random.rand()), random.random()]

# Which generators the script seeds (torch, numpy, python), before start() or after it.
before = {"before": (1, 1, 1)}.get(order, (0, 0, 0))
between = {"between": (1, 1, 1), "task": (1, 1, 1), "nanogpt": (1, 0, 0)}.get(order, (0, 0, 0))
seeds = GlobalSeeds(3, script=order != "task")
seed(before)
seeds.at_start()
if order == "none":
    assert torch.initial_seed() == 3 + 2**32, torch.initial_seed()
seed(between)
if order == "drawn":
    np.random.rand()  # numpy used (its run.seed stream), not seeded
torch.nn.Linear(4, 4)  # a model built before run.setup draws from torch's stream
seeds.at_setup(1)
got = draws()

# What each generator should give now: the script's stream where it seeded (or drew from) it,
# else this rank's stream of run.seed.
kept = [b or w for b, w in zip(before, between)]
if order == "task":
    kept = [0, 0, 0]
mine = rank_seed(3, 1)
torch.manual_seed(SEEDED[0] if kept[0] else mine)
if kept[0]:
    torch.nn.Linear(4, 4)
np.random.seed(SEEDED[1] if kept[1] else mine)
random.seed(SEEDED[2] if kept[2] else mine)
if order == "drawn":
    np.random.seed(3)
    np.random.rand()
want = draws()
assert got == want, (order, got, want)
print("ok", order)
"""


@pytest.mark.parametrize("order", ["none", "before", "between", "nanogpt", "drawn", "task"])
def test_a_scripts_own_seeds_are_kept_in_either_order_and_the_others_get_per_rank_streams(order):
    out = subprocess.run(
        [sys.executable, "-c", SEEDS, order], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert out.returncode == 0 and f"ok {order}" in out.stdout, out.stderr[-3000:]


def test_a_seed_after_run_restore_does_not_move_the_resumed_streams(tmp_path):
    """A script that seeds after run.restore: its resume continues the streams of the step it
    resumed at, as if it had never stopped."""
    drawn = {}
    for attempt in (0, 1):
        cfg = load(
            None, [f"run.dir={tmp_path}", "script.path=train.py", "checkpoint.every_steps=2"]
        )
        paths, cpu = rundir.RunPaths(cfg.run.dir), torch.device("cpu")
        run = Run(JobContext(cfg, paths, attempt), cpu, Preemption(), lambda outcome: (outcome, 0))
        model, opt, _ = set_up(run)
        resumed = run.restore(model=model, optimizer=opt)
        assert resumed == bool(attempt)
        torch.manual_seed(99)  # after run.restore: every attempt does it
        for step in run.steps(4):
            drawn.setdefault(step, []).append(torch.rand(1).item())
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            run.step()
            if attempt == 0 and step == 2:
                break  # the first attempt ends after step 3, its checkpoint of step 2 kept
        RunInternals(run).wait_for_write()
    assert [len(drawn[s]) for s in range(4)] == [1, 1, 2, 1]
    assert drawn[2][0] == drawn[2][1]


# -- a loop without a loader, in one process -----------------------------------------------------


def test_a_loop_without_a_loader_refuses_what_it_cannot_count(tmp_path):
    run = a_run(tmp_path, "counted")
    model, opt, _ = set_up(run)
    run.restore(model=model, optimizer=opt)
    assert "run.steps(0): give the optimizer steps of the whole run" in refused(run.steps, 0)
    loop = run.steps(3)
    assert next(loop) == 0
    with pytest.raises(Exception) as e:
        run.accumulate(model)
    assert "last=micro == accumulation_steps - 1" in str(e.value)
    with run.accumulate(model, last=True):
        model(torch.ones(2, 4)).sum().backward()
    opt.step()
    run.step()
    assert next(loop) == 1 and run.global_step == 1
    message = refused(next, loop)  # no run.step in iteration 1
    assert message.startswith("run.step() was not called in step 2 of run.steps(max_steps)"), (
        message
    )
    assert "run.mine(...) came inside run.steps" in refused(run.mine, lambda b: b)


def test_a_loop_without_a_loader_after_run_loader_is_refused_naming_the_loader_form(tmp_path):
    from test_own_loop import Items

    run = a_run(tmp_path, "both")
    model, opt, _ = set_up(run)
    loader = run.loader(Items(), batch_size=8)
    run.restore(model=model, optimizer=opt)
    message = refused(run.steps, 5)
    assert "run.steps(5) came with a run.loader made" in message
    assert "run.steps(loader, 5)" in message
    for _ in run.epochs(1):
        with pytest.raises(Exception) as e:
            run.accumulate(model, last=True)
        assert "run.loader(..., accumulate=k) counts the micro-batches" in str(e.value)
        break
    del loader


def test_the_timeline_records_a_loop_without_a_loader(one_rank):
    records = timeline.read_all(rundir.RunPaths(one_rank[1])).records
    assert records[0]["last_step"] == STEPS


@pytest.mark.slow
def test_the_dashboard_says_steps_for_a_loop_without_a_loader(one_rank):
    from dashboards import browser, close_browser, get, poll_until, served
    from test_dashboard_browser import texts, until

    with served([os.path.dirname(one_rank[1])]) as s:
        assert poll_until(s.catalog, lambda: len(s.catalog.runs) == 1)
        (run_id,) = s.catalog.runs
        code, body, _ = get(f"{s.url}/api/run/{run_id}?token={s.token}")
        assert code == 200, body
        run = json.loads(body)
        assert (run["max_steps"], run["global_step"]) == (STEPS, STEPS), run
        assert run["samples"]["steps"] == [
            {"start": 0, "end": STEPS, "attempt": 0, "world_size": 1}
        ]
        driver = browser()
        try:
            driver.get(f"{s.url}/?token={s.token}")
            until("the run's row", lambda: f"step {STEPS}/{STEPS}" in driver.page_source)
            driver.get(f"{s.url}/run/{run_id}?token={s.token}")
            card = until("the progress card", lambda: texts(driver, "#card-progress .v"))
            assert card == [f"step {STEPS}/{STEPS} (100%)"], card
            shown = "return !document.getElementById('samples-section').hidden"
            until(
                "the chart of the steps each attempt trained", lambda: driver.execute_script(shown)
            )
        finally:
            close_browser(driver)
