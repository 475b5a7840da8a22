"""Mining quality of an image-folder run, per round, next to baselines on the raw pixels.

    python -m clusterflow.submit configs/images_digits.yaml --local
    python benchmarks/digits_quality.py runs/images_digits

Prints one markdown table: every mining round of the run (from its status.json), the run's final
model (its embeddings clustered the same way, and by k-means with one cluster per class), and on
the same images' raw pixels at their native size, centred: k-means with one cluster per class
(scikit-learn, n_init=10) and mutual k-NN at the run's mining.k / threshold / max_cluster_size
and at k=5, threshold 0.7 (the best raw-pixel setting we found for the digits). All against the
class folders as ground truth.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from clusterflow import config as cfgmod
from clusterflow import rundir
from clusterflow.mining import mutual_knn_clusters
from clusterflow.mining.quality import quality


def row(name: str, labels: np.ndarray, truth: np.ndarray) -> str:
    q = quality(labels, truth)
    sizes = np.bincount(labels[labels >= 0])
    return (
        f"| {name} | {len(sizes)} | {int(sizes.max())} | {q['nmi']:.3f} | {q['ari']:.3f} | "
        f"{q['pairwise_f']:.3f} | {q['bcubed_f']:.3f} |"
    )


def embeddings(task, model=None) -> np.ndarray:
    import torch

    ds = task.embed_dataset()
    out = []
    with torch.no_grad():
        for start in range(0, len(ds), 512):
            x = torch.stack([ds[i]["x"] for i in range(start, min(start + 512, len(ds)))])
            out.append(model(x) if model is not None else x.flatten(1))
    return torch.cat(out).numpy().astype(np.float32)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_dir")
    p.add_argument(
        "--pixels",
        type=int,
        default=8,
        help="side of the raw-pixel baseline images (8: the digits' native size)",
    )
    args = p.parse_args()
    import torch
    from sklearn.cluster import KMeans

    from clusterflow.tasks import load_task

    cfg = cfgmod.load(rundir.path(args.run_dir, rundir.CONFIG))
    params = {k: v for k, v in cfg.task.params.items() if k != "make_digits"}
    task = load_task(cfg.task.target, cfg.run.seed, params)
    truth = task.ground_truth()
    if truth is None:
        raise SystemExit(
            f"{cfg.task.params.get('root')} is a flat folder: no ground truth to compare with"
        )
    m = cfg.mining
    status = rundir.read_json(rundir.path(args.run_dir, "status.json"), {}) or {}
    classes = len(np.unique(truth))
    print(
        f"{len(truth)} images, {classes} classes; mining k={m.k}, threshold={m.threshold}, "
        f"max_cluster_size={m.max_cluster_size}\n"
    )
    print("| clustering | clusters | largest | NMI | ARI | pairwise F | BCubed F |")
    print("|---|---|---|---|---|---|---|")
    for r in status.get("mining", []):
        print(
            f"| round after epoch {r['epoch']} | {r['num_clusters']} | {r['largest_cluster']} | "
            f"{r['nmi']:.3f} | {r['ari']:.3f} | {r['pairwise_f']:.3f} | {r['bcubed_f']:.3f} |"
        )
    final = rundir.path(args.run_dir, "model.pt")
    if os.path.exists(final):
        model = task.build_model()
        model.load_state_dict(torch.load(final, map_location="cpu", weights_only=True))
        z = embeddings(task, model.eval())
        print(
            row(
                f"final model, mutual k-NN (k={m.k}, t={m.threshold})",
                mutual_knn_clusters(z, m.k, m.threshold, max_cluster_size=m.max_cluster_size),
                truth,
            )
        )
        print(
            row(
                f"final model, k-means (k={classes})",
                KMeans(classes, n_init=10, random_state=0).fit_predict(z),
                truth,
            )
        )
    pix_task = load_task(cfg.task.target, cfg.run.seed, {**params, "image_size": args.pixels})
    x = embeddings(pix_task)
    x = x - x.mean(0)
    print(
        row(
            f"pixels, k-means (k={classes})",
            KMeans(classes, n_init=10, random_state=0).fit_predict(x),
            truth,
        )
    )
    print(
        row(
            f"pixels, mutual k-NN (k={m.k}, t={m.threshold})",
            mutual_knn_clusters(x, m.k, m.threshold, max_cluster_size=m.max_cluster_size),
            truth,
        )
    )
    print(row("pixels, mutual k-NN (k=5, t=0.7)", mutual_knn_clusters(x, 5, 0.7), truth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
