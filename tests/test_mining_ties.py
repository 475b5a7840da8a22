"""Embeddings that are all identical (a collapsed model) tell no sample from another: the clusters
that tie-breaking makes of them are not a result, and mining says so."""

import logging
import warnings

import numpy as np
import pytest

from clusterflow.mining import mutual_knn_clusters
from clusterflow.mining.clustering import tie_warning


def test_all_identical_embeddings_warn_that_the_clusters_are_tie_breaking():
    with pytest.warns(UserWarning, match="identical") as caught:
        labels = mutual_knn_clusters(np.ones((200, 16), np.float32), k=5, threshold=0.5)
    assert len(set(labels)) > 1  # what tie-breaking makes of them, now named
    assert "200 samples" in str(caught[0].message)


def test_distinct_embeddings_do_not_warn():
    x = np.random.default_rng(0).normal(size=(200, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sims = np.sort(x @ x.T, axis=1)[:, ::-1][:, 1:6]
    assert tie_warning(sims, np.zeros_like(sims, dtype=np.int64)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mutual_knn_clusters(x, k=5, threshold=0.5)


def test_a_mining_round_on_identical_embeddings_logs_it(caplog):
    """Miner._cluster, rank 0's part of a round, on the k-NN lists of identical embeddings."""
    from types import SimpleNamespace

    from clusterflow.config.sections import MiningConfig
    from clusterflow.mining.stage import Miner

    n, k = 60, 5
    sims = np.ones((n, k), np.float32)
    ids = np.array([[(i + j + 1) % n for j in range(k)] for i in range(n)], np.int64)
    miner = SimpleNamespace(cfg=MiningConfig(k=k, threshold=0.5), params=None)
    task = SimpleNamespace(ground_truth=lambda: None)
    with caplog.at_level(logging.WARNING, logger="clusterflow"):
        Miner._cluster(miner, task, (sims, ids), None, n, 3, engine="torch", seconds={})
    assert "identical" in caplog.text and "60 samples" in caplog.text, caplog.text
