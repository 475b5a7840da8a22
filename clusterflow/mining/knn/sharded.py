"""The k-NN search sharded over every rank (``mining.search=sharded``): no rank holds more than
its own rows.

Rank r holds rows ``offsets[r]:offsets[r+1]`` and builds an index over them only (FAISS flat, ivf
or hnsw, on its GPUs with a GPU build; or the exact torch engine's database). Query blocks travel
a ring: in round j every rank searches its own j-th block against its shard, then passes the
block with its partial top-(k+1) to the next rank, which searches it against its shard and merges;
after ``world - 1`` hops the merged lists go back to the block's owner (one more hop). Every rank
searches one block per hop, so the work is balanced, and nothing passes through rank 0. A rank
forwards a block's query rows as soon as they arrive, before it searches them (they do not depend
on the search; only the partial lists do), so the rows travel while the shards search.

The merge keeps each engine's own order, so the lists equal the one-process engine's: the exact
torch engine ranks by similarity, ties by the smaller id (``torch_engine``), and every pair's
similarity is one fp32 dot product whatever the shard, so the lists are bitwise those of
``torch_search`` on all rows. FAISS lists equal similarities by descending id, and the merge
does the same, so flat shards give FAISS's lists on all rows, except where equal similarities
straddle the k-th place (FAISS's heap then keeps one of them by the order it met them in, which
no merge of shards can reproduce) or where FAISS rounds a pair's last bit differently in the two
layouts (it leaves BLAS for its own loop on query blocks under 20 rows). Exact ties in the lists
call for the torch engine, whose order is total.

Round j is the unit of resume: each rank keeps its finished blocks (``blocks``), and every rank
skips the blocks their owners already have; an abort is agreed at the start of a round.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from clusterflow.distributed import comm as dist
from clusterflow.mining.knn.common import NO_HOOKS, Blocks, KnnParams, SearchHooks, k_others
from clusterflow.mining.knn.faiss_engine import build_faiss_index
from clusterflow.mining.knn.torch_engine import ExactRows, _sizes, scoring_dtype

if TYPE_CHECKING:
    import faiss  # optional (the cpu or gpu extra): imported where an index is built

_Q, _S, _I = 0, 1, 2  # ring tags: query rows, partial similarities, partial ids


class _Shard:
    """This rank's rows as a searchable database: ``top(q)`` gives the best ``kk`` of every
    query among them (global ids; padded with -inf / -1 where the shard has fewer rows)."""

    def __init__(
        self,
        x: np.ndarray,
        lo: int,
        n: int,
        params: KnnParams,
        engine: str,
        device: torch.device | str,
    ) -> None:
        self.x, self.lo, self.params, self.engine = x, lo, params, engine
        self.device = torch.device(device)
        self.kk, self.db_chunk, _ = _sizes(n, params.k, params.query_batch, 65536, self.device)
        # torch: the rows, searched exactly; faiss: the index (built on the first query).
        self.index: ExactRows | faiss.Index | None = None
        self.built = 0.0

    def _build(self) -> None:
        t0 = time.perf_counter()
        if self.engine == "torch":
            self.index = ExactRows(
                torch.from_numpy(np.ascontiguousarray(self.x)).to(self.device),
                scoring_dtype(self.device),
                self.lo,
                self.db_chunk,
            )
        else:
            self.index = build_faiss_index(self.x, self.params)
        self.built = time.perf_counter() - t0

    def top(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = np.full((len(q), self.kk), -np.inf, np.float32)
        i = np.full((len(q), self.kk), -1, np.int64)
        if len(q) == 0 or len(self.x) == 0:
            return s, i
        if self.index is None:
            self._build()
        if self.engine == "torch":
            q32 = torch.from_numpy(np.ascontiguousarray(q)).to(self.device)
            ps, pi = self.index.top(q32, self.kk)
            ps, pi = ps.cpu().numpy(), pi.cpu().numpy()
        else:
            ps, pi = self.index.search(np.ascontiguousarray(q), min(self.kk, len(self.x)))
            missing = pi < 0
            pi = np.where(missing, -1, pi + self.lo)
            ps = np.where(missing, -np.inf, ps).astype(np.float32)
        s[:, : ps.shape[1]], i[:, : pi.shape[1]] = ps, pi
        return s, i


def merge(
    s: np.ndarray, i: np.ndarray, s2: np.ndarray, i2: np.ndarray, kk: int, engine: str
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``kk`` of two partial lists of the same queries (disjoint ids): the highest
    similarities, ties kept by the smaller id; listed in the engine's order (torch: ties by
    ascending id, FAISS: by descending id)."""
    s, i = np.concatenate([s, s2], 1), np.concatenate([i, i2], 1)
    order = np.lexsort((i, -s), axis=1)[:, :kk]
    s, i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    if engine != "torch":
        order = np.lexsort((-i, -s), axis=1)
        s, i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    return s, i


