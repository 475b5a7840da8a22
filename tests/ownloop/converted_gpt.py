"""A small GPT pretrained the way nanoGPT's train.py does it (torchrun --nproc-per-node 2 FILE): no
Dataset, random windows of a token array drawn with torch.randint, its own seed per rank, its own
gradient accumulation (DDP's require_backward_grad_sync), a prefetch of the next batch during the
forward, warm-up + cosine learning rate by iteration, an evaluation every few iterations on rank
0, dropout. plain_gpt.py is the script as users arrive with it, converted_gpt.py the same script
converted to clusterflow (docs/own-loop.md); tests/test_own_loop_steps.py counts the lines that
differ and runs both.

For the tests only (environment variables, so the script's arguments stay those of the run):
HOLD_AT_STEP, the iteration (1-based) at whose end rank 0 writes HOLD_DIR/held and waits there
until HOLD_DIR/release exists."""

import argparse
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

import clusterflow

VOCAB = 32


def corpus(n=4096):
    """A token stream with structure to learn: a walk that mostly steps by +1 or +3."""
    g = torch.Generator().manual_seed(0)
    steps = torch.where(torch.rand(n, generator=g) < 0.7, 1, 3)
    return torch.cumsum(steps, 0) % VOCAB


class Block(torch.nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        t = x.size(1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, attn_mask=causal, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(torch.nn.Module):
    def __init__(self, block_size, dim=32, heads=2, layers=2, dropout=0.1):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(block_size, dim)
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.Sequential(*[Block(dim, heads, dropout) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.size(1))))
        logits = self.head(self.blocks(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def hold(iter_num, rank):
    if rank == 0 and iter_num + 1 == int(os.environ.get("HOLD_AT_STEP", "0")):
        open(os.path.join(os.environ["HOLD_DIR"], "held"), "w").close()
        while not os.path.exists(os.path.join(os.environ["HOLD_DIR"], "release")):
            time.sleep(0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-iters", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--accumulation-steps", type=int, default=4, help="on all ranks together")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-iters", type=int, default=4)
    p.add_argument("--lr-decay-iters", type=int, default=100)
    p.add_argument("--eval-interval", type=int, default=8)
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--out-dir", default="out")
    args = p.parse_args()

    run = clusterflow.start()
    ddp = int(os.environ.get("RANK", "-1")) != -1
    if ddp:
        ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        master_process, seed_offset = ddp_rank == 0, ddp_rank
        assert args.accumulation_steps % ddp_world_size == 0
        args.accumulation_steps //= ddp_world_size
    else:
        ddp_rank, master_process, seed_offset = 0, True, 0
    torch.manual_seed(1337 + seed_offset)
    ctx = nullcontext()

    data = corpus()
    train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)) :]

    def get_batch(split):
        data = train_data if split == "train" else val_data
        ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
        x = torch.stack([data[i : i + args.block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + args.block_size] for i in ix])
        return x, y

    model = GPT(args.block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer = run.setup(model, optimizer)
    raw_model = run.unwrap(model)
    run.restore(model=model, optimizer=optimizer)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        raw_model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    _, loss = raw_model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        raw_model.train()
        return out

    def get_lr(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / (args.warmup_iters + 1)
        ratio = min(1.0, (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters))
        return args.lr * 0.1 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * args.lr * 0.9

    for iter_num in run.steps(args.max_iters):
        X, Y = get_batch("train")  # the step's first batch, drawn after run.step
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0 and master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val {losses['val']:.4f}")
        for micro_step in range(args.accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == args.accumulation_steps - 1
            with ctx:
                _, loss = model(X, Y)
                loss = loss / args.accumulation_steps
            # prefetch the next batch while the forward runs
            if micro_step < args.accumulation_steps - 1:  # the next step's comes after run.step
                X, Y = get_batch("train")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master_process:
            print(f"iter {iter_num}: loss {loss.item() * args.accumulation_steps:.6f}", flush=True)
        hold(iter_num, ddp_rank)
        run.step(loss=loss)

    run.finish()


if __name__ == "__main__":
    main()
