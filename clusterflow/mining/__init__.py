"""Pseudo-labels between epochs: the mining stage and the pure functions behind it.

- ``stage.py``: one round (embed, search, cluster, broadcast): :class:`Miner`;
- ``rounds.py``: a round's work on disk, so a round cut short resumes;
- ``knn/``: the k nearest others, behind one interface (FAISS or exact torch engines), and the
  search sharded over every rank (``knn/sharded.py``);
- ``mutual_graph.py``, ``clustering.py``, ``curves.py``, ``finch.py``: the mutual k-NN graph,
  its components, threshold curves, FINCH (pure, tested against brute force);
- ``sharded_graph.py``, ``sharded_curves.py``: the same graph, components and curves computed
  across ranks, each holding its own rows (``mining.search=sharded``);
- ``quality.py``: NMI, ARI, pairwise and BCubed F against ground truth;
- ``figure.py``: a round's curve as an image for TensorBoard.

``clusterflow.mining.mutual_knn_clusters`` is a public contract (docs/mining.md).
"""

from clusterflow.mining.clustering import cluster_stats, mutual_knn_clusters, normalize

__all__ = ["cluster_stats", "mutual_knn_clusters", "normalize"]
