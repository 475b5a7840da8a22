"""The exact torch k-NN engine: chunked matrix products and top-k, on every local GPU (or the CPU),
or spread over every rank (``distributed_search``, ``mining.search=all``).

Candidates are scored in bf16 on GPU (fp32 on CPU), ``2k + 16`` of them kept per query and
re-ranked in fp32 with one dot product per pair, so the result is the fp32 one and does not depend
on how the work was split: one device, several devices and several ranks agree bitwise. Ties are
broken by the smaller id, like a stable sort.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from clusterflow.distributed import comm as dist
from clusterflow.mining.knn.common import Blocks, k_others


def _sizes(n: int, k: int, query_batch: int, db_chunk: int) -> tuple[int, int, int, int]:
    """(k+1 capped at n, candidates kept per query, database chunk, query batch)."""
    kk = min(k + 1, n)
    cand = min(n, 2 * kk + 16)  # a margin over k+1, so near-ties at the cut are re-ranked exactly
    # Bound one score block (queries x database chunk) to 2**26 floats (256 MB in fp32).
    db_chunk = min(db_chunk, 65536)
    return kk, cand, db_chunk, max(1, min(query_batch, (1 << 26) // db_chunk))


def _sorted_top(
    best_s: torch.Tensor, best_i: torch.Tensor, keep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` best per row: similarity descending, ties by the smaller id (a stable sort)."""
    order = torch.argsort(best_i, dim=1)
    best_s, best_i = torch.gather(best_s, 1, order), torch.gather(best_i, 1, order)
    order = torch.argsort(-best_s, dim=1, stable=True)
    return torch.gather(best_s, 1, order)[:, :keep], torch.gather(best_i, 1, order)[:, :keep]


def _topk_block(
    q32: torch.Tensor,
    q_c: torch.Tensor,
    db32: torch.Tensor,
    db_c: torch.Tensor,
    cand: int,
    keep: int,
    db_chunk: int,
    id_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``keep`` of the query block against the database block (ids shifted by
    ``id_offset``): ``cand`` candidates per query scored in the candidate dtype, re-ranked in
    fp32."""
    n = db32.shape[0]
    best_s, best_i = None, None
    for ds in range(0, n, db_chunk):
        s = q_c @ db_c[ds : ds + db_chunk].T
        sv, si = torch.topk(s.float(), min(cand, s.shape[1]), dim=1)
        si = si + ds
        if best_s is None:
            best_s, best_i = sv, si
        else:
            best_s, order = torch.topk(
                torch.cat([best_s, sv], 1), min(cand, best_s.shape[1] + sv.shape[1]), dim=1
            )
            best_i = torch.gather(torch.cat([best_i, si], 1), 1, order)
    # Re-rank the candidates in fp32 with one dot product per pair: exact when candidates were
    # scored in bf16, and independent of the block shapes (a matmul's summation order changes
    # with them), so one device, several devices and several ranks give bitwise the same result.
    best_s = (q32.unsqueeze(1) * db32[best_i]).sum(-1)
    best_s, best_i = _sorted_top(best_s, best_i, keep)
    return best_s, best_i + id_offset


def _replicas(
    x: np.ndarray, device: str | list[str] | None, candidate_dtype: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (fp32, candidate-dtype) copy of the database per device; by default every visible
    GPU, else the CPU."""
    if device is None:
        devices = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())] or [
            torch.device("cpu")
        ]
    else:
        devices = [torch.device(d) for d in ([device] if isinstance(device, str) else device)]
    if candidate_dtype == "auto":
        candidate_dtype = "bf16" if devices[0].type == "cuda" else "fp32"
    replicas = []
    for dev in devices:
        db32 = torch.from_numpy(np.ascontiguousarray(x)).to(dev)
        replicas.append((db32, db32.to(torch.bfloat16) if candidate_dtype == "bf16" else db32))
    return replicas


