"""A torchrun pretraining script with its own argument parser, schedule and state, converted to
clusterflow (docs/own-loop.md).

A small causal transformer learns next-token prediction on an endless stream of sequences drawn
from a fixed random Markov chain (no download; each rank draws its own). The script keeps its own
habits: argparse, a loop counted in optimizer steps (--steps), AdamW with a decay and a no-decay
group, a warm-up + cosine schedule of its own (LambdaLR over optimizer steps), gradient
accumulation (--accum micro-batches of a --global-batch step), bf16 autocast where train.amp
says, gradient clipping, an EMA of the weights, a counter of tokens seen and a generator of its
own for token dropout. The lines marked ``# clusterflow`` are the conversion: each of those
states, and each rank's position in its stream, is saved with every checkpoint and restored
exactly on resume.

    torchrun --nproc-per-node 2 examples/pretrain.py --steps 400 --lr 3e-3           # by hand
    python -m clusterflow.submit --script examples/pretrain.py cluster.nodes=4 train.amp=bf16 \\
        cluster.gpus_per_node=8 cluster.tasks_per_node=8 -- --steps 20000 --d-model 512
    python -m clusterflow.submit --script examples/pretrain.py cluster.tasks_per_node=2 \\
        --local --sweep arg:--lr=1e-3,3e-3 -- --steps 200                 # a sweep of --lr
"""

import argparse
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

import clusterflow  # clusterflow


class MarkovStream(IterableDataset):
    """An endless stream of sequences of ``length`` + 1 tokens from one random first-order Markov
    chain (the same chain everywhere: ``seed``), drawn from a generator of the stream's own
    (``stream``: one per rank). Its position is that generator's state, kept by torchdata's
    ``state_dict()``/``load_state_dict()`` convention."""

    def __init__(self, length: int, vocab: int, seed: int = 0, stream: int = 0) -> None:
        # A sparse transition matrix: each token is followed by one of 4 others.
        self.next = torch.randint(vocab, (vocab, 4), generator=torch.Generator().manual_seed(seed))
        self.length, self.vocab = length, vocab
        self.g = torch.Generator().manual_seed(1000 + stream)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            tokens = torch.empty(self.length + 1, dtype=torch.long)
            tokens[0] = torch.randint(self.vocab, (1,), generator=self.g)
            picks = torch.randint(4, (self.length,), generator=self.g)
            for t in range(self.length):
                tokens[t + 1] = self.next[tokens[t], picks[t]]
            yield tokens

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.g.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.g.set_state(state["generator"])


class GPT(nn.Module):
    def __init__(self, vocab: int, length: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(length, d_model))
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.norm(self.blocks(h, mask=causal, is_causal=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of the whole run")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=128, help="sequences per optimizer step")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--token-dropout", type=float, default=0.05)
    args = p.parse_args()

    run = clusterflow.start()  # clusterflow: replaces init_process_group and set_device
    device = run.device  # clusterflow
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2 and n != "pos"]
    no_decay = [q for n, q in model.named_parameters() if q.dim() < 2 or n == "pos"]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay}], lr=args.lr
    )
    model, optimizer = run.setup(model, optimizer)  # clusterflow: replaces DDP(model.to(device))
    ema = torch.optim.swa_utils.AveragedModel(
        run.unwrap(model), multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(args.ema)
    )
    data = MarkovStream(args.seq_len, args.vocab, stream=run.rank)
    # clusterflow: replaces DistributedSampler + DataLoader (`accum` micro-batches a step)
    loader = run.loader(data, global_batch_size=args.global_batch, accumulate=args.accum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    stats = {"tokens": 0}
    noise = torch.Generator(device="cpu").manual_seed(1000 + run.rank)
    run.restore(  # clusterflow: every state below is saved with each checkpoint
        model=model, optimizer=optimizer, scheduler=scheduler, ema=ema, stats=stats, noise=noise
    )

    micro = 0
    for seq in run.steps(loader, args.steps):  # clusterflow: replaces the loop over batches
        seq = seq.to(device, non_blocking=True)
        x, y = seq[:, :-1], seq[:, 1:]
        drop = torch.rand(x.shape, generator=noise) < args.token_dropout
        x = x.masked_fill(drop.to(device), 0)
        # clusterflow: gradients all-reduced on a step's last micro-batch only (DDP's no_sync)
        with run.accumulate(model):
            with run.autocast():  # clusterflow: train.amp (bf16 on a GPU by default)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            (loss / args.accum).backward()
        stats["tokens"] += y.numel() * run.world_size
        micro += 1
        if micro < args.accum:
            continue
        micro = 0
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ema.update_parameters(run.unwrap(model))
        run.step(loss=loss)  # clusterflow
        if run.global_step % 100 == 0:
            run.print(f"step {run.global_step}: loss {loss.item():.3f}, {stats['tokens']} tokens")

    run.finish()  # clusterflow: RUN_DIR/model.pt; replaces the save and destroy_process_group


if __name__ == "__main__":
    main()
