"""The checkpointer's save and restore protocol on real files and real gloo ranks: a failed
background write is reported and retried, a failed synchronous one fails every rank, and a
restore reads the checkpoint on rank 0 only while every rank gets the state and its own RNG."""

import json
import os
import random
import time

import numpy as np
import pytest
import torch
from multirank import SharedRanks

from clusterflow import config, rundir
from clusterflow.checkpoint.checkpointer import STEP, Checkpointer, CheckpointWriteError
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.distributed import comm as dist
from clusterflow.observe.context import JobContext


def build(run_dir, ckpt_dir="", seed=0, **over):
    cfg = config.load(
        None,
        [
            f"run.dir={run_dir}",
            f"checkpoint.dir={ckpt_dir}",
            "checkpoint.every_steps=1",
            f"cluster.tasks_per_node={dist.world()}",
            "train.batch_size=96",
            *[f"{k}={v}" for k, v in over.items()],
        ],
    )
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    progress = TrainState()
    return (
        Checkpointer(
            JobContext(cfg, rundir.RunPaths(cfg.run.dir)),
            model,
            {"optimizer": opt},
            progress,
            steps_per_epoch=100,
        ),
        model,
        opt,
        progress,
    )


def train_step(model, opt, progress):
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    progress.step_done()


def status(run_dir):
    return json.load(open(os.path.join(run_dir, "status.json")))


