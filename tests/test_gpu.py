"""GPU paths, run whenever a CUDA GPU is present (they skip on CPU-only machines such as CI):
the exact torch k-NN engine on the GPU against faiss-cpu, bf16 embedding, and the demo on NCCL."""

import json
import os

import launch
import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]


def test_torch_engine_on_gpu_equals_faiss_cpu():
    faiss = pytest.importorskip("faiss")
    from clusterflow.mining import normalize
    from clusterflow.mining.knn.torch_engine import torch_search

    rng = np.random.default_rng(0)
    x = normalize(rng.standard_normal((20000, 128)).astype(np.float32))
    got_d, got_i = torch_search(x, 10, device="cuda", query_batch=4096)
    idx = faiss.IndexFlatIP(x.shape[1])
    idx.add(x)
    want_d, want_i = idx.search(x, 11)
    # Exact up to float ties: the neighbour sets agree and the similarities agree to fp32 rounding.
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got_i, want_i[:, 1:])]) > 0.999
    np.testing.assert_allclose(np.sort(got_d, 1), np.sort(want_d[:, 1:], 1), atol=1e-5)


def test_demo_on_one_gpu_with_nccl_and_bf16(tmp_path):
    d = str(tmp_path / "run")
    assert launch.run(
        1, "configs/tiny.yaml", [f"run.dir={d}", "dist.backend=nccl", "train.amp=bf16"], d
    ) == [0]
    status = json.load(open(os.path.join(d, "status.json")))
    assert status["state"] == "completed" and len(status["mining"]) == 2
    log = open(os.path.join(d, "logs", "rank0.attempt0.log")).read()
    assert "device cuda:0" in log


def test_background_snapshot_of_gpu_state_is_the_state_at_the_boundary():
    """Side-stream copies into pinned buffers, gated by the optimizer step on the device: the
    snapshot equals the state at the save even though the loop's next step runs at once."""
    import copy

    from clusterflow.checkpoint.staging import Staging
    from clusterflow.distributed import tree

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(256, 2048, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    staging = Staging(model, [opt])
    live = {"model.pt": model.state_dict(), "optimizer": opt.state_dict()}
    want = copy.deepcopy(live)
    snap = staging.take(live)
    import threading

    writer = threading.Thread(target=staging.copy_rest, args=(snap,))
    writer.start()
    for _ in range(3):
        step()  # queued at once; the first optimizer step waits for the copies on the device
    writer.join()
    got = staging.result(snap)
    _, g = tree.flatten(got)
    _, w = tree.flatten(want)
    assert all(a.device.type == "cpu" and torch.equal(a, b.cpu()) for a, b in zip(g, w))
    assert all(a.is_pinned() for a in g if a.numel() > 1)
