"""The sampler's plan of an epoch: every sample once, in global batches that do not depend on the
world size, split over ranks so that none is empty, resumable from any batch boundary on any
world size or batch size; the loss weights of uneven slices; the ledger and its check on resume."""

import itertools

import numpy as np
import pytest

from clusterflow import config as cfgmod
from clusterflow.checkpoint.data_identity import DataIdentity, Position, identify, judge_resume
from clusterflow.checkpoint.train_state import SampleLedger, TrainState
from clusterflow.distributed.sampler import EpochPlan, GlobalBatchSampler, share
from clusterflow.errors import UserError


@pytest.mark.parametrize("n,batch", [(192, 32), (206, 48), (69, 12), (12, 12), (50, 7)])
def test_an_epoch_is_n_div_batch_batches_the_last_taking_what_is_left(n, batch):
    plan = EpochPlan.of(n, batch)
    sizes = [size for _, size in plan.batches_from(0)]
    assert len(sizes) == n // batch == plan.steps() and sum(sizes) == n
    assert sizes[:-1] == [batch] * (len(sizes) - 1) and sizes[-1] == batch + n % batch


def _epoch(n, batch, world, accum, position=0, plan=None, epoch=1):
    """Every rank's micro-batches of one epoch from ``position``: [step][micro][rank]."""
    ranks = []
    for rank in range(world):
        s = GlobalBatchSampler(n, batch, rank, world, 5, grad_accum=accum)
        s.set_epoch(epoch, position, plan)
        ranks.append(list(s))
    steps = len(ranks[0]) // accum
    assert all(len(r) == steps * accum for r in ranks)
    return [
        [[ranks[r][st * accum + m] for r in range(world)] for m in range(accum)]
        for st in range(steps)
    ]


@pytest.mark.parametrize("n,batch", [(206, 48), (69, 12), (100, 24)])
def test_every_world_size_trains_the_same_global_batches_every_sample_once(n, batch):
    reference = None
    for world, accum in itertools.product((1, 2, 3), (1, 2)):
        if batch % (world * accum):
            continue
        steps = _epoch(n, batch, world, accum)
        flat = [i for step in steps for micro in step for part in micro for i in part]
        assert sorted(flat) == list(range(n))
        assert all(part for step in steps for micro in step for part in micro)  # none empty
        globals_ = [sorted(i for micro in step for part in micro for i in part) for step in steps]
        reference = reference or globals_
        assert globals_ == reference, (world, accum)


def test_a_resume_at_any_boundary_on_any_world_size_continues_the_order():
    n, batch = 206, 48
    whole = [i for step in _epoch(n, batch, 2, 1) for m in step for p in m for i in p]
    for position in EpochPlan.of(n, batch).boundaries():
        for world in (1, 3):
            rest = [
                i
                for step in _epoch(n, batch, world, 1, position)
                for m in step
                for p in m
                for i in p
            ]
            assert sorted(rest) == sorted(whole[position:]), (position, world)
    with pytest.raises(ValueError, match="not where a batch"):
        GlobalBatchSampler(n, batch, 0, 1, 5).set_epoch(0, 7)


def test_another_batch_size_starts_a_segment_where_the_run_is():
    n = 206
    plan = EpochPlan.of(n, 48)
    at = plan.boundaries()[2]  # 96
    new = plan.with_batch(at, 24)
    assert new.segments == ((0, 48), (96, 24)) and new.boundaries()[:3] == plan.boundaries()[:3]
    assert [s for _, s in new.batches_from(at)] == [24] * 3 + [24 + (n - at) % 24]
    rest = [i for step in _epoch(n, 24, 3, 1, at, new) for m in step for p in m for i in p]
    before = [i for step in _epoch(n, 48, 2, 1)[:2] for m in step for p in m for i in p]
    assert sorted(before + rest) == list(range(n))
    # Saved and read back (a checkpoint's plan) it is the same plan.
    assert EpochPlan.of(n, 24, new.as_list()) == new
    # Fewer samples left than the new batch: the epoch ends with its planned batches.
    last = plan.boundaries()[-2]
    assert plan.with_batch(last, 64) is plan


def test_a_batch_smaller_than_world_times_accum_is_refused_with_the_fix():
    plan = EpochPlan.of(50, 2)
    with pytest.raises(UserError, match="fewer than world size x grad_accum = 3 x 1"):
        GlobalBatchSampler(50, 3, 0, 3, 5).set_epoch(0, 0, plan)