def test_a_failed_background_write_is_reported_and_the_next_save_retries_it(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint folder should be")
    ck, model, opt, progress = build(run_dir, str(blocker / "ck"))
    train_step(model, opt, progress)
    ck.save(
        STEP
    )  # returns at once; the write fails on the background thread, which reports it at once
    deadline = time.time() + 60
    while not (
        os.path.exists(os.path.join(run_dir, "status.json"))
        and status(run_dir).get("checkpoint_error")
    ):
        assert time.time() < deadline, "the failed background write never reached status.json"
        time.sleep(0.05)
    assert status(run_dir)["checkpoint_error"].startswith(
        f"checkpoint step 1 could not be written to {blocker}/ck: "
    )
    assert (
        "checkpoint step 1 could not be written" in caplog.text
        and "the next save is written synchronously" in caplog.text
    )
    blocker.unlink()  # the cause goes away (space freed, permission fixed)
    train_step(model, opt, progress)
    ck.save(STEP)  # the retry: written synchronously, so it is committed when save returns
    assert (
        "writing checkpoint step 2 synchronously: the background write before it failed"
        in caplog.text
    )
    assert ck.store.steps() == [2] and status(run_dir)["checkpoint_error"] is None
    train_step(model, opt, progress)
    ck.save(STEP)  # and then in the background again
    ck.finish()
    assert ck.store.steps() == [2, 3]
    ck.close()


def _failing_saves(root, background):
    run_dir = os.path.join(root, "run")
    if dist.rank() == 0:
        open(os.path.join(root, "blocker"), "w").close()
    ck, model, opt, progress = build(
        run_dir, os.path.join(root, "blocker", "ck"), **{"checkpoint.async": background}
    )
    messages = []
    for _ in range(3):
        train_step(model, opt, progress)
        try:
            ck.save(STEP)
        except CheckpointWriteError as exc:
            messages.append((progress.global_step, str(exc)))
            break
    ck.close()
    return messages


def test_a_failed_synchronous_write_fails_every_rank_and_a_background_one_is_retried_first(
    ranks,
):
    """No rank waits forever for rank 0: the outcome of a synchronous write is broadcast."""
    for background, failing_step in ((False, 1), (True, 2)):
        results = ranks["failing saves", background]
        for messages in results:
            assert len(messages) == 1, results
            step, message = messages[0]
            assert (
                step == failing_step
                and f"checkpoint step {failing_step} could not be written to" in message
            )


def _save_then_restore(root):
    from clusterflow.storage import durable

    reads = []
    plain = durable.load_checked
    durable.load_checked = lambda name, *a, **k: reads.append(name) or plain(name, *a, **k)
    run_dir = os.path.join(root, "run")
    ck, model, opt, progress = build(run_dir)
    for _ in range(2):
        train_step(model, opt, progress)
    random.seed(dist.rank())
    np.random.seed(dist.rank())
    torch.manual_seed(100 + dist.rank())
    ck.save(STEP)  # every rank's RNG state goes into the checkpoint here
    expected = (torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ck.finish()
    ck.close()
    torch.manual_seed(7)  # a fresh attempt: other weights, other random streams
    ck2, model2, _, progress2 = build(run_dir, seed=1)
    assert ck2.restore()
    got = (torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random())
    weights = {k: v for k, v in model2.state_dict().items()}
    same = all(torch.equal(weights[k], saved[k]) for k in saved) if dist.rank() == 0 else None
    return (
        reads,
        got == expected,
        progress2.global_step,
        {k: v.tolist() for k, v in weights.items()},
        same,
        len(ck2.states["optimizer"].state),
    )


def test_restore_reads_the_checkpoint_on_rank_0_only_and_every_rank_gets_the_state_and_its_own_rng(
    ranks,
):
    results = ranks["save then restore"]
    reads = [r[0] for r in results]
    assert reads[0] == ["model.pt", "train_state.pt"] and reads[1] == [] and reads[2] == []
    for _, rng_exact, step, weights, _, opt_states in results:
        assert (
            rng_exact and step == 2 and opt_states == 4
        )  # Linear and BatchNorm weights and biases
        assert weights == results[0][3]  # every rank holds rank 0's checkpoint
    assert results[0][4]  # ... which is bitwise the state rank 0 saved


def _tensors_of_every_kind():
    torch.manual_seed(5)
    return {
        "f": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "i": torch.arange(11),
        "b": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "t": torch.randn(4, 6).t(),
        "nested": [{"x": torch.randn(300)}, ("keep", 3)],
    }


def _broadcast(bucket):
    dist._BUCKET = bucket  # tiny buckets: many of them, tensors spanning the edges
    got = dist.broadcast_state(_tensors_of_every_kind() if dist.rank() == 0 else None)
    want = _tensors_of_every_kind()
    flat_got, flat_want = (
        [got[k] for k in ["f", "bf16", "i", "b", "scalar", "empty", "t"]],
        [want[k] for k in ["f", "bf16", "i", "b", "scalar", "empty", "t"]],
    )
    ok = all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for a, b in zip(flat_got, flat_want)
    )
    return (
        ok
        and torch.equal(got["nested"][0]["x"], want["nested"][0]["x"])
        and got["nested"][1] == ("keep", 3)
    )


def test_broadcast_state_sends_every_dtype_and_shape_exactly(ranks):
    assert ranks["broadcast", 3] == [True, True, True]
    assert ranks["broadcast", 2] == [True, True]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The gloo calls of this module with one spawn per world size. Order matters: the restore
    call counts the checkpoint reads it patches in, and the broadcasts set the bucket size of
    their processes, so each comes before what it would change."""
    calls = {}
    for background in (False, True):
        root = str(tmp_path_factory.mktemp(f"failing-{background}"))
        calls["failing saves", background] = (2, _failing_saves, (root, background))
    root = str(tmp_path_factory.mktemp("save-then-restore"))
    calls["save then restore"] = (3, _save_then_restore, (root,))
    calls["broadcast", 3] = (3, _broadcast, (64,))
    calls["broadcast", 2] = (2, _broadcast, (64 << 20,))
    return SharedRanks(calls)


def test_keep_best_resumes_with_the_metric_of_the_step_it_resumed_from(tmp_path):
    """The newest step is damaged, so the run resumes from the one before: the keep_best metric
    carried into the next checkpoints is that step's, not the one the damaged step logged."""
    run_dir = str(tmp_path / "run")
    over = {"checkpoint.keep_best": "eval/acc:max", "checkpoint.async": "false"}
    ck, model, opt, progress = build(run_dir, **over)
    for acc in (0.5, 0.9):
        train_step(model, opt, progress)
        ck.note({"eval/acc": acc})
        ck.save(STEP)
    ck.close()
    weights = os.path.join(run_dir, "checkpoints", "step-2", "model.pt")
    data = bytearray(open(weights, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(weights, "wb").write(bytes(data))
    ck, model, opt, progress = build(run_dir, **over)
    assert ck.restore() and progress.global_step == 1
    assert ck.metrics == {"eval/acc": 0.5}
    ck.close()
