"""Losses shared by the built-in tasks."""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from clusterflow.distributed import comm as dist


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own rows, summed over
    ranks. Implemented with all_reduce so it works on gloo (no reduce_scatter there). Ranks may
    hold different numbers of rows (``dist.all_gather_rows``)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = dist.rows_of_ranks(x)
        ctx.start = sum(rows[: dist.rank()])
        ctx.n = x.shape[0]
        return torch.cat(dist.all_gather_rows(x))

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = dist.all_reduce_tensor(grad.contiguous())
        return grad[ctx.start : ctx.start + ctx.n]


def gather_with_grad(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Rows of every rank, and where this rank's rows start."""
    if dist.world() == 1:
        return x, 0
    return _GatherWithGrad.apply(x), sum(dist.rows_of_ranks(x)[: dist.rank()])


def supcon_loss(
    z: torch.Tensor, labels: torch.Tensor, temperature: float = 0.1
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised contrastive loss over the global batch.

    ``z``: this rank's L2-normalised embeddings (n, d); ``labels``: (n,) ids, equal ids are
    positives. Candidates are the rows of every rank, so the loss equals the single-process loss on
    the global batch: the same weights train the same way on 1 or N processes. Anchors without
    any positive are skipped. Returns the mean over this rank's anchors (DDP averages ranks), and
    the metrics as 0-dim tensors: nothing here reads a value back to the host (no boolean
    indexing, no ``int()``), so a training step never waits for the device.
    """
    zg, offset = gather_with_grad(z)
    # Ids travel as integers: they need no gradient, and a float32 cannot tell apart ids past 2**24.
    lg = torch.cat(dist.all_gather_rows(labels.long()))
    n = z.shape[0]
    sim = z @ zg.T / temperature  # (n, N)
    self_mask = torch.zeros_like(sim, dtype=torch.bool)
    rows = torch.arange(n, device=z.device)
    self_mask[rows, offset + rows] = True
    sim = sim.masked_fill(self_mask, float("-inf"))
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    pos = (labels[:, None] == lg[None, :]) & ~self_mask
    n_pos = pos.sum(1)
    has = n_pos > 0
    anchors = has.sum().clamp(min=1)
    mean_log_pos = torch.where(pos, log_prob, torch.zeros_like(log_prob)).sum(1) / n_pos.clamp(
        min=1
    )
    # Where, not mean_log_pos[has]: a boolean index needs its count on the host. Anchors without a
    # positive add exact zeros (and when every anchor has one, the sum is the very same one).
    loss = -torch.where(has, mean_log_pos, torch.zeros_like(mean_log_pos)).sum() / anchors
    with torch.no_grad():
        cos = torch.where(pos, sim * temperature, torch.zeros_like(sim)).sum(1) / n_pos.clamp(min=1)
        pos_cos = (
            torch.where(has, cos, torch.zeros_like(cos)).sum() / anchors
        )  # 0 when no anchor has a positive
    return loss, {"pos_cos": pos_cos, "anchors_with_pos": has.float().mean()}