def _todo(
    blocks: Blocks | None, offsets: list[int], qb: int, out: tuple[np.ndarray, np.ndarray]
) -> tuple[list[list[int]], int]:
    """Per owner, the starts of its query blocks still to search (collective), and how many of
    this rank's blocks were read back (into ``out``)."""
    rank, world = dist.rank(), dist.world()
    lo, hi = offsets[rank], offsets[rank + 1]
    mine, reused = [], 0
    for qs in range(lo, hi, qb):
        done = blocks.get(qs, min(qb, hi - qs)) if blocks is not None else None
        if done is None:
            mine.append(qs)
        else:
            out[0][qs - lo : qs - lo + len(done[0])] = done[0]
            out[1][qs - lo : qs - lo + len(done[0])] = done[1]
            reused += 1
    every = dist.gather_object(mine)
    todo = dist.broadcast_object(every if every is not None else None)
    return (todo if world > 1 else [mine]), reused


def _pass_queries(
    q: np.ndarray, m_in: int, d: int, link: torch.device
) -> tuple[list[torch.distributed.Work], torch.Tensor]:
    """Send the query block ``q`` on and start receiving the previous rank's (``m_in`` rows)."""
    q_in = torch.empty((m_in, d), dtype=torch.float32, device=link)
    return dist.ring_pass(
        [torch.from_numpy(np.ascontiguousarray(q)).to(link)], [q_in], tag=_Q
    ), q_in


def sharded_search(
    x_local: np.ndarray,
    offsets: list[int],
    params: KnnParams,
    engine: str,
    device: torch.device | str = "cpu",
    *,
    hooks: SearchHooks = NO_HOOKS,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The k nearest others of this rank's rows (global ids), searched against every rank's
    shard; collective. ``engine``: ``torch`` or ``faiss`` (``knn.choose_engine``). None on every
    rank when any rank's ``hooks.should_abort`` said so (checked before each round);
    ``hooks.tick()``: once per hop (the heartbeat)."""
    should_abort, timings, blocks, tick = (
        hooks.should_abort,
        hooks.timings,
        hooks.blocks,
        hooks.tick,
    )
    t0 = time.perf_counter()
    rank, world = dist.rank(), dist.world()
    n, d, k = offsets[-1], x_local.shape[1], params.k
    lo = offsets[rank]
    shard = _Shard(np.ascontiguousarray(x_local, np.float32), lo, n, params, engine, device)
    kk, qb = shard.kk, params.query_batch
    out = (
        np.full((len(x_local), k), -np.inf, np.float32),
        np.full((len(x_local), k), -1, np.int64),
    )
    todo, reused = _todo(blocks, offsets, qb, out)
    if timings is not None:  # known now: an aborted search reports them too
        timings.update(
            blocks_skipped=reused,
            engine=f"{engine} ({params.index if engine == 'faiss' else 'exact'}, "
            f"sharded over {world} ranks)",
        )
    link = dist.collective_device() if world > 1 else torch.device("cpu")

    def rows(owner: int, j: int) -> int:
        return min(qb, offsets[owner + 1] - todo[owner][j]) if j < len(todo[owner]) else 0

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(link)

    waited = 0.0
    for j in range(max(len(t) for t in todo)):
        if dist.any_rank(bool(should_abort and should_abort())):
            return None
        m = rows(rank, j)
        q = x_local[todo[rank][j] - lo :][:m] if m else np.zeros((0, d), np.float32)
        ahead = _pass_queries(q, rows((rank - 1) % world, j), d, link) if world > 1 else None
        part = shard.top(q)  # while the block travels on
        for hop in range(1, world):
            s_in = torch.empty((rows((rank - hop) % world, j), kk), device=link)
            i_in = torch.empty(s_in.shape, dtype=torch.int64, device=link)
            lists = dist.ring_pass([tensor(part[0])], [s_in], tag=_S)
            lists += dist.ring_pass([tensor(part[1])], [i_in], tag=_I)
            t1 = time.perf_counter()
            works, q_in = ahead
            dist.wait_all(works)
            waited += time.perf_counter() - t1
            q = q_in.cpu().numpy()
            if hop < world - 1:  # forwarded before this shard searches it
                ahead = _pass_queries(q, rows((rank - hop - 1) % world, j), d, link)
            found = shard.top(q)
            t2 = time.perf_counter()
            dist.wait_all(lists)
            waited += time.perf_counter() - t2
            part = merge(s_in.cpu().numpy(), i_in.cpu().numpy(), *found, kk, engine)
            if tick is not None:
                tick()
        if world > 1:  # the lists held now are the next rank's block: one hop home
            t1 = time.perf_counter()
            s_in = torch.empty((m, kk), dtype=torch.float32, device=link)
            i_in = torch.empty((m, kk), dtype=torch.int64, device=link)
            dist.wait_all(
                dist.ring_pass([tensor(part[0])], [s_in], tag=_S)
                + dist.ring_pass([tensor(part[1])], [i_in], tag=_I)
            )
            part = (s_in.cpu().numpy(), i_in.cpu().numpy())
            waited += time.perf_counter() - t1
        if m:
            qs = todo[rank][j]
            done = k_others(*part, qs, k)
            out[0][qs - lo : qs - lo + m], out[1][qs - lo : qs - lo + m] = done
            if blocks is not None:
                blocks.put(qs, *done)
    if timings is not None:
        total = time.perf_counter() - t0
        timings.update(index=shard.built, search=total - shard.built, exchange=waited)
    return out
