"""Mining methods side by side: mutual k-NN at a fixed threshold, at the best fixed threshold (an
oracle that reads the labels), at threshold="auto", FINCH (every level; the chosen one marked),
k-means with the true k, and Louvain (networkx) as a reference; NMI, ARI and cluster counts on the
same k-NN lists.

    python benchmarks/mining_methods.py             # digits (k=10) and demo-like identities
    python benchmarks/mining_methods.py --curve     # also the digits' per-threshold curve
    python benchmarks/mining_methods.py --k-sweep   # also the digits across k
    python benchmarks/mining_methods.py --demo-run PATH ...   # a demo model's embeddings
    python benchmarks/mining_methods.py --timing    # 200k x 128, k=20: curve, FINCH vs the search

Demo embeddings: `python -m clusterflow.submit configs/demo.yaml --local run.dir=/tmp/demo18
checkpoint.keep_last=20`, then pass the checkpoints at the epoch ends as PATH
(RUN_DIR/checkpoints/step-31, -62, -93, -124).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from clusterflow.mining import curves, finch
from clusterflow.mining.clustering import clusters_from_graph, mutual_edges, normalize
from clusterflow.mining.knn import KnnParams, search
from clusterflow.mining.mutual_graph import MutualGraph, mutual_graph
from clusterflow.mining.quality import quality

EXACT = KnnParams(k=1, engine="faiss")  # FAISS flat: exact


def faiss_search(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    return search(x, KnnParams(k=k, engine="faiss"))


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x - x.mean(0)).astype(np.float32), y


def identities(nuisance_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The demo's synthetic identities (200 x 20, run.seed 0) as raw inputs, before any encoder."""
    from clusterflow.tasks.pseudo_id import IdentityWorld, SyntheticIdentities

    ds = SyntheticIdentities(
        0, IdentityWorld(200, 64, 8, 16, nuisance_scale, 0.1), 20, augment=False
    )
    return ds.base, ds.labels


