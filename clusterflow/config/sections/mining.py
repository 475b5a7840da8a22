"""The mining round between epochs (``mining.*``).

Read by ``mining/stage.py`` (``Miner``), ``mining/adapter.py`` (when a round is due),
``mining/knn/common.py`` (``KnnParams``) and ``observe/observer.py`` (the round's allowance).
Every key applies to a task and to a script (``run.mine``).
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterflow.config.sections.fields import (
    INT32,
    NUMERICS,
    RESOURCE,
    RESULT,
    YEAR_S,
    check,
    choice,
    doc,
)


@dataclass
class MiningConfig:
    """The pseudo-label mining stage run between epochs."""

    enabled: bool = doc(
        True, "Run the mining stage (only for tasks that can embed).", kind=RESULT, why="mining"
    )
    every_epochs: int = doc(1, "Mine after every N-th epoch.", kind=RESULT, why="mining")
    start_epoch: int = doc(
        1,
        "First epoch (1-based, counted as finished epochs) after which mining runs.",
        kind=RESULT,
        why="mining",
    )
    k: int = doc(10, "Neighbours per sample in the k-NN graph.", kind=RESULT, why="mining")
    embed_with: str = doc(
        "model",
        "Which weights embed the data for mining: model (the trained weights) or ema (their "
        "moving average, train.ema_decay > 0: a teacher).",
        kind=RESULT,
        why="mining",
    )
    method: str = doc(
        "mutual_knn",
        "How labels come from the k-NN lists: mutual_knn (mutual edges >= threshold, "
        "connected components) or finch (first-neighbour clustering hierarchy, no "
        "threshold; the level of highest silhouette). docs/mining.md compares them.",
        kind=RESULT,
        why="mining",
    )
    threshold: float | str = doc(
        0.5,
        "mutual_knn: minimum cosine similarity of a kept mutual edge, or auto: each round, the "
        "threshold of highest modularity on that round's threshold curve.",
        kind=RESULT,
        why="mining",
    )
    index: str = doc(
        "flat",
        "FAISS index: flat (exact), ivf or hnsw.",
        kind=RESULT,
        why="approximate indexes find other neighbours",
    )
    engine: str = doc(
        "auto",
        "k-NN engine: auto, faiss or torch (exact chunked matmul + top-k).",
        kind=RESULT,
        why="FAISS and torch may break similarity ties differently",
    )
    search: str = doc(
        "rank0",
        "Where the k-NN search runs: rank0 (every embedding gathered to rank 0, which "
        "searches on all its GPUs or cores), all (every rank searches its own block with "
        "the exact torch engine; query blocks are broadcast and the partial top-k merged) or "
        "sharded (every rank indexes only its own shard with mining.engine and mining.index, "
        "query blocks travel a ring of ranks, and the mutual edges, components and curves are "
        "computed across ranks: no rank holds every embedding or every k-NN list).",
        kind=RESULT,
        why="decides the engine",
    )
    nlist: int = doc(1024, "ivf: number of inverted lists.", kind=RESULT, why="approximate search")
    nprobe: int = doc(16, "ivf: lists visited per query.", kind=RESULT, why="approximate search")
    hnsw_m: int = doc(32, "hnsw: graph degree M.", kind=RESULT, why="approximate search")
    ef_search: int = doc(128, "hnsw: efSearch.", kind=RESULT, why="approximate search")
    query_batch: int = doc(
        65536,
        "Queries per search batch (bounds rank 0's memory).",
        kind=NUMERICS,
        why="FAISS picks its distance kernel by query block size",
    )
    embed_batch: int = doc(
        512,
        "Samples per embedding batch on each rank.",
        kind=NUMERICS,
        why="batched kernels sum in an order that depends on the batch size",
    )
    singletons: str = doc(
        "cluster",
        "cluster: a sample without edges is its own cluster; "
        "ignore: it gets label -1, which losses skip.",
        kind=RESULT,
        why="mining",
    )
    max_cluster_size: int = doc(
        0,
        "Split components larger than this by raising the threshold inside them; 0 disables.",
        kind=RESULT,
        why="mining",
    )
    timeout_s: int = doc(
        3600,
        "The longest the k-NN search may take (rank 0's gather, index and search). With the "
        "watchdog on (dist.stall_s), a search that takes longer ends the job and is named as the "
        "cause; the other ranks wait for it dist.stall_s plus the watchdog's grace for a "
        "waiting rank (max(10 s, dist.stall_s / 4)) longer, so their timeout never comes first.",
        kind=RESOURCE,
        why="how long ranks wait for rank 0's search",
    )
    resume: bool = doc(
        True,
        "Keep each rank's embeddings and the finished k-NN query "
        "blocks of a round in RUN_DIR/mining/ until its labels are "
        "committed, so a round cut short resumes where it stopped.",
        kind=RESOURCE,
        why=(
            "a round read back from its files gives the labels of one computed anew, and mining "
            "leaves the random streams as it found them"
        ),
    )

    def __post_init__(self) -> None:
        check(self.every_epochs >= 1, "mining.every_epochs", self.every_epochs, "must be >= 1")
        check(self.start_epoch >= 1, "mining.start_epoch", self.start_epoch, "must be >= 1")
        check(self.k >= 1, "mining.k", self.k, "must be >= 1")
        check(
            self.k <= INT32,
            "mining.k",
            self.k,
            f"must be at most {INT32} (FAISS takes it as a C int)",
        )
        if isinstance(self.threshold, str):
            check(
                self.threshold == "auto",
                "mining.threshold",
                self.threshold,
                "must be a number between -1 and 1, or auto",
            )
        else:
            check(
                -1.0 <= self.threshold <= 1.0,
                "mining.threshold",
                self.threshold,
                "is a cosine similarity: between -1 and 1, or auto",
            )
        choice("mining.method", self.method, ("mutual_knn", "finch"))
        choice("mining.embed_with", self.embed_with, ("model", "ema"))
        choice("mining.index", self.index, ("flat", "ivf", "hnsw"))
        choice("mining.engine", self.engine, ("auto", "faiss", "torch"))
        choice("mining.singletons", self.singletons, ("cluster", "ignore"))
        choice("mining.search", self.search, ("rank0", "all", "sharded"))
        check(
            self.search != "sharded" or self.method != "finch",
            "mining.method",
            self.method,
            "needs every embedding on rank 0 (cluster means and a search at every level), "
            "which mining.search=sharded never gathers; set mining.search=rank0",
        )
        if self.search == "all":
            check(
                self.engine != "faiss",
                "mining.engine",
                self.engine,
                "cannot run with mining.search=all, which uses the "
                "exact torch engine; set mining.engine=auto or torch",
            )
            check(
                self.index == "flat",
                "mining.index",
                self.index,
                "is a FAISS index; mining.search=all is exact (flat) "
                "search: set mining.index=flat or mining.search=rank0",
            )
            check(
                self.method != "finch",
                "mining.method",
                self.method,
                "needs every embedding on rank 0 (cluster means at every level), "
                "which mining.search=all never gathers; set mining.search=rank0",
            )
        check(
            self.method != "finch" or not self.max_cluster_size,
            "mining.max_cluster_size",
            self.max_cluster_size,
            "splits components by raising a threshold, which "
            "mining.method=finch does not have; set it to 0",
        )
        for key in ("nlist", "nprobe", "hnsw_m", "ef_search", "query_batch", "embed_batch"):
            # FAISS takes these as C ints
            check(
                1 <= getattr(self, key) <= INT32,
                f"mining.{key}",
                getattr(self, key),
                f"must be between 1 and {INT32}",
            )
        check(
            self.max_cluster_size >= 0,
            "mining.max_cluster_size",
            self.max_cluster_size,
            "must be >= 0",
        )
        check(
            10 <= self.timeout_s <= YEAR_S,
            "mining.timeout_s",
            self.timeout_s,
            f"must be between 10 and {YEAR_S} seconds (a year)",
        )
