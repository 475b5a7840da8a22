"""Clustering quality against ground truth: pairwise F, BCubed F, NMI and ARI.

NMI alone flatters over-segmentation (all singletons still score well), so the pair- and
element-based F scores are reported beside it. Label -1 (an ignored singleton) counts as a
cluster of its own.
"""

from __future__ import annotations

import numpy as np


def _own_singletons(pred: np.ndarray) -> np.ndarray:
    pred = np.asarray(pred, dtype=np.int64).copy()
    neg = pred < 0
    pred[neg] = pred.max(initial=-1) + 1 + np.arange(neg.sum())
    return pred


def quality(pred: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    # scikit-learn takes about a second to import: only a run with ground truth scores
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    pred = _own_singletons(pred)
    truth = np.asarray(truth, dtype=np.int64)
    _, p = np.unique(pred, return_inverse=True)
    _, t = np.unique(truth, return_inverse=True)
    n = len(p)
    # scipy.sparse takes ~0.4 s to import: only mining needs it, not the first step
    from scipy import sparse

    c = sparse.coo_matrix((np.ones(n), (p, t))).tocsr()
    c.sum_duplicates()
    nij = c.data
    a = np.asarray(c.sum(1)).ravel()  # predicted cluster sizes
    b = np.asarray(c.sum(0)).ravel()  # true cluster sizes
    tp = (nij * (nij - 1) / 2).sum()
    pred_pairs = (a * (a - 1) / 2).sum()
    true_pairs = (b * (b - 1) / 2).sum()
    pp = tp / pred_pairs if pred_pairs else 1.0
    pr = tp / true_pairs if true_pairs else 1.0
    rows, cols = c.nonzero()
    bp = (nij**2 / a[rows]).sum() / n
    br = (nij**2 / b[cols]).sum() / n
    f = lambda x, y: 2 * x * y / (x + y) if x + y else 0.0
    return {
        "pairwise_precision": float(pp),
        "pairwise_recall": float(pr),
        "pairwise_f": float(f(pp, pr)),
        "bcubed_precision": float(bp),
        "bcubed_recall": float(br),
        "bcubed_f": float(f(bp, br)),
        "nmi": float(normalized_mutual_info_score(t, p)),
        "ari": float(adjusted_rand_score(t, p)),
    }
