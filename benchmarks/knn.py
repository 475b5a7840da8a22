"""Exact k-NN: the torch and faiss engines against a bare matmul + topk loop, side by side.

    python benchmarks/knn.py                          # four sizes, 2 repeats, sharded at 2 ranks
    python benchmarks/knn.py --sizes 200000x128x10 100000x512x30 --repeats 3
    python benchmarks/knn.py --ranks 0                # the engines only

The bare loop is what a researcher writes: an fp32 matmul of a query block against every row,
the diagonal set to -inf, ``topk``; a block of about 2 GB of scores at a time. The engines are
called as mining calls them (``knn.search`` with ``mining.engine=torch`` or ``faiss``, exact
flat search), on the same L2-normalised blobs, each side timed whole (the engine's copies and
its lists of k nearest others included), sides interleaved in a rotating order, best of the
repeats. ``mining.search=sharded`` runs on ``--ranks`` gloo processes on this machine: each
rank's time for the whole ring against the same rank doing the bare loop of all queries
against its own rows (the per-rank work), alternated in the same processes.

Printed last, per size: each engine's speed against the bare loop (bare seconds / engine
seconds; >= 0.9 is the goal), and the fraction of rows whose neighbour set equals the bare
loop's (rows differ only where two similarities are within rounding of each other at the cut:
the engines are exact by one fp32 dot product per pair, the bare loop by its matmul's rounding).
The load average is printed before and after each size: on a shared machine, repeat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from clusterflow.mining import knn

SIZES = ("20000x128x10", "20000x256x20", "20000x512x30", "40000x128x10")


def blobs(n: int, d: int, device: str = "cpu") -> np.ndarray:
    """``n`` L2-normalised rows around ``n // 50`` centres (float32), made on ``device``."""
    g = torch.Generator(device=device).manual_seed(0)
    centres = torch.randn(max(2, n // 50), d, generator=g, device=device)
    out = torch.empty(n, d, dtype=torch.float32)
    for lo in range(0, n, 1 << 18):
        hi = min(n, lo + (1 << 18))
        pick = torch.randint(0, len(centres), (hi - lo,), generator=g, device=device)
        rows = centres[pick] + 0.8 * torch.randn(hi - lo, d, generator=g, device=device)
        out[lo:hi] = torch.nn.functional.normalize(rows, dim=1).cpu()
    return out.numpy()


def bare_knn(
    x: np.ndarray, k: int, device: str = "cpu", queries: np.ndarray | None = None, lo: int = 0
) -> np.ndarray:
    """What a researcher writes: fp32 matmul against every row and topk, a query block at a
    time, self dropped; the ids (N, k). ``queries`` (rows ``lo..`` of the whole set) against
    ``x`` instead: a rank's part, no self to drop."""
    db = torch.from_numpy(x).to(device)
    q = db if queries is None else torch.from_numpy(queries).to(device)
    block = max(1, (1 << 31) // (4 * len(db)))  # ~2 GB of scores per block
    out = []
    for qs in range(0, len(q), block):
        scores = q[qs : qs + block] @ db.T
        if queries is None:
            rows = torch.arange(len(scores))
            scores[rows, rows + qs] = -float("inf")
        out.append(scores.topk(min(k, len(db)), dim=1).indices.cpu() + lo)
    if device == "cuda":
        torch.cuda.synchronize()
    return torch.cat(out).numpy()


def same_sets(a: np.ndarray, b: np.ndarray) -> float:
    """The fraction of rows whose id sets agree."""
    return float(np.mean([set(x) == set(y) for x, y in zip(a.tolist(), b.tolist())]))


def _engine(x: np.ndarray, k: int, engine: str, timings: dict[str, object]) -> np.ndarray:
    _, ids = knn.search(x, knn.KnnParams(k=k, engine=engine), timings=timings)
    return ids


def _sharded_rank(x: np.ndarray, k: int, repeats: int) -> dict[str, float]:
    """On every rank: the sharded torch search and the bare loop of the same rank's work."""
    from clusterflow.distributed import comm as dist
    from clusterflow.mining.knn.sharded import sharded_search

    rank, world = dist.rank(), dist.world()
    offsets = [len(x) * r // world for r in range(world + 1)]
    mine = np.ascontiguousarray(x[offsets[rank] : offsets[rank + 1]])
    best = {"sharded": float("inf"), "bare": float("inf")}
    for rep in range(repeats):
        for side in ("sharded", "bare") if rep % 2 == 0 else ("bare", "sharded"):
            dist.barrier()
            t0 = time.perf_counter()
            if side == "sharded":
                sharded_search(mine, offsets, knn.KnnParams(k=k, engine="torch"), "torch")
            else:
                bare_knn(mine, k + 1, queries=x, lo=offsets[rank])
            best[side] = min(best[side], time.perf_counter() - t0)
    return best


def sharded(x: np.ndarray, k: int, ranks: int, repeats: int) -> tuple[float, float]:
    """(sharded seconds, bare seconds) of the slowest rank, ``ranks`` gloo processes, each on
    this machine's cores / ranks threads."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from multirank import run_ranks

    out = run_ranks(ranks, _sharded_rank, x, k, repeats, timeout=3600)
    return max(r["sharded"] for r in out), max(r["bare"] for r in out)


def load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help="NxDxK, e.g. 20000x128x10")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="mining.search=sharded ranks; 0: none")
    p.add_argument("--engines", default="torch,faiss")
    a = p.parse_args()
    engines = [e for e in a.engines.split(",") if e != "faiss" or knn.faiss_available()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    rows = []
    for size in a.sizes:
        n, d, k = (int(v) for v in size.split("x"))
        x = blobs(n, d)
        print(f"{n:,} x {d}, k={k}: load average before {load()}", flush=True)
        sides = ["bare", *engines]
        best = {s: float("inf") for s in sides}
        ids, timings = {}, {}
        for rep in range(a.repeats):
            for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:
                t0 = time.perf_counter()
                ids[side] = bare_knn(x, k) if side == "bare" else _engine(x, k, side, timings)
                best[side] = min(best[side], time.perf_counter() - t0)
                print(f"  repeat {rep + 1} {side:6s} {time.perf_counter() - t0:8.2f} s", flush=True)
        if "rechecked" in timings:
            print(f"  torch engine: {timings['rechecked']} of {n:,} queries searched again")
        row = {"size": f"{n:,} x {d}, k={k}", "bare_s": best["bare"]}
        for e in engines:
            row[e] = (best["bare"] / best[e], best[e], same_sets(ids[e], ids["bare"]))
        if a.ranks > 1:
            sh, bare = sharded(x, k, a.ranks, a.repeats)
            row["sharded"] = (bare / sh, sh, None)
            print(f"  sharded, {a.ranks} ranks: {sh:.2f} s, bare per rank {bare:.2f} s")
        print(f"  load average after {load()}", flush=True)
        rows.append(row)
    print("\nspeed against the bare matmul + topk (bare seconds / engine seconds; goal >= 0.9):")
    for row in rows:
        parts = [f"{row['size']:>24s}: bare {row['bare_s']:.2f} s"]
        for name in (*engines, "sharded"):
            if name in row:
                ratio, secs, same = row[name]
                label = f"sharded/{a.ranks} per rank" if name == "sharded" else name
                extra = "" if same is None else f", same sets {100 * same:.2f}%"
                parts.append(f"{label} {ratio:.3f}x ({secs:.2f} s{extra})")
        print("; ".join(parts))


if __name__ == "__main__":
    main()
