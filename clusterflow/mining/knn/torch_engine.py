"""The exact torch k-NN engine: chunked matrix products and top-k, on every local GPU (or the CPU),
or spread over every rank (``distributed_search``, ``mining.search=all``).

What it returns is defined without reference to how the work is split: a pair's similarity is one
fp32 dot product (:func:`pair_sims`: the products summed along the row, the same reduction for every
pair), and each query's list is the best by that similarity, ties by the smaller id. One device,
several devices, several ranks and any block shapes therefore agree bitwise.

Finding that list runs at the speed of a matmul + topk: a matrix product ranks every row (in bf16
on a GPU, fp32 on a CPU), keeps ``keep`` plus a small margin of candidates per query, and
:func:`pair_sims` gives the similarities of the first ``keep``. A matmul's sum runs in another order
than :func:`pair_sims`, but both lie within a bound of the exact sum (:func:`score_error`), so the
list is certain when its last similarity is above the best score left out plus that bound; this is
checked per query. The few queries where it is not (a near-tie at the cut) take the margin's
similarities too, and those still not certain are searched again against every row, keeping every
row whose score can reach the cut. The result never depends on the check's rounding, only its cost
does: rows whose cut lies among many equal similarities (duplicates) cost one similarity per tied
row.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from clusterflow.distributed import comm as dist
from clusterflow.mining.knn.common import NO_HOOKS, Blocks, SearchHooks, k_others

# fp32's unit roundoff; and bf16's, for inputs or outputs rounded to it.
_U32, _U16 = 2.0**-24, 2.0**-8
# Floats of gathered rows pair_sims holds at once (4 MB: in the cache).
_PAIRS_CACHED = 1 << 20
# Pairs whose similarities one re-check step holds at once (bounds its memory: x d floats).
_PAIR_BATCH = 1 << 22
# Candidate scores per tile on a CPU (16 MB in fp32, a part of the last-level cache), as at most
# _TILE_COLS database rows by at least _TILE_ROWS queries: enough queries for the matmul's speed,
# and long rows for topk, whose heap of the best c so far rejects most of a long row's scores at
# one comparison each (a short row pays the heap's filling again and again).
_TILE, _TILE_COLS, _TILE_ROWS = 1 << 22, 16384, 256
# Columns of a CPU tile per group in its top-c search (``_tile_top``).
_GROUP = 4
# Rows reaching a re-checked query's floor beyond ``keep``, on average, that make the re-check
# score each distinct row once instead.
_MANY_TIED = 64


def _sizes(
    n: int, k: int, query_batch: int, db_chunk: int, device: torch.device
) -> tuple[int, int, int]:
    """(k+1 capped at n, database chunk, query batch). A query batch is the unit of resume and
    of the abort check: on a GPU bounded by one block of scores (2**26 per database chunk), on a
    CPU (scored in tiles) by its work, 2**28 scores (a few seconds)."""
    kk = min(k + 1, n)
    db_chunk = min(db_chunk, 65536)
    cap = (1 << 26) // db_chunk if device.type == "cuda" else (1 << 28) // max(1, n)
    return kk, db_chunk, max(1, min(query_batch, cap))


def score_error(d: int, dtype: torch.dtype, device: torch.device) -> float:
    """A bound on |matmul score - pair_sims| of one pair, per unit of |q| |x|.

    Any order of summing d products in fp32 lies within gamma_d = d u / (1 - d u) of the exact sum
    (relative to the sum of |products|, itself at most |q| |x|); so do both sides. Inputs rounded
    to bf16 (bf16 candidates, or an fp32 matmul allowed to use TF32 or bf16) add 2 u_bf16, a bf16
    output one more u_bf16. A margin of 1% covers the rounding of the norms the bound is scaled by.
    """

    def gamma(m: int) -> float:
        return m * _U32 / (1 - m * _U32)

    low_inputs = dtype != torch.float32 or not _fp32_matmul_is_ieee(device)
    u_in = _U16 if low_inputs else 0.0
    u_out = _U16 if dtype != torch.float32 else 0.0
    matmul = (1 + u_in) ** 2 * (1 + gamma(d)) * (1 + u_out) - 1
    return 1.01 * (matmul + gamma(d + 1))


def _fp32_matmul_is_ieee(device: torch.device) -> bool:
    """Whether an fp32 matmul on ``device`` keeps fp32 inputs (torch may be set to round them to
    TF32 or bf16: ``torch.set_float32_matmul_precision`` and the per-backend settings)."""
    backend = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    return getattr(backend, "fp32_precision", "tf32") in ("none", "ieee")


def pair_sims(q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The similarity of query ``i`` and row ``idx[i, j]`` (``idx``: (m, c); or a flat pair list
    when ``q`` and ``idx`` have one row per pair): products rounded, then summed along the row by
    the same reduction whatever the shapes around it, so a pair's value never depends on which
    other pairs were computed with it. On a CPU, a few queries at a time, so that the rows
    gathered for them stay in the cache."""
    flat = idx.dim() == 1
    if flat:
        idx = idx.unsqueeze(1)
    m, c = idx.shape
    out = torch.empty((m, c), dtype=torch.float32, device=q.device)
    step = max(1, _PAIRS_CACHED // max(1, c * rows.shape[1])) if q.device.type == "cpu" else m
    for a in range(0, m, step):
        # index_select copies whole rows: many times faster on a CPU than 2-D indexing.
        picked = rows.index_select(0, idx[a : a + step].reshape(-1)).view(-1, c, rows.shape[1])
        torch.sum(picked.mul_(q[a : a + step].unsqueeze(1)), -1, out=out[a : a + step])
    return out[:, 0] if flat else out


def _tile_top(s: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(s, c, dim=1)`` of a tile of scores: the same values, descending (columns of
    equal scores may be others), at about half topk's cost on a CPU, where topk reads every score
    at a few ns each. Columns ``j, j + w, j + 2w, ...`` (``w = n // _GROUP``) form a group; the c
    groups with the largest maxima hold a top c of the row (a score among the top c lies in a
    group whose maximum is at least that score, and fewer than c other groups have a larger
    maximum), so topk reads the groups' maxima, one score in ``_GROUP`` (found by a vectorised
    max), then the c groups' scores and the last ``n % _GROUP`` columns."""
    r, n = s.shape
    width = n // _GROUP
    # On a GPU topk is cheap; on a CPU, below 64 scores per kept one topk leaves its fast path.
    if s.device.type != "cpu" or width < 64 * c or s.stride(1) != 1:
        return torch.topk(s, c, dim=1)
    maxima = s.as_strided((r, _GROUP, width), (s.stride(0), width, 1)).amax(1)
    groups = torch.topk(maxima, c, dim=1, sorted=False).indices
    cols = (groups.unsqueeze(2) + width * torch.arange(_GROUP, device=s.device)).view(r, -1)
    if n > width * _GROUP:
        tail = torch.arange(width * _GROUP, n, device=s.device)
        cols = torch.cat([cols, tail.expand(r, -1)], 1)
    v, o = torch.topk(torch.gather(s, 1, cols), c, dim=1)
    return v, torch.gather(cols, 1, o)


def _sorted_top(
    best_s: torch.Tensor, best_i: torch.Tensor, keep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` best per row: similarity descending, ties by the smaller id (a stable sort)."""
    order = torch.argsort(best_i, dim=1)
    best_s, best_i = torch.gather(best_s, 1, order), torch.gather(best_i, 1, order)
    order = torch.argsort(-best_s, dim=1, stable=True)
    return torch.gather(best_s, 1, order)[:, :keep], torch.gather(best_i, 1, order)[:, :keep]


class _Lists:
    """A query batch's candidates (scores ``g`` descending, row numbers ``gi``) and lists (the
    best ``keep`` by similarity: ``best_s``, ``best_i``), filled a tile at a time."""

    def __init__(self, m: int, cand: int, keep: int, device: torch.device) -> None:
        self.g = torch.empty((m, cand), dtype=torch.float32, device=device)
        self.gi = torch.empty((m, cand), dtype=torch.int64, device=device)
        self.best_s = torch.empty((m, keep), dtype=torch.float32, device=device)
        self.best_i = torch.empty((m, keep), dtype=torch.int64, device=device)


class ExactRows:
    """Rows searched exactly: ``top(q, keep)`` gives each query's ``keep`` best rows by
    :func:`pair_sims`, ties by the smaller id, ids shifted by ``id_offset``.

    ``candidate_dtype`` scores the candidates (bf16 on a GPU: the re-check makes the result the
    fp32 one); ``db_chunk`` rows are scored at a time.
    """

    def __init__(
        self, rows32: torch.Tensor, candidate_dtype: torch.dtype, id_offset: int, db_chunk: int
    ) -> None:
        self.rows32 = rows32
        self.rows_c = rows32.to(candidate_dtype) if candidate_dtype != rows32.dtype else rows32
        self.id_offset, self.db_chunk = id_offset, db_chunk
        n, d = rows32.shape
        top_norm = float(rows32.norm(dim=1).max()) if n else 0.0
        # Per unit of |q|: candidates' and the fp32 re-check's bounds; and an absolute term for
        # products that underflow (flushed to zero, or subnormal).
        self.err_c = score_error(d, candidate_dtype, rows32.device) * top_norm
        self.err32 = score_error(d, torch.float32, rows32.device) * top_norm
        self.tiny = 2.0 * (d + 1) * 2.0**-126
        # Candidates beyond ``keep``: the margin that makes a near-tie at the cut rare. bf16's
        # bound is wide, so it keeps as many again; fp32's grows with d, so does the margin.
        self.bf16 = candidate_dtype != torch.float32
        self.rechecked = 0  # queries searched again against every row, for the timings
        self.distinct: _Distinct | None = None  # built when a re-check finds many tied rows

    def _margin(self, keep: int) -> int:
        return keep + 16 if self.bf16 else 2 + self.rows32.shape[1] // 256

    def top(self, q32: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, m, dev = self.rows32.shape[0], q32.shape[0], q32.device
        keep = min(keep, n)
        if keep == 0 or m == 0:
            return (
                torch.empty((m, keep), dtype=torch.float32, device=dev),
                torch.empty((m, keep), dtype=torch.int64, device=dev),
            )
        out = _Lists(m, min(n, keep + self._margin(keep)), keep, dev)
        self._first_lists(q32, out)
        cand = out.g.shape[1]
        best_s, best_i, g, gi = out.best_s, out.best_i, out.g, out.gi
        if cand < n:
            # Every row left out scored at most the next candidate's score: certain when the
            # cut's similarity is above it plus the bound.
            bound = self.err_c * q32.norm(dim=1) + self.tiny
            unsure = ~(best_s[:, -1] > g[:, keep] + bound)
            if cand > keep + 1 and bool(unsure.any()):
                rows = unsure.nonzero()[:, 0]
                more = gi[rows, keep:]
                s, i = _sorted_top(
                    torch.cat([best_s[rows], pair_sims(q32[rows], self.rows32, more)], 1),
                    torch.cat([best_i[rows], more], 1),
                    keep,
                )
                best_s[rows], best_i[rows] = s, i
                unsure[rows] = ~(s[:, -1] > g[rows, cand - 1] + bound[rows])
            if bool(unsure.any()):
                self._recheck(q32, unsure.nonzero()[:, 0], best_s, best_i)
        return best_s, best_i + self.id_offset

    def _first_lists(self, q32: torch.Tensor, out: _Lists) -> None:
        """Every query's candidates and the list of its first ``keep`` (or of all, when every
        row is a candidate), into ``out``.

        On a CPU, in tiles of queries x database rows small enough (``_TILE`` scores) that topk
        reads the matmul's output from the cache instead of memory, each core taking its own
        tiles (one thread each: no core waits for another between two tiles); on a GPU, the
        whole query batch against ``db_chunk`` rows at a time (a GPU wants large matmuls)."""
        m, n = q32.shape[0], self.rows32.shape[0]
        if q32.device.type != "cpu":
            self._tile(q32, 0, m, min(n, self.db_chunk), out)
            return
        cols = min(n, self.db_chunk, _TILE_COLS)
        threads = torch.get_num_threads()
        # Equal tiles, as many for each thread, each at most _TILE scores (_TILE_ROWS at least).
        per_thread = -(-m // (threads * max(_TILE_ROWS, _TILE // cols)))
        rows = -(-m // (threads * per_thread))
        starts = range(0, m, rows)
        if threads == 1 or len(starts) == 1:
            for qs in starts:
                self._tile(q32, qs, rows, cols, out)
            return
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(threads) as pool:
                for done in [
                    pool.submit(self._tile, q32, qs, rows, cols, out, True) for qs in starts
                ]:
                    done.result()
        finally:
            torch.set_num_threads(threads)

    def _tile(
        self,
        q32: torch.Tensor,
        qs: int,
        rows: int,
        cols: int,
        out: _Lists,
        one_thread: bool = False,
    ) -> None:
        """Queries ``qs:qs+rows`` against every database row, ``cols`` at a time: their
        candidates and first lists into ``out``. ``one_thread``: on a worker thread, which torch
        would otherwise give all the cores."""
        if one_thread:
            torch.set_num_threads(1)
        q32 = q32[qs : qs + rows]
        q, n = q32.to(self.rows_c.dtype), self.rows_c.shape[0]
        cand, keep = out.g.shape[1], out.best_s.shape[1]
        parts_s, parts_i = [], []
        for ds in range(0, n, cols):
            s = q @ self.rows_c[ds : ds + cols].T
            sv, si = _tile_top(s.float(), min(cand, s.shape[1]))
            parts_s.append(sv)
            parts_i.append(si + ds if ds else si)
        if len(parts_s) == 1:
            g, gi = parts_s[0], parts_i[0]
        else:
            g, order = torch.topk(torch.cat(parts_s, 1), cand, dim=1)
            gi = torch.gather(torch.cat(parts_i, 1), 1, order)
        # With every row a candidate, all of them are ranked; else the first keep, then checked.
        first = gi if cand == n else gi[:, :keep]
        out.g[qs : qs + rows], out.gi[qs : qs + rows] = g, gi
        s, i = _sorted_top(pair_sims(q32, self.rows32, first), first, keep)
        out.best_s[qs : qs + rows], out.best_i[qs : qs + rows] = s, i

    def _recheck(
        self, q32: torch.Tensor, rows: torch.Tensor, best_s: torch.Tensor, best_i: torch.Tensor
    ) -> None:
        """Queries ``rows`` against every row, in fp32: the true list is among the rows whose
        score reaches the current cut's similarity less the bound (a member's similarity is at
        least the cut's); their similarities decide. Updates ``best_s``/``best_i`` in place, a
        group of queries at a time (their scores against ``db_chunk`` rows: ``_TILE`` floats).

        Rows with the same bits have the same similarity to any query, so when many rows reach
        the floor (a collapsed embedding: one vector everywhere) each distinct row is scored once
        and stands for its ``keep`` smallest ids."""
        self.rechecked += len(rows)
        group = max(1, _TILE // min(self.db_chunk, len(self.rows32)))
        for g in range(0, len(rows), group):
            self._recheck_group(q32, rows[g : g + group], best_s, best_i)

    def _recheck_group(
        self, q32: torch.Tensor, rows: torch.Tensor, best_s: torch.Tensor, best_i: torch.Tensor
    ) -> None:
        keep, d = best_s.shape[1], self.rows32.shape[1]
        q = q32[rows]
        floor = best_s[rows, -1] - (self.err32 * q.norm(dim=1) + self.tiny)
        top_s = torch.full((len(rows), keep), -torch.inf, device=q.device)
        top_i = torch.full((len(rows), keep), -1, dtype=torch.int64, device=q.device)
        found = torch.zeros(len(rows), dtype=torch.int64, device=q.device)
        table = self.distinct or _Distinct.identity(self.rows32)
        step = max(1, _PAIR_BATCH // d)
        for ds in range(0, len(table.rows), self.db_chunk):
            hit = (q @ table.rows[ds : ds + self.db_chunk].T) >= floor.unsqueeze(1)
            a, b = hit.nonzero(as_tuple=True)
            if self.distinct is None and len(a) > len(rows) * (keep + _MANY_TIED):
                self.distinct = _Distinct.of(self.rows32)
                if len(self.distinct.rows) < len(self.rows32):
                    return self._recheck_group(q32, rows, best_s, best_i)
            b += ds
            for ps in range(0, len(a), step):
                pa, ids = table.members(a[ps : ps + step], b[ps : ps + step], keep)
                sims = pair_sims(q[pa], table.rows, ids[1])
                found += torch.bincount(pa, minlength=len(rows))
                top_s, top_i = _merge_pairs(top_s, top_i, pa, ids[0], sims)
        # A query with fewer than keep rows at or above its floor has a non-finite value: its
        # first list stands.
        ok = found >= keep
        best_s[rows[ok]], best_i[rows[ok]] = top_s[ok], top_i[ok]
        return None


class _Distinct:
    """Rows with distinct bits, and the row numbers each stands for (ascending)."""

    def __init__(
        self, rows: torch.Tensor, order: torch.Tensor | None, starts: torch.Tensor | None
    ) -> None:
        self.rows, self.order, self.starts = rows, order, starts

    @classmethod
    def identity(cls, rows32: torch.Tensor) -> _Distinct:
        return cls(rows32, None, None)

    @classmethod
    def of(cls, rows32: torch.Tensor) -> _Distinct:
        bits, inverse = torch.unique(rows32.view(torch.int32), dim=0, return_inverse=True)
        order = torch.argsort(inverse, stable=True)  # grouped, ascending ids within a group
        counts = torch.bincount(inverse, minlength=len(bits))
        starts = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        return cls(bits.view(torch.float32), order, starts)

    def members(
        self, a: torch.Tensor, b: torch.Tensor, keep: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Pairs (query ``a``, distinct row ``b``) as pairs (query, row number): each distinct
        row's ``keep`` smallest row numbers. Returns the queries and (row numbers, the distinct
        row each was scored as)."""
        if self.order is None:
            return a, (b, b)
        take = torch.clamp(self.starts[b + 1] - self.starts[b], max=keep)
        a, b = a.repeat_interleave(take), b.repeat_interleave(take)
        nth = torch.arange(len(a), device=a.device) - torch.repeat_interleave(
            torch.cumsum(take, 0) - take, take
        )
        return a, (self.order[self.starts[b] + nth], b)


def _merge_pairs(
    top_s: torch.Tensor,
    top_i: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    s: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's best ``keep`` of its list (``top_s``/``top_i``, (m, keep)) and the pairs
    (query ``a``, row ``b``, similarity ``s``): similarity descending, ties by the smaller id."""
    m, keep = top_s.shape
    q = torch.cat([torch.arange(m, device=a.device).repeat_interleave(keep), a])
    ids = torch.cat([top_i.reshape(-1), b])
    sims = torch.cat([top_s.reshape(-1), s])
    # Lexicographic (query, -similarity, id) by stable sorts, the last key first; an empty slot
    # (-inf, -1) sorts after every real pair.
    order = torch.argsort(torch.where(ids < 0, torch.iinfo(torch.int64).max, ids), stable=True)
    order = order[torch.argsort(-sims[order], stable=True)]
    order = order[torch.argsort(q[order], stable=True)]
    starts = torch.cumsum(torch.bincount(q, minlength=m), 0) - torch.bincount(q, minlength=m)
    pick = order[(starts.unsqueeze(1) + torch.arange(keep, device=a.device)).reshape(-1)]
    return sims[pick].reshape(m, keep), ids[pick].reshape(m, keep)


def scoring_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """bf16 on a GPU, fp32 elsewhere, unless ``requested`` names one."""
    if requested == "auto":
        requested = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if requested == "bf16" else torch.float32


def _devices(device: str | list[str] | None) -> list[torch.device]:
    """The devices named, or by default every visible GPU, else the CPU."""
    if device is None:
        return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())] or [
            torch.device("cpu")
        ]
    return [torch.device(d) for d in ([device] if isinstance(device, str) else device)]


def torch_search(
    x: np.ndarray,
    k: int,
    query_batch: int = 65536,
    *,
    hooks: SearchHooks = NO_HOOKS,
    device: str | list[str] | None = None,
    db_chunk: int = 262144,
    candidate_dtype: str = "auto",
) -> tuple[np.ndarray, np.ndarray] | None:
    """Exact k nearest others of every row of ``x``; None when ``hooks.should_abort`` said so.

    ``device`` may name several devices: each holds a copy of the database and takes every n-th
    query batch, on its own thread (CUDA kernels and copies release the GIL), so the search scales
    with the GPUs of the node.
    """
    should_abort, timings, blocks = hooks.should_abort, hooks.timings, hooks.blocks
    t0 = time.perf_counter()
    n = x.shape[0]
    devices = _devices(device)
    kk, db_chunk, query_batch = _sizes(n, k, query_batch, db_chunk, devices[0])
    dtype = scoring_dtype(devices[0], candidate_dtype)
    # One copy of the database per device.
    replicas = [
        ExactRows(torch.from_numpy(np.ascontiguousarray(x)).to(dev), dtype, 0, db_chunk)
        for dev in devices
    ]
    t1 = time.perf_counter()
    sims_out = np.full((n, k), -np.inf, np.float32)
    ids_out = np.full((n, k), -1, np.int64)
    starts = list(range(0, n, query_batch))
    aborted = threading.Event()
    failures: list[BaseException] = []

    def worker(slot: int) -> None:
        db = replicas[slot]
        try:
            for qs in starts[slot :: len(replicas)]:
                done = blocks.get(qs, min(query_batch, n - qs)) if blocks is not None else None
                if done is None:
                    if aborted.is_set() or (should_abort and should_abort()):
                        aborted.set()
                        return
                    done = k_others(*db.top(db.rows32[qs : qs + query_batch], kk), qs, k)
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
        timings["rechecked"] = sum(db.rechecked for db in replicas)
    return sims_out, ids_out


def distributed_search(
    x_local: np.ndarray,
    offsets: list[int],
    k: int,
    device: torch.device | str,
    query_batch: int = 65536,
    db_chunk: int = 65536,
    *,
    hooks: SearchHooks = NO_HOOKS,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Exact k-NN spread over every rank (collective: all ranks call it).

    Rank r holds rows ``offsets[r]:offsets[r+1]`` of the normalised database. Each rank in turn
    broadcasts its rows as query blocks; every rank scores a block against its own rows and the
    partial top-k are all-gathered and merged by the block's owner. Returns this rank's rows'
    (sims, ids), k nearest others each, or None on every rank when any rank's ``should_abort``
    said so (checked before each block). ``blocks``: each rank's own finished blocks (the owner
    keeps a block); every rank skips the blocks some owner already has.
    """
    should_abort, timings, blocks = hooks.should_abort, hooks.timings, hooks.blocks
    t0 = time.perf_counter()
    rank, world = dist.rank(), dist.world()
    n, d = offsets[-1], x_local.shape[1]
    dev = torch.device(device)
    kk, db_chunk, query_batch = _sizes(n, k, query_batch, db_chunk, dev)
    db = ExactRows(
        torch.from_numpy(np.ascontiguousarray(x_local, dtype=np.float32)).to(dev),
        scoring_dtype(dev),
        offsets[rank],
        db_chunk,
    )
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
                db.rows32[qs - o_lo : qs - o_lo + m].contiguous()
                if rank == owner
                else torch.empty((m, d), dtype=torch.float32, device=dev)
            )
            dist.broadcast_tensor(q, src=owner)
            s = torch.full((m, kk), -torch.inf, device=dev)
            i = torch.full((m, kk), -1, dtype=torch.int64, device=dev)
            if len(x_local):
                ps, pi = db.top(q, kk)
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
        timings["rechecked"] = db.rechecked
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
