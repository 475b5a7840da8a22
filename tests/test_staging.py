"""The snapshot behind background saves (clusterflow.checkpoint.staging): what it copies when, the
optimizer gate, buffer reuse, and a torn snapshot refused rather than saved."""

import copy
import threading
import time

import pytest
import torch

from clusterflow.checkpoint.staging import Staging, TornSnapshot
from clusterflow.distributed import tree


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, opt)
    return model, opt


def step(model, opt):
    model.train()
    model(torch.randn(16, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state(model, opt):
    return {
        "model.pt": model.state_dict(),
        "train_state.pt": {"optimizer": opt.state_dict(), "epoch": 3, "hist": [1.0]},
    }


def equal(a, b):
    sa, ta = tree.flatten(a)
    sb, tb = tree.flatten(b)
    return (
        sa == sb
        and len(ta) == len(tb)
        and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))
    )


def test_the_snapshot_is_the_state_at_the_boundary_whatever_the_loop_does_next():
    model, opt = setup()
    staging = Staging(model, [opt])
    live = state(model, opt)
    want = copy.deepcopy(live)
    snap = staging.take(live)
    live["train_state.pt"]["hist"].append(2.0)  # small objects are copied at the boundary
    model.train()
    model(
        torch.randn(16, 8)
    )  # a forward changes BatchNorm's running statistics: copied at the boundary
    writer = threading.Thread(target=lambda: (time.sleep(0.3), staging.copy_rest(snap)))
    writer.start()
    step(model, opt)  # the optimizer step waits in the gate until the writer has copied the weights
    writer.join()
    got = staging.result(snap)
    assert equal(got, want)
    assert not equal(state(model, opt)["model.pt"], want["model.pt"])  # the loop did move on
    assert staging.gate_s > 0  # and it was held by the gate, not by take()
    assert (
        got["model.pt"]._metadata == want["model.pt"]._metadata
    )  # what load_state_dict reads versions from
    model.load_state_dict(got["model.pt"])


class Counter:
    def __init__(self):
        self.n = 0


def test_mutable_leaves_are_copied_at_the_boundary_and_stay_shared_where_they_were():
    model, opt = setup()
    staging = Staging(model, [opt])
    seen, counter = {1, 2}, Counter()
    live = {"train_state.pt": {"seen": seen, "again": seen, "counter": counter, "name": "x"}}
    snap = staging.take(live)
    seen.add(3)
    counter.n = 5
    staging.copy_rest(snap)
    got = staging.result(snap)["train_state.pt"]
    assert got["seen"] == {1, 2} and got["counter"].n == 0 and got["name"] == "x"
    assert got["seen"] is got["again"]  # one object in the state, one in the snapshot


def test_host_buffers_are_reused_between_saves_and_views_share_one():
    model, opt = setup()
    staging = Staging(model, [opt])
    ptrs = []
    for _ in range(2):
        live = state(model, opt)
        live["tied"] = live["model.pt"][
            "0.weight"
        ]  # the same storage twice: one copy, like torch.save
        snap = staging.take(live)
        staging.copy_rest(snap)
        got = staging.result(snap)
        assert got["tied"] is got["model.pt"]["0.weight"]
        ptrs.append(sorted(t.data_ptr() for t in tree.flatten(got)[1]))
        step(model, opt)
    assert ptrs[0] == ptrs[1]  # one extra host copy, reused: no allocation per save


def test_a_tensor_changed_outside_the_optimizer_step_tears_the_snapshot():
    model, opt = setup()
    staging = Staging(model, [opt])
    snap = staging.take(state(model, opt))
    with torch.no_grad():
        model[2].weight.mul_(0.5)  # e.g. a teacher network updated by hand, before the copy
    staging.copy_rest(snap)
    with pytest.raises(TornSnapshot, match=r"2\.weight.*checkpoint\.async=false"):
        staging.result(snap)


def test_without_an_optimizer_everything_is_copied_at_the_boundary():
    model, _ = setup()
    staging = Staging(model, [])
    live = {"model.pt": model.state_dict()}
    want = copy.deepcopy(live)
    snap = staging.take(live)
    assert snap.rest == []
    with torch.no_grad():
        model[0].weight.add_(1.0)
    staging.copy_rest(snap)
    assert equal(staging.result(snap), want)
