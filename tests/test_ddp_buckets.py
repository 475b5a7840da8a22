"""dist.fixed_buckets: the DDP the trainer builds sums the ranks' gradients in one bucket layout
from its first step on, without looking for unused parameters every step. A freshly built DDP
(what a resumed attempt has) then gives, at its first step, bitwise the gradients a DDP that
already trained a step (the uninterrupted run) gives at its next; 3 ranks, so that the order of
the sum shows in the bits."""

from multirank import run_ranks


def _model():
    import torch

    torch.manual_seed(0)
    # 2.2 MB of fp32 gradients: more than one bucket of the 1 MB the test asks for.
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 64),
    )


def _batch(step):
    import torch

    from clusterflow.distributed import comm as dist

    g = torch.Generator().manual_seed(1000 * step + dist.rank())
    # Values of very different sizes per rank: the sum's rounding depends on its order.
    return torch.randn(16, 64, generator=g) * (10.0 ** (3 * dist.rank()))


def _grads(ddp, step):
    ddp.zero_grad(set_to_none=True)
    ddp(_batch(step)).square().mean().backward()
    return [p.grad.clone() for p in ddp.module.parameters()]


def _layouts():
    import torch

    from clusterflow.config.sections import DistConfig
    from clusterflow.train.parallel import wrap_ddp

    out = {}
    for fixed in (True, False):
        cfg = DistConfig(fixed_buckets=fixed, bucket_cap_mb=1)
        uninterrupted = wrap_ddp(_model(), torch.device("cpu"), cfg)
        _grads(uninterrupted, 0)  # the step before the one a resumed attempt starts at
        want = _grads(uninterrupted, 1)
        resumed = wrap_ddp(_model(), torch.device("cpu"), cfg)
        got = _grads(resumed, 1)
        out[fixed] = {
            "finds_unused": uninterrupted.find_unused_parameters,
            "equal": all(torch.equal(a, b) for a, b in zip(got, want)),
        }
    return out


def test_a_fresh_ddp_first_step_sums_as_the_running_one():
    ranks = run_ranks(3, _layouts)
    assert all(r[True]["finds_unused"] is False for r in ranks), ranks
    assert all(r[True]["equal"] for r in ranks), ranks
    # Without fixed buckets the same comparison sees the layout change: the check can fail.
    assert not any(r[False]["equal"] for r in ranks), ranks