def demo_embeddings(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Embed the demo's data with a saved model: PATH is a run dir (model.pt) or a checkpoint
    dir."""
    import torch
    import yaml

    run_dir = (
        path
        if os.path.exists(os.path.join(path, "config.yaml"))
        else os.path.dirname(os.path.dirname(path))
    )
    cfg = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    from clusterflow.tasks.pseudo_id import PseudoIDTask

    task = PseudoIDTask(seed=cfg["run"]["seed"], **cfg["task"].get("params", {}))
    model = task.build_model()
    model.load_state_dict(torch.load(os.path.join(path, "model.pt"), weights_only=True))
    model.eval()
    ds = task.embed_dataset()
    with torch.no_grad():
        return model(torch.from_numpy(ds.base)).numpy(), ds.labels


def row(name: str, labels: np.ndarray, truth: np.ndarray, note: str = "") -> str:
    sizes = np.bincount(labels)
    q = quality(labels, truth)
    return (
        f"| {name} | {len(sizes)} | {sizes.max()} | {(sizes == 1).sum()} | {q['nmi']:.3f} | "
        f"{q['ari']:.3f} | {note} |"
    )


def louvain(graph: MutualGraph) -> np.ndarray:
    import networkx as nx

    g = nx.Graph()
    g.add_nodes_from(range(graph.n))
    g.add_weighted_edges_from(
        zip(graph.u.tolist(), graph.v.tolist(), np.maximum(graph.w, 0).astype(float).tolist())
    )
    labels = np.empty(graph.n, np.int64)
    for c, members in enumerate(nx.community.louvain_communities(g, weight="weight", seed=0)):
        labels[list(members)] = c
    return labels


def table(name: str, x_raw: np.ndarray, truth: np.ndarray, k: int, fixed: float) -> list[str]:
    from sklearn.cluster import KMeans

    x = normalize(x_raw)
    sims, ids = faiss_search(x, k)
    graph = mutual_graph(sims, ids)
    curve = curves.threshold_curve(sims, ids, truth=truth, graph=graph)
    # one fixed threshold, as mutual_knn_clusters clusters
    at = lambda t: clusters_from_graph(mutual_edges(sims, ids, t))
    best = float(curve.thresholds[int(np.argmax(curve.nmi))])
    auto = curve.auto()
    out = [
        f"\n{name}: N={len(x)}, true clusters {len(np.unique(truth))}, k={k}\n",
        "| method | clusters | largest | singletons | NMI | ARI | note |",
        "|---|---|---|---|---|---|---|",
        row(f"mutual k-NN, threshold {fixed}", at(fixed), truth),
        row("mutual k-NN, best fixed threshold (oracle)", at(best), truth, f"threshold {best}"),
        row("mutual k-NN, threshold auto", at(auto), truth, f"threshold {auto}"),
    ]
    levels = finch.finch_levels(x, ids, finch.default_search(EXACT))
    _, info = finch.finch_clusters(x, sims, ids, search=finch.default_search(EXACT), graph=graph)
    for i, level in enumerate(levels):
        note = f"silhouette {info['silhouette'][i]:.3f}, modularity {info['modularity'][i]:.3f}"
        out.append(
            row(
                f"FINCH level {i}" + (" (chosen)" if i == info["level"] else ""), level, truth, note
            )
        )
    kmeans = KMeans(len(np.unique(truth)), n_init=10, random_state=0).fit_predict(x_raw)
    out.append(
        row(f"k-means, true k={len(np.unique(truth))} (on the input as given)", kmeans, truth)
    )
    out.append(row("Louvain on the mutual graph (networkx, reference)", louvain(graph), truth))
    return out


def print_curve(x_raw: np.ndarray, truth: np.ndarray, k: int, every: int) -> None:
    sims, ids = faiss_search(normalize(x_raw), k)
    curve = curves.threshold_curve(sims, ids, truth=truth)
    auto = curve.auto()
    print(f"\nper-threshold curve, k={k} (every {every}th grid point, and the auto one)\n")
    print(
        "| threshold | clusters | singletons | largest | mutual edges | modularity | NMI | ARI |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for i, t in enumerate(curve.thresholds):
        if i % every == 0 or t == auto:
            r = curve.row(t)
            mark = " (auto)" if t == auto else ""
            print(
                f"| {t:.4f}{mark} | {r['num_clusters']} | {r['num_singletons']} | "
                f"{r['largest_cluster']} | {r['mutual_edges']} | {r['modularity']:.3f} | "
                f"{r['nmi']:.3f} | {r['ari']:.3f} |"
            )


def k_sweep(x_raw: np.ndarray, truth: np.ndarray, fixed: float) -> None:
    """NMI at the fixed threshold, at auto and at the best grid threshold (oracle), across k."""
    print(
        f"\ndigits across k\n\n"
        f"| k | NMI at {fixed} | auto threshold | NMI auto | oracle threshold | NMI oracle |\n"
        "|---|---|---|---|---|---|"
    )
    x = normalize(x_raw)
    for k in (5, 8, 10, 12, 15, 20):
        sims, ids = faiss_search(x, k)
        curve = curves.threshold_curve(sims, ids, truth=truth)
        auto, best = int(np.argmax(curve.modularity)), int(np.argmax(curve.nmi))
        at = quality(clusters_from_graph(mutual_edges(sims, ids, fixed)), truth)["nmi"]
        print(
            f"| {k} | {at:.3f} | {curve.thresholds[auto]:.4f} | {curve.nmi[auto]:.3f} | "
            f"{curve.thresholds[best]:.4f} | {curve.nmi[best]:.3f} |"
        )


def timing(n: int, d: int, k: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mining import data

    x = normalize(data(n, d))
    rng = np.random.default_rng(
        0
    )  # data()'s first draws again, for its ground truth (each row's centre)
    centres = rng.standard_normal((max(2, n // 20), d))
    truth = rng.integers(0, len(centres), n)
    faiss_search(x[:1000], k)  # warm up (imports, thread pool)
    t0 = time.perf_counter()
    sims, ids = faiss_search(x, k)
    t_search = time.perf_counter() - t0
    t0 = time.perf_counter()
    clusters_from_graph(mutual_edges(sims, ids, 0.5))
    t_today = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = mutual_graph(sims, ids)
    t_graph = time.perf_counter() - t0
    t0 = time.perf_counter()
    curve = curves.threshold_curve(sims, ids, graph=graph)
    t_curve = time.perf_counter() - t0
    t0 = time.perf_counter()
    with_truth = curves.threshold_curve(sims, ids, truth=truth, graph=graph)
    t_truth = time.perf_counter() - t0
    t0 = time.perf_counter()
    merges = curves.merge_similarities(graph)
    t_merges = time.perf_counter() - t0
    t0 = time.perf_counter()
    _labels, info = finch.finch_clusters(
        x, sims, ids, search=finch.default_search(EXACT), graph=graph
    )
    t_finch = time.perf_counter() - t0
    print(
        f"N={n} d={d} k={k} cores={os.cpu_count()}, {len(graph.w)} mutual edges, "
        f"{len(curve.thresholds)} thresholds"
    )
    print(f"faiss flat search (k nearest others):          {t_search:8.2f} s")
    print(
        f"today's mutual filter + components (one t):     {t_today:8.2f} s   "
        f"{t_today / t_search:.4f} of the search"
    )
    print(
        f"mutual graph (sorted edges):                    {t_graph:8.2f} s   "
        f"{t_graph / t_search:.4f} of the search"
    )
    print(
        f"curve over the grid (modularity, no labels):    {t_curve:8.2f} s   "
        f"{t_curve / t_search:.4f} of the search"
    )
    print(
        f"the same with NMI/ARI at every grid point:      {t_truth:8.2f} s   "
        f"{t_truth / t_search:.4f} of the search"
    )
    print(
        f"cluster counts at all {len(merges)} merges (MST):   {t_merges:8.2f} s   "
        f"{t_merges / t_search:.4f} of the search"
    )
    print(
        f"auto threshold {curve.auto()}: NMI "
        f"{with_truth.nmi[np.argmax(with_truth.modularity)]:.3f}, best on the grid "
        f"{with_truth.nmi.max():.3f}"
    )
    print(
        f"FINCH, levels of {info['num_clusters']} clusters, level {info['level']} chosen by "
        "silhouette:"
    )
    print(
        f"   searches over the means + the choice:        {t_finch:8.2f} s   "
        f"{t_finch / t_search:.4f} of the search"
    )
    keep_files(x, sims, ids, t_search)


def keep_files(x: np.ndarray, sims: np.ndarray, ids: np.ndarray, t_search: float) -> None:
    """What mining.resume costs a round, as if one rank held every row: commit the embeddings
    (float32, fsynced), commit every query block of the search in one batch, read both back."""
    import tempfile

    from clusterflow.mining.rounds import RoundFiles

    qb = 65536
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        files = RoundFiles(root, 1, 0, "key")
        t0 = time.perf_counter()
        files.save_shard(np.arange(len(x)), x, 1.0)
        t_shard = time.perf_counter() - t0
        blocks = files.search_blocks(every_s=3600)
        t0 = time.perf_counter()
        for start in range(0, len(x), qb):
            blocks.put(start, sims[start : start + qb], ids[start : start + qb])
        blocks.flush()
        t_blocks = time.perf_counter() - t0
        t0 = time.perf_counter()
        files.load_shard()
        back = files.search_blocks()
        assert back.get(0, min(qb, len(x))) is not None
        t_read = time.perf_counter() - t0
    mb = (x.nbytes + sims.nbytes + ids.nbytes) / 2**20
    print(
        f"mining.resume, {mb:.0f} MB: embeddings kept   {t_shard:8.2f} s   "
        f"{t_shard / t_search:.4f} of the search"
    )
    print(
        f"   every query block kept (one batch):          {t_blocks:8.2f} s   "
        f"{t_blocks / t_search:.4f} of the search"
    )
    print(
        f"   both read back and verified (a resume):      {t_read:8.2f} s   "
        f"{t_read / t_search:.4f} of the search"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--k", type=int, default=10)
    p.add_argument(
        "--threshold",
        type=float,
        default=0.6,
        help="the fixed threshold to compare with (the demo's)",
    )
    p.add_argument(
        "--demo-run",
        action="append",
        default=[],
        help="a demo run dir or checkpoint dir (repeatable)",
    )
    p.add_argument("--curve", action="store_true", help="print the digits' per-threshold curve")
    p.add_argument(
        "--no-tables",
        action="store_true",
        help="skip the methods tables (with --curve or --k-sweep)",
    )
    p.add_argument(
        "--k-sweep",
        action="store_true",
        help="print the digits' NMI at the fixed, auto and best threshold across k",
    )
    p.add_argument(
        "--timing",
        action="store_true",
        help="time the curve and FINCH against the search at --n x --d, k=20",
    )
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--d", type=int, default=128)
    a = p.parse_args()
    if a.timing:
        timing(a.n, a.d, 20)
        return
    sets = [("digits, raw pixels centred", digits())]
    sets += [
        (f"demo identities, raw inputs, nuisance_scale {s}", identities(s)) for s in (0.5, 1.0, 1.5)
    ]
    sets = (
        []
        if a.no_tables
        else sets + [(f"demo embeddings, {path}", demo_embeddings(path)) for path in a.demo_run]
    )
    for name, (x, y) in sets:
        print("\n".join(table(name, x, y, a.k, a.threshold)))
    if a.curve:
        print_curve(*digits(), a.k, every=8)
    if a.k_sweep:
        k_sweep(*digits(), a.threshold)


if __name__ == "__main__":
    main()