def torch_search(
    x: np.ndarray,
    k: int,
    query_batch: int = 65536,
    should_abort: Callable[[], bool] | None = None,
    timings: dict | None = None,
    device: str | list[str] | None = None,
    db_chunk: int = 262144,
    candidate_dtype: str = "auto",
    blocks: Blocks | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Exact k nearest others of every row of ``x``; None when ``should_abort`` said so.

    ``device`` may name several devices: each holds a copy of the database and takes every n-th
    query batch, on its own thread (CUDA kernels and copies release the GIL), so the search scales
    with the GPUs of the node.
    """
    t0 = time.perf_counter()
    replicas = _replicas(x, device, candidate_dtype)
    n = x.shape[0]
    kk, cand, db_chunk, query_batch = _sizes(n, k, query_batch, db_chunk)
    t1 = time.perf_counter()
    sims_out = np.full((n, k), -np.inf, np.float32)
    ids_out = np.full((n, k), -1, np.int64)
    starts = list(range(0, n, query_batch))
    aborted = threading.Event()
    failures: list[BaseException] = []

    def worker(slot: int) -> None:
        db32, db_c = replicas[slot]
        try:
            for qs in starts[slot :: len(replicas)]:
                done = blocks.get(qs, min(query_batch, n - qs)) if blocks is not None else None
                if done is None:
                    if aborted.is_set() or (should_abort and should_abort()):
                        aborted.set()
                        return
                    best = _topk_block(
                        db32[qs : qs + query_batch],
                        db_c[qs : qs + query_batch],
                        db32,
                        db_c,
                        cand,
                        kk,
                        db_chunk,
                        0,
                    )
                    done = k_others(*best, qs, k)
                    if blocks is not None:
                        blocks.put(qs, *done)  # from several threads: SearchBlocks locks
                s_np, i_np = done
                # Disjoint rows per block.
                sims_out[qs : qs + len(s_np)], ids_out[qs : qs + len(s_np)] = s_np, i_np
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failures.append(exc)
            aborted.set()

    threads = [
        threading.Thread(target=worker, args=(i,), daemon=True) for i in range(1, len(replicas))
    ]
    for t in threads:
        t.start()
    worker(0)  # the first device's share runs on this thread
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    if aborted.is_set():
        return None
    if timings is not None:
        timings["index"] = t1 - t0
        timings["search"] = time.perf_counter() - t1
    return sims_out, ids_out


def distributed_search(
    x_local: np.ndarray,
    offsets: list[int],
    k: int,
    device: torch.device | str,
    query_batch: int = 65536,
    db_chunk: int = 65536,
    should_abort: Callable[[], bool] | None = None,
    timings: dict | None = None,
    blocks: Blocks | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Exact k-NN spread over every rank (collective: all ranks call it).

    Rank r holds rows ``offsets[r]:offsets[r+1]`` of the normalised database. Each rank in turn
    broadcasts its rows as query blocks; every rank scores a block against its own rows and the
    partial top-k are all-gathered and merged by the block's owner. Returns this rank's rows'
    (sims, ids), k nearest others each, or None on every rank when any rank's ``should_abort``
    said so (checked before each block). ``blocks``: each rank's own finished blocks (the owner
    keeps a block); every rank skips the blocks some owner already has.
    """
    t0 = time.perf_counter()
    rank, world = dist.rank(), dist.world()
    n, d = offsets[-1], x_local.shape[1]
    dev = torch.device(device)
    db32 = torch.from_numpy(np.ascontiguousarray(x_local, dtype=np.float32)).to(dev)
    db_c = db32.to(torch.bfloat16) if dev.type == "cuda" else db32
    kk, cand, db_chunk, query_batch = _sizes(n, k, query_batch, db_chunk)
    sims_out = np.full((len(x_local), k), -np.inf, np.float32)
    ids_out = np.full((len(x_local), k), -1, np.int64)
    lo = offsets[rank]
    skip = (
        _finished_anywhere(
            _read_back(blocks, lo, offsets[rank + 1], query_batch, sims_out, ids_out)
        )
        if blocks is not None
        else set()
    )
    if timings is not None:
        timings["blocks_skipped"] = len(skip)
    t1 = time.perf_counter()
    for owner in range(world):
        o_lo, o_hi = offsets[owner], offsets[owner + 1]
        for qs in range(o_lo, o_hi, query_batch):
            if qs in skip:
                continue
            if dist.any_rank(bool(should_abort and should_abort()), device=dev):
                return None
            m = min(query_batch, o_hi - qs)
            q = (
                db32[qs - o_lo : qs - o_lo + m].contiguous()
                if rank == owner
                else torch.empty((m, d), dtype=torch.float32, device=dev)
            )
            dist.broadcast_tensor(q, src=owner)
            s = torch.full((m, kk), -torch.inf, device=dev)
            i = torch.full((m, kk), -1, dtype=torch.int64, device=dev)
            if len(x_local):
                ps, pi = _topk_block(
                    q, q.to(db_c.dtype), db32, db_c, cand, kk, db_chunk, offsets[rank]
                )
                # A block with fewer than kk rows pads with -inf.
                s[:, : ps.shape[1]], i[:, : pi.shape[1]] = ps, pi
            all_s, all_i = dist.all_gather_tensors(s), dist.all_gather_tensors(i)
            if rank != owner:
                continue
            best_s, best_i = _sorted_top(torch.cat(all_s, 1), torch.cat(all_i, 1), kk)
            s_np, i_np = k_others(best_s, best_i, qs, k)
            sims_out[qs - lo : qs - lo + m], ids_out[qs - lo : qs - lo + m] = s_np, i_np
            if blocks is not None:
                blocks.put(qs, s_np, i_np)
    if timings is not None:
        timings["index"] = t1 - t0
        timings["search"] = time.perf_counter() - t1
        timings["engine"] = f"torch (exact, distributed over {world} ranks)"
    return sims_out, ids_out


def _read_back(
    blocks: Blocks, lo: int, hi: int, query_batch: int, sims_out: np.ndarray, ids_out: np.ndarray
) -> list[int]:
    """Fill this rank's rows ``lo:hi`` from the blocks an earlier attempt finished; their starts."""
    found = []
    for qs in range(lo, hi, query_batch):
        done = blocks.get(qs, min(query_batch, hi - qs))
        if done is not None:
            (
                sims_out[qs - lo : qs - lo + len(done[0])],
                ids_out[qs - lo : qs - lo + len(done[0])],
            ) = done
            found.append(qs)
    return found


def _finished_anywhere(starts: list[int]) -> set[int]:
    """Collective: the query blocks that any rank already has (each rank holds only its own)."""
    every = dist.gather_object(starts)
    return set(dist.broadcast_object(sorted(set().union(*every)) if every is not None else None))