def test_weights_make_the_mean_over_the_step_whatever_the_split():
    """Per-rank means weighted by ``share``, averaged over ranks and micro-batches as DDP does,
    are the mean over the step's samples; unweighted, they are not."""
    rng = np.random.default_rng(0)
    values = rng.normal(size=206)
    for world, accum in ((3, 1), (2, 2), (3, 2)):
        for step in _epoch(206, 48 if (48 % (world * accum) == 0) else 24, world, accum):
            size = sum(len(p) for m in step for p in m)
            weighted = (
                sum(
                    share(len(p), world, accum, size) * values[p].mean() / accum
                    for m in step
                    for p in m
                )
                / world
            )
            assert weighted == pytest.approx(values[[i for m in step for p in m for i in p]].mean())
    assert share(16, 3, 1, 48) == 1.0


def test_the_ledger_keeps_one_range_per_attempt_world_and_batch():
    ledger, data = SampleLedger(), DataIdentity(206, "ab" * 32)
    for start, end, attempt, world in ((0, 52, 0, 2), (52, 104, 0, 2), (104, 155, 1, 3)):
        ledger.record(0, data, start, end, attempt=attempt, world=world, batch=48)
    ledger.record(0, data, 155, 206, attempt=1, world=3, batch=48)
    ledger.record(1, data, 0, 52, attempt=1, world=3, batch=48)
    assert [(e["samples"], e["digest"]) for e in ledger.epochs] == [(206, "ab" * 32)] * 2
    assert [(r["start"], r["end"], r["attempt"]) for r in ledger.epochs[0]["ranges"]] == [
        (0, 104, 0),
        (104, 206, 1),
    ]
    state = TrainState(data=data)
    state.ledger = ledger
    state.step_done(52)
    again = TrainState()
    again.load_state_dict(state.state_dict())
    assert again.ledger.epochs == ledger.epochs and again.sample_in_epoch == 52
    assert again.data == data
    old = state.state_dict()
    for key in ("sample_in_epoch", "plan", "ledger", "data"):
        del old[key]  # a checkpoint of an earlier version
    again.load_state_dict(old)
    assert again.sample_in_epoch is None and again.plan == [] and again.ledger.epochs == []
    assert again.data is None


class Sized:
    def __init__(self, n, digest=None):
        self.n = n
        if digest is not None:
            self.data_digest = lambda: digest

    def __len__(self):
        return self.n


def test_the_data_a_checkpoint_trained_on_is_compared_with_the_data_of_the_resume():
    """Same length and digest (or no digest on a side): resumed as it is. Otherwise refused in
    one line naming both, unless at an epoch boundary with data.allow_change."""
    mid, boundary = Position(1, 24, 2), Position(1, 0, 0)
    saved = identify(Sized(69, "a" * 64))
    assert saved == DataIdentity(69, "a" * 64) and identify([1, 2]) == DataIdentity(2)
    for now in (DataIdentity(69, "a" * 64), DataIdentity(69)):
        assert not judge_resume(saved, now, "checkpoint X", mid, allow_change=False)
    assert not judge_resume(None, DataIdentity(5), "checkpoint X", mid, allow_change=False)
    assert not judge_resume(DataIdentity(69), saved, "checkpoint X", mid, allow_change=False)
    for now in (DataIdentity(69, "b" * 64), DataIdentity(119, "a" * 64), DataIdentity(70)):
        for allow in (False, True):
            with pytest.raises(UserError) as exc:
                judge_resume(saved, now, "checkpoint X", mid, allow)
            text = str(exc.value)
            assert f"it trained on 69 samples (digest {'a' * 12})" in text
            assert f"now gives {now}" in text and "in mid-epoch" in text and "\n" not in text
        with pytest.raises(UserError, match="data.allow_change=true would resume"):
            judge_resume(saved, now, "checkpoint X", boundary, allow_change=False)
        assert judge_resume(saved, now, "checkpoint X", boundary, allow_change=True)
    with pytest.raises(TypeError, match="data_digest"):
        identify(Sized(3, digest=b"bytes"))


def test_a_new_batch_size_resumes_only_when_the_launch_allows_it():
    saved = cfgmod.load("configs/tiny.yaml").to_dict()
    changed = cfgmod.load("configs/tiny.yaml", ["train.batch_size=64"]).to_dict()
    with pytest.raises(UserError, match="train.batch_size 32 -> 64"):
        cfgmod.check_resume(saved, changed, "run dir x")
    allowed = cfgmod.load(
        "configs/tiny.yaml", ["train.batch_size=64", "train.allow_batch_size_change=true"]
    ).to_dict()
    notes = [str(c) for c in cfgmod.check_resume(saved, allowed, "run dir x")]
    assert any(n.startswith("train.batch_size 32 -> 64 (resumes, not bitwise") for n in notes)
