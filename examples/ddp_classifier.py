"""A single-file DDP image classifier, converted to clusterflow (docs/own-loop.md).

A small CNN on scikit-learn's handwritten digits (1,797 real 8x8 scans, no download), trained
with DDP, mixed precision where train.amp says (bf16 on a GPU by default), and a held-out accuracy
after every epoch. The lines marked
``# clusterflow`` are the conversion; everything else is the plain DDP script it was.

    torchrun --nproc-per-node 2 examples/ddp_classifier.py --epochs 5       # by hand
    python -m clusterflow.submit --script examples/ddp_classifier.py cluster.tasks_per_node=2 \\
        --local -- --epochs 5                                              # here, submitted
    python -m clusterflow.submit --script examples/ddp_classifier.py cluster.nodes=2 \\
        cluster.gpus_per_node=4 cluster.tasks_per_node=4 -- --epochs 50    # on Slurm
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import clusterflow  # clusterflow


def digits(train: bool) -> TensorDataset:
    """Images scaled to [0, 1], one channel; every fifth scan held out for evaluation."""
    d = load_digits()
    keep = (np.arange(len(d.target)) % 5 != 0) == train
    x = torch.tensor(d.images[keep] / 16.0, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, torch.tensor(d.target[keep]))


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(self.drop(x.flatten(1)))


@torch.no_grad()
def accuracy(
    model: nn.Module, loader: DataLoader, device: torch.device, run: clusterflow.Run
) -> float:
    """Over every rank's share of the held-out set (the shares differ by one), summed across
    ranks."""
    model.eval()
    right = total = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        right = right + (model(x).argmax(1) == y).sum()
        total = total + len(y)
    both = run.reduce(torch.stack([right, total]), "sum")  # clusterflow: replaces all_reduce
    model.train()
    return float(both[0] / both[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="images per GPU and step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--width", type=int, default=32)
    args = p.parse_args()

    run = clusterflow.start()  # clusterflow: replaces init_process_group and set_device
    device = run.device  # clusterflow
    torch.manual_seed(0)
    model = Net(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    model, optimizer = run.setup(model, optimizer)  # clusterflow: replaces DDP(model.to(device))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    train = digits(train=True)
    # clusterflow: replaces DistributedSampler + DataLoader (batch_size: per rank, as there)
    loader = run.loader(train, batch_size=args.batch)
    held = digits(train=False)
    held_out = DataLoader(Subset(held, range(run.rank, len(held), run.world_size)), batch_size=256)
    run.restore(model=model, optimizer=optimizer, scheduler=scheduler)  # clusterflow

    for epoch in run.epochs(args.epochs):  # clusterflow: replaces range() and set_epoch
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with run.autocast():  # clusterflow: train.amp (bf16 on a GPU; fp16 scales the loss)
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            run.scaler.scale(loss).backward()  # clusterflow: the scaler fp16 needs, else a no-op
            run.scaler.step(optimizer)  # clusterflow
            run.scaler.update()  # clusterflow
            run.step(loss=loss)  # clusterflow
        scheduler.step()
        acc = accuracy(model, held_out, device, run)
        run.log({"eval/accuracy": acc})  # clusterflow (optional): TensorBoard, trackers
        run.print(f"epoch {epoch + 1}: held-out accuracy {acc:.3f}")  # clusterflow: rank 0

    run.finish()  # clusterflow: RUN_DIR/model.pt; replaces the save and destroy_process_group


if __name__ == "__main__":
    main()
